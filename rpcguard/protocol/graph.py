"""GRAPH_COMPUTE validation (spec §3.2 and the "GRAPH_COMPUTE invariants" of §6.2).

Stays whole (over 400 lines): ``GraphValidator.check`` is one pass over one payload whose column
views (ids, src columns, positions, raw chunks) every step shares, so its parts would only move
those seven arguments between modules; the work buffer (workbuf.py), compute (cost.py) and per-op
rules (opcheck.py, oprules/) are already apart.

How this works: a decode graph is validated for every generated token, so the structure is read
column-wise instead of tensor by tensor. The tensor area (m × 296 bytes) is viewed as u64 and
u32 arrays (``memoryview.cast``) and strided slices pull out every tensor's id, src[0..9],
view_src, op and use_count in C; sets, dicts and ``map`` then check uniqueness, presence and
order without a Python loop per tensor. The per-tensor rules (tensor.py) run only for tensors
whose 296 raw bytes are not in ``SessionState.tensor_cache`` (weights repeat every token), and
the op-specific rules only for the few nodes whose op needs them.

What the real client guarantees, and is therefore enforced (ggml-rpc.cpp ``serialize_graph`` /
``add_tensor``, llama-cpp-python 0.3.36): the tensor list is every node plus, transitively,
every src and view_src, de-duplicated, in depth-first post-order: a tensor's srcs and view_src
always come before it. Nodes are a contiguous slice of a topologically sorted ggml graph
(``ggml_graph_view``), so each node is first reached by its own ``add_tensor`` call and node
positions in the tensor list strictly increase. Both properties together imply that no node
references a node that appears later.

Op rules need the op ids of the version (``ggml.op_table``). Versions without a verified op
table (before 3.6.1 op ids were not tied to the protocol version; 4.0.1 and 4.0.3 were not read)
skip every op-id rule, including the custom-op deny rule: OP_COUNT-9..OP_COUNT-6 cannot be
derived without OP_COUNT either, and a guessed table would refuse real traffic.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from itertools import compress, filterfalse, islice, repeat
from operator import ge, gt, lt
from typing import AbstractSet, Callable, Final, Literal, Mapping, Protocol

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.backend import backend_layer, check_backend, check_fusions
from rpcguard.protocol.costprofile import check_budget, node_cost
from rpcguard.protocol.cost import flops
from rpcguard.protocol.opcheck import check_layout, check_node, check_reach, check_sources
from rpcguard.protocol.oprules import OpRule, needs_containment, rule_for
from rpcguard.protocol.oprules.cudafusion import HEADS as FUSION_HEADS
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.tensor import (
    CHECK_BUFFER,
    CHECK_TENSOR,
    STRICT,
    TENSOR_CACHE_MAX,
    RpcTensor,
    check_tensor,
    decode_tensor,
    nbytes,
)
from rpcguard.protocol.versions import TENSOR_BYTES, Version
from rpcguard.protocol.workbuf import ONE_TASK_OPS, work_bytes
from rpcguard.protocol.workuse import check_work_use

__all__ = [
    "GraphValidator", "GraphPolicy", "Clock", "set_clock", "OpRules", "op_rules", "coverage", "GGML_MAX_SRC",
    "NODE_CACHE_MAX", "MAX_GRAPH_COMPUTE_S", "NODE_GFLOPS", "MAX_WORK_BYTES", "SERVER_THREADS",
]

GGML_MAX_SRC: Final = 10
_U32: Final = struct.Struct("<I")
_LITTLE: Final = sys.byteorder == "little"
# u64 words per rpc_tensor; fields at byte offsets ≡ 4 (mod 8) are read from a view shifted by 4.
_Q: Final = TENSOR_BYTES // 8  # 37
_I: Final = TENSOR_BYTES // 4  # 74
_Q_ID: Final = 0  # id @0
_Q4_SRC: Final = 15  # src[0] @124 = 4 + 8*15
_Q4_VIEW_SRC: Final = 25  # view_src @204 = 4 + 8*25
_I_OP: Final = 13  # op @52
_I_USE_COUNT: Final = 73  # use_count @292
_USE_COUNT_SINCE: Version = (5, 1, 0)  # the padding became use_count in 5.1.0
_OP_TABLES_SINCE: Version = (3, 6, 1)  # from here GGML_OP_COUNT is pinned to the RPC version

# Accepted nodes are remembered per session by their bytes and their sources' bytes; a decode
# graph has a few thousand nodes, 65536 entries (~40 MB at most) cover several graphs.
NODE_CACHE_MAX: Final = 1 << 16
# CPU time one graph may take to validate (thread time, so a loaded machine does not inflate
# it): a real 16-layer decode graph (581 nodes) takes ~10 ms cold, the largest real graphs a few
# hundred ms; a crafted maximal graph would otherwise stall the event loop for seconds.
MAX_GRAPH_CPU_S: Final = 0.5

# The validation budget's clock comes from the I/O layer (this package is sans-IO: no clock, no
# gc): proxy/validators.py installs the validating thread's CPU time less its time in the garbage
# collector (set_clock). Without one (tests, benches, the differential oracle) the budget never
# trips; a validator built with its own clock (GraphValidator(policy, clock=...)) reads that one.
Clock = Callable[[], float]  # CPU seconds of the calling thread that count against the budget


def _no_clock() -> float:
    return 0.0


_CLOCK: list[Clock] = [_no_clock]  # the installed clock (a one-slot box: mypyc compiles this module)


def set_clock(clock: Clock | None) -> None:
    """Install the clock every validator without its own reads (None: none, the budget never trips)."""
    _CLOCK[0] = clock if clock is not None else _no_clock


# The compute budget (cost.py). A graph's estimated compute time on the node: above any real graph
# (900 s at 40 GFLOP/s is a 512-token batch through ~35e9 parameters on one CPU node), far below
# what a crafted graph of huge matrix products can ask for (hours). Also the bound on what one
# session may have queued without waiting for an answer (GRAPH_RECOMPUTE re-runs the stored graph).
MAX_GRAPH_COMPUTE_S: Final = 900.0
# Throughput the estimate assumes: the real server's slowest matrix product (Q4_0) on one
# thread of this project's 2-core CI machine runs at 49-56 GFLOP/s, F32/F16/Q8_0 at 87-105
# (bench/studies/compute_cost.py, docs/firewall.md "Compute budget"): at 40 every real-sized case
# measured is over-estimated 1.4-16x. A GPU node, or one with many cores, sets its own (policy).
NODE_GFLOPS: Final = 40.0
# The CPU planner's work buffer for one node (workbuf.work_bytes): real graphs need a few hundred
# MiB at most (a 256-expert MoE batch of 4096 tokens: ~70 MiB of row map); the acceptance fuzz
# made a 2 GiB one from 8.6 MB of buffers (the sanitizer server's allocator refused it).
MAX_WORK_BYTES: Final = 1 << 30
# Threads the planner multiplies per-thread scratch by: ggml-rpc-server's default is half the
# hardware threads (tools/rpc/rpc-server.cpp:89), 64 covers a 128-thread host; a server started
# with more (-t) sets policy.server_threads.
SERVER_THREADS: Final = 64
_BUDGET_STRIDE: Final = 255  # check the clock every 256 tensors/nodes
_SELF_SRC: Final = 1  # the one src slot a real graph may point back at its own tensor (ggml_cast)


_I_NE0: Final = 5  # ne[0] @20: u32 word 5 of an rpc_tensor (id u64, type u32, buffer u64 come first)


def _empty(ne: memoryview[int] | array[int], p: int) -> bool:
    """Whether tensor ``p`` of the list has a zero in ne[0..3] (ggml-cpu never computes it)."""
    at = p * _I + _I_NE0
    return not (ne[at] and ne[at + 1] and ne[at + 2] and ne[at + 3])


def _u64(view: memoryview) -> memoryview[int] | array[int]:
    if _LITTLE:
        return view.cast("Q")
    a = array("Q", view.tobytes())
    a.byteswap()
    return a


def _u32(view: memoryview, code: Literal["I", "i"] = "I") -> memoryview[int] | array[int]:
    if _LITTLE:
        return view.cast(code)
    a = array(code, view.tobytes())
    a.byteswap()
    return a


def _refuse(reason: str, detail: str) -> FirewallRefusal:
    return FirewallRefusal(reason, detail)


@dataclass(frozen=True, slots=True)
class OpRules:
    """One version's op ids and the verified rows for them (oprules/)."""

    version: Version
    count: int  # GGML_OP_COUNT
    names: tuple[str, ...]
    denied: frozenset[int]  # custom ops (function pointers in op_params) + opt-in extras
    rows: Mapping[int, OpRule]  # op id -> verified rule; an op without one is not forwarded
    none: int  # id of GGML_OP_NONE (a PARAM node: never computed, layout rules only)
    # ops the CPU backend never computes (ggml-cpu.c ggml_graph_compute_thread skips NONE and the
    # view ops): their data is only touched through the compute nodes that read them
    no_compute: frozenset[int]
    # content-indexed ops with no check on the index (oprules.needs_containment)
    contained_only: frozenset[int] = frozenset()
    # the same on a CUDA node (needs_containment(op, "cuda"): CUDA checks no index, oprules/cuda.py)
    contained_only_cuda: frozenset[int] = frozenset()
    # ops whose kernels skip an empty source (OpRule.empty_sources)
    empty_sources_ok: frozenset[int] = frozenset()
    # ops that start a fused-kernel pattern on CUDA (oprules/cudafusion.py HEADS)
    fusion_heads_cuda: frozenset[int] = frozenset()

    def name(self, op: int) -> str:
        return self.names[op] if 0 <= op < len(self.names) else str(op)


_RULES: dict[tuple[Version, frozenset[str]], OpRules | None] = {}


def op_rules(version: Version, extra_denied: frozenset[str] = frozenset()) -> OpRules | None:
    """Op rules for ``version``, or None when its op ids are not known (no op is verified)."""
    key = (version, extra_denied)
    if key in _RULES:
        return _RULES[key]
    table = op_table(version, allow_inferred=True) if version >= _OP_TABLES_SINCE else None
    rules = None
    if table is not None:
        ids = table.ids
        rows = {ids[name]: r for name in ids if (r := rule_for(name, version)) is not None}
        rules = OpRules(
            version=version,
            count=table.count,
            names=tuple(table.names),
            denied=frozenset(table.denied) | frozenset(ids[n] for n in extra_denied if n in ids),
            rows=rows,
            none=ids["NONE"],
            no_compute=frozenset(ids[n] for n in ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")),
            contained_only=frozenset(ids[n] for n in ids if needs_containment(n)),
            contained_only_cuda=frozenset(ids[n] for n in ids if needs_containment(n, "cuda")),
            empty_sources_ok=frozenset(op for op, r in rows.items() if r.empty_sources),
            fusion_heads_cuda=frozenset(ids[n] for n in FUSION_HEADS if n in ids),
        )
    _RULES[key] = rules
    return rules


def coverage(version: Version) -> tuple[int, int, tuple[str, ...]]:
    """(ops with a verified rule, ops in the version's table, names of the ops without one)."""
    rules = op_rules(version)
    if rules is None:
        return 0, 0, ()
    missing = tuple(n for i, n in enumerate(rules.names) if i not in rules.rows and i != rules.none)
    return len(rules.rows), rules.count - 1, missing


class GraphPolicy(Protocol):
    """What the validator reads of ``settings.FirewallPolicy`` (which imports this module's
    defaults, hence a Protocol; mypy holds FirewallPolicy to it where checks.py passes it)."""
    @property
    def disabled_checks(self) -> AbstractSet[str]: ...
    @property
    def max_graph_nodes(self) -> int: ...
    @property
    def max_graph_tensors(self) -> int: ...
    @property
    def denied_ops(self) -> AbstractSet[str]: ...
    @property
    def allow_unverified_ops(self) -> AbstractSet[str]: ...
    @property
    def max_graph_cpu_s(self) -> float: ...
    @property
    def max_graph_compute_s(self) -> float: ...
    @property
    def node_gflops(self) -> float: ...
    @property
    def max_work_bytes(self) -> int: ...
    @property
    def server_threads(self) -> int: ...
    @property
    def contained(self) -> bool: ...
    @property
    def backend(self) -> str: ...
    @property
    def max_cuda_scratch_bytes(self) -> int: ...


class GraphValidator:
    """Validates GRAPH_COMPUTE payloads of one session; built once by the firewall from the
    session's ``FirewallPolicy`` (its caps and which of its checks are on)."""

    def __init__(self, policy: GraphPolicy, clock: Clock | None = None) -> None:
        off = policy.disabled_checks
        self.max_nodes = policy.max_graph_nodes
        self.max_tensors = policy.max_graph_tensors
        # A use count is a number of src slots of the (whole, pre-split) graph pointing at a
        # tensor: more than GGML_MAX_SRC per node of the largest graph we accept is not real.
        self.max_use_count = GGML_MAX_SRC * self.max_nodes
        self.tensor_checks = (0 if "tensor" in off else CHECK_TENSOR) | (0 if "buffer_bounds" in off else CHECK_BUFFER)
        self.structure = "graph_structure" not in off
        self.ops = "graph_ops" not in off
        self.op_params = "op_params" not in off
        self.device = "device_index" not in off
        self.extra_denied = frozenset(policy.denied_ops)
        # Ops the site forwards without a verified rule ("*": every op), counted per use.
        self.allow_unverified = frozenset(policy.allow_unverified_ops)
        self.max_cpu_s = policy.max_graph_cpu_s
        self.max_compute_s = policy.max_graph_compute_s
        self.node_flops = policy.node_gflops * 1e9
        self.max_work_bytes = policy.max_work_bytes
        self.server_threads = policy.server_threads
        # the upstream is a fresh sandboxed process per session (containment): content-indexed
        # ops with a shape rule but no check on their indexes (oprules.needs_containment) may reach it
        self.contained = policy.contained
        self.backend = policy.backend  # the op table's backend layer (protocol/backend.py)
        self.cuda_scratch_bytes = policy.max_cuda_scratch_bytes  # a CUDA node's pool scratch budget (protocol/cudascratch.py)
        self._layers: dict[int, str] = {}  # device -> the layer its cached node verdicts were reached under
        self._own_clock = clock  # None: the installed one (set_clock), read per graph
        self._clock: Clock = _no_clock
        self._deadline = 0.0

    # -- entry point -------------------------------------------------------------------------

    def check(self, payload: memoryview, state: SessionState) -> int:
        """Validate one GRAPH_COMPUTE payload; returns its device index. Raises FirewallRefusal."""
        clock = self._own_clock or _CLOCK[0]
        self._clock = clock
        self._deadline = clock() + self.max_cpu_s
        spec = state.spec
        assert spec is not None
        mv = memoryview(payload)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        size = len(mv)
        head = spec.graph_header  # [u32 device] u32 n_nodes
        if size < head:
            raise _refuse("graph_size_mismatch", f"len {size} < {head}-byte header")
        device = _U32.unpack_from(mv, 0)[0] if spec.multi_device else 0
        if self.device and device >= state.device_count():
            raise _refuse("device_out_of_range", f"device {device} >= count {state.device_count()}")
        n_nodes = _U32.unpack_from(mv, head - 4)[0]
        if n_nodes == 0:
            raise _refuse("graph_node_invalid", "n_nodes is 0 (the client asserts n_nodes > 0)")
        if n_nodes > self.max_nodes:
            raise _refuse("graph_too_large", f"n_nodes {n_nodes} > cap {self.max_nodes}")
        at_m = head + 8 * n_nodes
        if size < at_m + 4:
            raise _refuse("graph_size_mismatch", f"len {size} too short for {n_nodes} node ids")
        m = _U32.unpack_from(mv, at_m)[0]
        if m > self.max_tensors:
            raise _refuse("graph_too_large", f"n_tensors {m} > cap {self.max_tensors}")
        t0 = at_m + 4
        expected = t0 + TENSOR_BYTES * m
        if size < expected or (size != expected and self.structure):
            raise _refuse("graph_size_mismatch", f"len {size} != {expected} for {n_nodes} nodes, {m} tensors")
        if m == 0:
            # Only reachable with graph_structure off: there is nothing to check.
            return device
        nodes = _u64(mv[head:at_m]).tolist()
        region = mv[t0:expected]
        q = _u64(region)
        q4 = _u64(region[4 : len(region) - 4])
        ids = q[_Q_ID::_Q].tolist()
        srcs = [q4[_Q4_SRC + k :: _Q].tolist() for k in range(GGML_MAX_SRC)]
        srcs.append(q4[_Q4_VIEW_SRC::_Q].tolist())

        pos = self._structure(nodes, ids, srcs, m)
        raw = region.tobytes()
        step = TENSOR_BYTES
        chunks = [raw[o : o + step] for o in range(0, len(raw), step)]  # one bytes object per tensor
        npos = [p for p in map(pos.get, nodes) if p is not None]  # all of them unless structure off
        self._tensors(chunks, state)
        rules = op_rules(spec.version, self.extra_denied)
        if self.tensor_checks == STRICT:
            self._layout(region, chunks, npos, srcs, pos, state, device, rules)
        if spec.version >= _USE_COUNT_SINCE and self.structure:
            uc = _u32(region, "i")[_I_USE_COUNT::_I]
            lo, hi = min(uc), max(uc)
            if lo < 0 or hi > self.max_use_count:
                bad = lo if lo < 0 else hi
                i = list(uc).index(bad)
                raise _refuse(
                    "graph_use_count_invalid",
                    f"tensor {i} (id={ids[i]:#x}) use_count {bad} outside [0, {self.max_use_count}]",
                )
        # the op table's backend layer for this device (protocol/backend.py); node verdicts cached
        # under another layer (the server's answers changed the detection) are not reused
        layer = backend_layer(self.backend, state, device)
        if self._layers.setdefault(device, layer) != layer:
            state.node_cache.clear()
            self._layers[device] = layer
        if self.ops or self.op_params:
            cost = self._ops(rules, region, chunks, ids, npos, srcs, pos, state, layer)
            check_budget(layer, cost / self.node_flops, bool(self.max_compute_s))  # the profile's own budget
            self._charge(cost, device, state)
        return device

    def charge_recompute(self, cost: int, state: SessionState) -> None:
        """GRAPH_RECOMPUTE of a stored graph of estimated ``cost``: refused ``graph_too_costly``
        when, with what was forwarded since the server last answered, the queue would exceed the
        budget (a real client waits for GET_TENSOR after each one)."""
        queued = state.inflight_flops + cost
        if self.max_compute_s and queued / self.node_flops > self.max_compute_s:
            raise _refuse(
                "graph_too_costly",
                f"GRAPH_RECOMPUTE would queue an estimated {queued / self.node_flops:.0f} s of compute without an "
                f"answer in between (max_graph_compute_s {self.max_compute_s:g})",
            )
        state.compute_flops += cost
        state.inflight_flops = queued

    def _charge(self, cost: int, device: int, state: SessionState) -> None:
        """The compute budget: a graph whose estimated compute time on the node exceeds
        ``max_compute_s`` is refused before the server sees it; the estimate is remembered for
        GRAPH_RECOMPUTE (which runs the stored graph again) and summed per session."""
        seconds = (state.inflight_flops + cost) / self.node_flops
        if self.max_compute_s and seconds > self.max_compute_s:
            raise _refuse(
                "graph_too_costly",
                f"estimated compute {seconds:.0f} s ({cost:.3g} flop at {self.node_flops / 1e9:g} GFLOP/s) > "
                f"max_graph_compute_s {self.max_compute_s:g}",
            )
        state.graph_flops[device] = cost
        state.compute_flops += cost
        state.inflight_flops += cost

    def _budget(self) -> None:
        """The proxy's own cost per graph is bounded: a graph whose validation takes more CPU
        than ``max_cpu_s`` is refused (it would stall every other session of this process)."""
        if self._clock() > self._deadline:
            raise _refuse("graph_too_costly", f"validation took more than {self.max_cpu_s * 1e3:.0f} ms of CPU")

    # -- structure ---------------------------------------------------------------------------

    def _structure(self, nodes: list[int], ids: list[int], srcs: list[list[int]], m: int) -> dict[int, int]:
        pos = dict(zip(ids, range(m)))
        if not self.structure:
            return pos
        if len(pos) != m:
            seen: set[int] = set()
            dup = next(x for x in ids if x in seen or seen.add(x))  # type: ignore[func-returns-value]
            raise _refuse("graph_node_duplicate", f"tensor id {dup:#x} appears twice in the tensor list")
        if 0 in pos:
            raise _refuse("graph_node_invalid", f"tensor {pos[0]} of the list has id 0")
        node_set = set(nodes)
        if 0 in node_set:
            raise _refuse("graph_node_invalid", f"node {nodes.index(0)} has id 0 (NULL node)")
        if len(node_set) != len(nodes):
            seen = set()
            dup = next(x for x in nodes if x in seen or seen.add(x))  # type: ignore[func-returns-value]
            raise _refuse("graph_node_duplicate", f"node id {dup:#x} appears twice")
        missing = node_set.difference(pos)
        if missing:
            x = next(n for n in nodes if n in missing)
            raise _refuse("graph_node_missing", f"node {nodes.index(x)} id {x:#x} is not in the tensor list")
        # Every src/view_src must be an earlier tensor of the list (a missing one maps to m).
        # Most src slots are 0: compress() keeps the non-zero ones and their indices, in C.
        getp = pos.get
        idx = range(m)
        for k, column in enumerate(srcs):
            # src[1] may be the tensor itself: ggml_cast (ggml.c:3625) sets result->src[1] = result.
            # Which op may do that is the op table's business (oprules/layout.py _cpy); no other is allowed.
            later = gt if k == _SELF_SRC else ge
            if any(map(later, map(getp, compress(column, column), repeat(m)), compress(idx, column))):
                self._src_violation(k, column, pos, ids)
        npos = list(map(pos.__getitem__, nodes))
        if not all(map(lt, npos, islice(npos, 1, None))):
            i = next(i for i in range(1, len(npos)) if npos[i] <= npos[i - 1])
            raise _refuse(
                "graph_order_invalid",
                f"node {i} (id={nodes[i]:#x}) comes before node {i - 1} in the tensor list",
            )
        return pos

    @staticmethod
    def _src_violation(k: int, column: list[int], pos: dict[int, int], ids: list[int]) -> None:
        what = "view_src" if k == GGML_MAX_SRC else f"src[{k}]"
        for i, s in enumerate(column):
            if not s:
                continue
            p = pos.get(s)
            if p is None:
                raise _refuse("graph_src_missing", f"tensor {i} (id={ids[i]:#x}) {what}={s:#x} is not in the list")
            if p > i or (p == i and k != _SELF_SRC):
                raise _refuse(
                    "graph_order_invalid",
                    f"tensor {i} (id={ids[i]:#x}) {what}={s:#x} is at position {p}, not before it",
                )

    # -- per-tensor rules, through the cache ------------------------------------------------

    def _layout(
        self, region: memoryview, chunks: list[bytes], npos: list[int], srcs: list[list[int]], pos: dict[int, int],
        state: SessionState, device: int, rules: OpRules | None,
    ) -> None:
        """The layout rule (opcheck.check_layout) for every tensor a kernel reads or writes: the
        computed nodes and their direct sources. Other tensors of the list are never touched by
        a kernel: transitive sources the client serialises (7.0.0 sends those of other backends
        with buffer 0), view nodes (ggml-cpu skips VIEW/RESHAPE/PERMUTE/TRANSPOSE/NONE; the
        recurrent-state copy of LFM2 sends views of a client-side input) and empty nodes (ggml-cpu
        returns on ggml_is_empty). A verdict depends on the bytes, the live buffers (emptied on
        FREE_BUFFER) and the graph's device: one cache per device."""
        if rules is not None:
            skip = rules.no_compute
            ops = _u32(region)[_I_OP::_I]
            npos = [p for p in npos if ops[p] not in skip]
        ne = _u32(region)
        npos = [p for p in npos if not _empty(ne, p)]
        touched = set(npos)
        getp = pos.get
        for column in srcs[:GGML_MAX_SRC]:
            touched.update(q for q in map(getp, map(column.__getitem__, npos)) if q is not None)
        touched.discard(pos.get(0))
        cache = state.layout_cache.setdefault(device, set())
        read_by_others: set[int] | None = None
        for i, q in enumerate(touched):
            if not i & _BUDGET_STRIDE:
                self._budget()
            key = chunks[q]
            if key not in cache:  # (an empty tensor never is: the layout rule refuses it)
                if rules is not None and rules.empty_sources_ok and _empty(ne, q):
                    # an empty source of a node whose kernel never reads one (CONCAT: RWKV's token
                    # shift concatenates an empty view for one-token batches) is no tensor a kernel
                    # touches, unless another node reads it too; worked out only when one occurs
                    if read_by_others is None:
                        ops_ = _u32(region)[_I_OP::_I]
                        read_by_others = {r for p in npos if ops_[p] not in rules.empty_sources_ok
                                          for r in (getp(c[p]) for c in srcs[:GGML_MAX_SRC]) if r is not None}
                    if q not in read_by_others:
                        continue
                check_layout(decode_tensor(key), state, device)
                if len(cache) >= TENSOR_CACHE_MAX:
                    cache.clear()
                cache.add(key)

    def _tensors(self, chunks: list[bytes], state: SessionState) -> None:
        checks = self.tensor_checks
        if not checks:
            return
        cache = state.tensor_cache
        # One bytes key per tensor (its 296 raw bytes); the membership test runs in C.
        misses = list(filterfalse(cache.__contains__, chunks))
        if not misses:
            return
        cacheable = checks == STRICT
        for i, key in enumerate(misses):
            if not i & _BUDGET_STRIDE:
                self._budget()
            n = check_tensor(decode_tensor(key), state, checks)
            if cacheable:
                if len(cache) >= TENSOR_CACHE_MAX:
                    cache.clear()
                cache[key] = n

    # -- op rules ----------------------------------------------------------------------------

    def _ops(
        self,
        rules: OpRules | None,
        region: memoryview,
        chunks: list[bytes],
        ids: list[int],
        npos: list[int],
        srcs: list[list[int]],
        pos: dict[int, int],
        state: SessionState,
        layer: str = "cpu",
    ) -> int:
        """The op rules for every node; returns the graph's estimated floating-point operations."""
        if rules is None:
            # No verified op table for this version: no node can be re-derived, so none is
            # forwarded unless the site accepted every op ("*" in allow_unverified_ops).
            if "*" not in self.allow_unverified:
                raise _refuse("op_not_verified", f"protocol {state.spec.version if state.spec else '?'} has no "
                                                 "verified op table")
            return 0
        ops = _u32(region)[_I_OP::_I].tolist()
        if max(ops) >= rules.count:
            if not self.ops:
                return 0  # op ids unchecked: nothing below can name them
            i = next(i for i, op in enumerate(ops) if op >= rules.count)
            raise _refuse("graph_op_invalid", f"tensor {i} (id={ids[i]:#x}) op {ops[i]} >= OP_COUNT {rules.count}")
        denied = rules.denied
        if self.ops and not denied.isdisjoint(map(ops.__getitem__, npos)):
            p = next(p for p in npos if ops[p] in denied)
            raise _refuse("graph_op_denied", f"node id={ids[p]:#x} op {rules.name(ops[p])} is denied")
        rows = rules.rows
        cache = state.node_cache
        by_id: dict[int, RpcTensor] = {}

        def tensor(q: int) -> RpcTensor:
            t = decode_tensor(region, q * TENSOR_BYTES)
            by_id[t.id] = t
            return t

        step = TENSOR_BYTES
        getp = pos.get
        ne = _u32(region)
        empty = {p for p in npos if _empty(ne, p)}
        # a graph of one-task ops runs on one thread (workbuf.ONE_TASK_OPS, workuse.overflow)
        one_task = all(rules.name(ops[p]) in ONE_TASK_OPS for p in npos)
        contained_only = rules.contained_only_cuda if layer == "cuda" else rules.contained_only
        total = 0  # estimated floating-point operations of the graph (cost.py)
        for i, p in enumerate(npos):
            if not i & _BUDGET_STRIDE:
                self._budget()
            op = ops[p]
            if op == rules.none:
                continue  # a PARAM leaf listed as a node: never computed
            rule = rows.get(op)
            src_pos = [getp(c[p]) if c[p] else None for c in srcs]  # src[0..9], view_src
            if rule is not None and op in contained_only and not self.contained:
                name = rules.name(op)
                if name in self.allow_unverified or "*" in self.allow_unverified:
                    # the site forwards it uncontained: its shape rule still runs, the use counts
                    state.unverified_uses[name] = state.unverified_uses.get(name, 0) + 1
                elif self.ops:
                    raise _refuse("op_needs_containment",
                                  f"node id={ids[p]:#x} op {name} indexes "
                                  + ("device memory (unchecked on CUDA)" if layer == "cuda" else "state")
                                  + " with tensor contents, which no shape rule can bound: forwarded only to a "
                                  "contained server (upstream.isolation: session) "
                                  "or when named in policy.allow_unverified_ops")
            if rule is None:
                name = rules.name(op)
                if name in self.allow_unverified or "*" in self.allow_unverified:
                    state.unverified_uses[name] = state.unverified_uses.get(name, 0) + 1
                    node = decode_tensor(region, p * step)
                    total += flops(name, node, [tensor(q) if q is not None else None for q in src_pos[:GGML_MAX_SRC]])
                    continue
                if self.ops:
                    raise _refuse("op_not_verified", f"node id={ids[p]:#x} op {name} has no verified rule")
                continue
            if not self.op_params:
                continue
            # A node's verdict depends only on its bytes, those of its sources and view root, and
            # whether the graph runs on one thread (one_task: its work-buffer check is then per thread)
            key = b"".join([chunks[q] for q in (p, *src_pos) if q is not None]) + (b"1" if one_task else b"")
            cost = cache.get(key)
            if cost is not None:
                total += cost
                continue
            node = decode_tensor(region, p * step)
            node_srcs = [tensor(q) if q is not None else None for q in src_pos[:GGML_MAX_SRC]]
            if p in empty:
                # never computed (ggml-cpu returns on ggml_is_empty), but ggml_graph_plan still
                # reads its sources and sizes the work buffer from them
                check_sources(rule, node, node_srcs)
            else:
                if node.view_src and node.view_src not in by_id and src_pos[GGML_MAX_SRC] is not None:
                    tensor(src_pos[GGML_MAX_SRC])
                check_node(rule, node, node_srcs, by_id)
                if self.tensor_checks == STRICT:  # flat rows, rule.reach: inside the buffers
                    check_reach(rule, node, node_srcs, state)
                check_backend(layer, rule, node, node_srcs, state, self.tensor_checks == STRICT,
                              self.cuda_scratch_bytes)
            if layer == "cpu":  # the CPU planner's work buffer: no other backend runs ggml_graph_plan
                work = work_bytes(rule.op, node, node_srcs, self.server_threads)
                if work > self.max_work_bytes:
                    raise _refuse("graph_work_too_large",
                                  f"node id={node.id:#x} op {rule.op}: the CPU planner would allocate {work} bytes of "
                                  f"work buffer for {self.server_threads} threads (cap {self.max_work_bytes})")
                if p not in empty:
                    check_work_use(rule.op, node, node_srcs, self.server_threads, 1 if one_task else None)
            # the layer's cost profile (protocol/costprofile.py): cost.flops on the CPU
            cost = 0 if p in empty else node_cost(layer, rule.op, node, node_srcs, self.node_flops)
            total += cost
            if len(cache) >= NODE_CACHE_MAX:
                cache.clear()
            cache[key] = cost
        if layer == "cuda" and self.op_params and npos:
            # the pair rules of CUDA's fused kernels (oprules/cudafusion.py): one set lookup per node,
            # a rule only at a node whose op starts a pattern, its verdict cached under the bytes of the
            # window of nodes it looks at (backend.check_fusions), not under the node's own
            heads = rules.fusion_heads_cuda
            starts = [i for i, p in enumerate(npos) if ops[p] in heads]
            check_fusions(_NodeList(region, chunks, ids, npos, srcs, pos, ops, rules, cache), starts, state,
                          self.tensor_checks == STRICT)
        return total


class _NodeList:
    """The graph's node list for the CUDA pair rules (cudafusion.FusionGraph): node i is the i-th
    entry of the payload's node ids, decoded only when a rule looks at it."""

    def __init__(self, region: memoryview, chunks: list[bytes], ids: list[int], npos: list[int],
                 srcs: list[list[int]], pos: dict[int, int], ops: list[int], rules: OpRules,
                 cache: dict[bytes, int]) -> None:
        self.n = len(npos)
        self._region, self._chunks, self._ids, self._npos, self._srcs, self._pos = region, chunks, ids, npos, srcs, pos
        self._ops, self._rules, self._cache = ops, rules, cache
        self._seen: dict[int, RpcTensor] = {}

    def key(self, i: int, span: int) -> bytes:
        """The bytes of nodes i..i+span-1 (fewer at the end of the list) and of their src[0..2],
        behind b"F:": 296*k + 2 bytes, never the length of a node verdict's key (296*k (+ 1))."""
        window = self._npos[i:i + span]
        getp, s0, s1, s2 = self._pos.get, self._srcs[0], self._srcs[1], self._srcs[2]
        qs = [q for p in window for q in (p, getp(s0[p]), getp(s1[p]), getp(s2[p])) if q is not None]
        return b"F:" + b"".join([self._chunks[q] for q in qs])

    def cached(self, key: bytes) -> bool:
        return key in self._cache

    def remember(self, key: bytes) -> None:
        if len(self._cache) >= NODE_CACHE_MAX:
            self._cache.clear()
        self._cache[key] = 0

    def op(self, i: int) -> str:
        return self._rules.name(self._ops[self._npos[i]])

    def nid(self, i: int) -> int:
        return self._ids[self._npos[i]]

    def sid(self, i: int, k: int) -> int:
        return self._srcs[k][self._npos[i]]

    def _at(self, q: int) -> RpcTensor:
        t = self._seen.get(q)
        if t is None:
            t = self._seen[q] = decode_tensor(self._region, q * TENSOR_BYTES)
        return t

    def node(self, i: int) -> RpcTensor:
        return self._at(self._npos[i])

    def tensor(self, tid: int) -> RpcTensor | None:
        q = self._pos.get(tid)
        return None if q is None else self._at(q)
