"""GRAPH_COMPUTE validation (spec §3.2 and the "GRAPH_COMPUTE invariants" of §6.2).

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
from operator import ge, lt
from typing import Callable, Mapping

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.tensor import (
    STRICT,
    TENSOR_CACHE_MAX,
    RpcTensor,
    check_tensor,
    decode_tensor,
    nbytes,
)
from rpcguard.protocol.versions import TENSOR_BYTES, Version

__all__ = ["GraphValidator", "OpRules", "op_rules", "GGML_MAX_SRC"]

GGML_MAX_SRC = 10
_U32 = struct.Struct("<I")
_LITTLE = sys.byteorder == "little"
# u64 words per rpc_tensor; fields at byte offsets ≡ 4 (mod 8) are read from a view shifted by 4.
_Q = TENSOR_BYTES // 8  # 37
_I = TENSOR_BYTES // 4  # 74
_Q_ID = 0  # id @0
_Q4_SRC = 15  # src[0] @124 = 4 + 8*15
_Q4_VIEW_SRC = 25  # view_src @204 = 4 + 8*25
_I_OP = 13  # op @52
_I_USE_COUNT = 73  # use_count @292
_USE_COUNT_SINCE: Version = (5, 1, 0)  # the padding became use_count in 5.1.0
_OP_TABLES_SINCE: Version = (3, 6, 1)  # from here GGML_OP_COUNT is pinned to the RPC version

F32, F16, I32, I64 = 0, 1, 26, 27  # enum ggml_type, stable across every version


def _u64(view: memoryview) -> memoryview | array:
    if _LITTLE:
        return view.cast("Q")
    a = array("Q", view.tobytes())
    a.byteswap()
    return a


def _u32(view: memoryview, code: str = "I") -> memoryview | array:
    if _LITTLE:
        return view.cast(code)
    a = array(code, view.tobytes())
    a.byteswap()
    return a


def _refuse(reason: str, detail: str) -> FirewallRefusal:
    return FirewallRefusal(reason, detail)


@dataclass(frozen=True, slots=True)
class OpRules:
    """The op ids one version's rules need."""

    count: int  # GGML_OP_COUNT
    names: tuple[str, ...]
    denied: frozenset[int]  # custom ops (function pointers in op_params) + opt-in extras
    src0_optional: frozenset[int]  # ops whose constructor sets no src[0]: NONE, ARANGE, CUSTOM
    special: Mapping[int, str]  # op id -> name of its per-node check in _SPECIAL
    required_srcs: Mapping[int, int]  # op id -> leading srcs that must be present

    def name(self, op: int) -> str:
        return self.names[op] if 0 <= op < len(self.names) else str(op)


_RULES: dict[tuple[Version, frozenset[str]], OpRules | None] = {}


# Sources an op's constructor always sets from non-NULL arguments and its CPU kernel reads
# unconditionally (ggml.c / ggml-cpu/ops.cpp, 2.0.0-7.0.0; the smallest count over those versions,
# e.g. SET_ROWS set two sources before 3.6.1). Optional inputs (masks, freq factors) are left out.
REQUIRED_SRCS: Mapping[str, int] = {
    **dict.fromkeys(("ADD", "SUB", "MUL", "DIV", "ADD1", "ACC", "SET", "CPY", "CONCAT", "MUL_MAT", "OUT_PROD",
                     "GET_ROWS", "GET_ROWS_BACK", "SET_ROWS", "SILU_BACK", "RMS_NORM_BACK", "COUNT_EQUAL",
                     "CROSS_ENTROPY_LOSS", "SOFT_MAX_BACK", "ROPE"), 2),
    **dict.fromkeys(("MUL_MAT_ID", "ADD_ID", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_SGD", "FLASH_ATTN_EXT",
                     "ADD_REL_POS"), 3),
    "OPT_STEP_ADAMW": 5,
    "GATED_LINEAR_ATTN": 5,
}


def op_rules(version: Version, extra_denied: frozenset[str] = frozenset()) -> OpRules | None:
    """Op rules for ``version``, or None when its op ids are not known (no op rule applies)."""
    key = (version, extra_denied)
    if key in _RULES:
        return _RULES[key]
    table = op_table(version, allow_inferred=True) if version >= _OP_TABLES_SINCE else None
    rules = None
    if table is not None:
        ids = table.ids
        get = lambda n: ids.get(n, -1)  # noqa: E731
        special = {ids[n]: n for n in _SPECIAL if n in ids}
        rules = OpRules(
            count=table.count,
            names=tuple(table.names),
            denied=frozenset(table.denied) | frozenset(ids[n] for n in extra_denied if n in ids),
            # ggml.c: every op constructor sets src[0] except ggml_arange and ggml_custom_4d
            # (0 args possible); NONE is a leaf/param. Checked in 2.0.0-7.0.0 sources.
            src0_optional=frozenset({0} | ({get("ARANGE"), get("CUSTOM")} - {-1})),
            special=special,
            required_srcs={ids[n]: k for n, k in REQUIRED_SRCS.items() if n in ids},
        )
    _RULES[key] = rules
    return rules


def _rows_ok(t: RpcTensor) -> bool:
    """Rows are contiguous as the CPU row kernels assume (ggml_is_contiguous_rows), and a
    single-block row of a quantized type is not squeezed below one block by its stride."""
    info = TYPES[t.type]
    if t.nb0 == info.type_size:
        return True
    return t.ne0 == info.blck_size and (info.blck_size == 1 or t.nb0 >= info.type_size)


class GraphValidator:
    """Validates GRAPH_COMPUTE payloads of one session; built once by the firewall."""

    def __init__(
        self,
        *,
        max_nodes: int,
        max_tensors: int,
        tensor_checks: int = STRICT,
        structure: bool = True,
        ops: bool = True,
        op_params: bool = True,
        device: bool = True,
        extra_denied: frozenset[str] = frozenset(),
    ) -> None:
        self.max_nodes = max_nodes
        self.max_tensors = max_tensors
        # A use count is a number of src slots of the (whole, pre-split) graph pointing at a
        # tensor: more than GGML_MAX_SRC per node of the largest graph we accept is not real.
        self.max_use_count = GGML_MAX_SRC * max_nodes
        self.tensor_checks = tensor_checks
        self.structure = structure
        self.ops = ops
        self.op_params = op_params
        self.device = device
        self.extra_denied = extra_denied

    # -- entry point -------------------------------------------------------------------------

    def check(self, payload: memoryview, state: SessionState) -> int:
        """Validate one GRAPH_COMPUTE payload; returns its device index. Raises FirewallRefusal."""
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
        npos = [p for p in map(pos.get, nodes) if p is not None]  # all of them unless structure off
        self._tensors(region, state)
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
        if self.ops or self.op_params:
            rules = op_rules(spec.version, self.extra_denied)
            if rules is not None:
                ops = _u32(region)[_I_OP::_I].tolist()
                self._ops(rules, ops, ids, npos, srcs, region, pos)
        return device

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
            if any(map(ge, map(getp, compress(column, column), repeat(m)), compress(idx, column))):
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
            if p >= i:
                raise _refuse(
                    "graph_order_invalid",
                    f"tensor {i} (id={ids[i]:#x}) {what}={s:#x} is at position {p}, not before it",
                )

    # -- per-tensor rules, through the cache ------------------------------------------------

    def _tensors(self, region: memoryview, state: SessionState) -> None:
        checks = self.tensor_checks
        if not checks:
            return
        raw = region.tobytes()
        step = TENSOR_BYTES
        cache = state.tensor_cache
        # One bytes key per tensor (its 296 raw bytes); the membership test runs in C.
        misses = list(filterfalse(cache.__contains__, [raw[o : o + step] for o in range(0, len(raw), step)]))
        if not misses:
            return
        cacheable = checks == STRICT
        for key in misses:
            n = check_tensor(decode_tensor(key), state, checks)
            if cacheable:
                if len(cache) >= TENSOR_CACHE_MAX:
                    cache.clear()
                cache[key] = n

    # -- op rules ----------------------------------------------------------------------------

    def _ops(
        self,
        rules: OpRules,
        ops: list[int],
        ids: list[int],
        npos: list[int],
        srcs: list[list[int]],
        region: memoryview,
        pos: dict[int, int],
    ) -> None:
        src0 = srcs[0]
        if self.ops:
            if max(ops) >= rules.count:
                i = next(i for i, op in enumerate(ops) if op >= rules.count)
                raise _refuse("graph_op_invalid", f"tensor {i} (id={ids[i]:#x}) op {ops[i]} >= OP_COUNT {rules.count}")
        node_ops = list(map(ops.__getitem__, npos))
        if self.ops:
            if not rules.denied.isdisjoint(node_ops):
                p = next(p for p in npos if ops[p] in rules.denied)
                raise _refuse("graph_op_denied", f"node id={ids[p]:#x} op {rules.name(ops[p])} is denied")
            # CPU kernels read src[0] unconditionally (e.g. src[0]->type): a node without one is a
            # NULL dereference on the server.
            if 0 in map(src0.__getitem__, npos):
                for p in npos:
                    if src0[p] == 0 and ops[p] not in rules.src0_optional:
                        raise _refuse(
                            "graph_src_missing", f"node id={ids[p]:#x} op {rules.name(ops[p])} has no src[0]"
                        )
            # Ops whose CPU kernels read several sources unconditionally (e.g. OPT_STEP_ADAMW's five):
            # a missing one is a NULL dereference on the server.
            need = rules.required_srcs
            if not need.keys().isdisjoint(node_ops):
                for p, op in zip(npos, node_ops):
                    k = need.get(op)
                    if k is not None:
                        for i in range(1, k):
                            if srcs[i][p] == 0:
                                raise _refuse("graph_src_missing",
                                              f"node id={ids[p]:#x} op {rules.name(op)} has no src[{i}]")
        special = rules.special
        if self.op_params and not special.keys().isdisjoint(node_ops):
            for p, op in zip(npos, node_ops):
                if op in special:
                    self._special(rules, special[op], p, region, pos)

    def _special(self, rules: OpRules, name: str, p: int, region: memoryview, pos: dict[int, int]) -> None:
        dst = decode_tensor(region, p * TENSOR_BYTES)

        def src(i: int, required: bool = True) -> RpcTensor | None:
            sid = dst[29 + i]
            q = pos.get(sid) if sid else None
            if q is None:
                if required or sid:
                    raise _refuse("graph_src_missing", f"node id={dst.id:#x} op {name} needs src[{i}]")
                return None
            return decode_tensor(region, q * TENSOR_BYTES)

        _typed(dst, dst, name)
        _SPECIAL[name](dst, name, src)


def _typed(t: RpcTensor, dst: RpcTensor, name: str) -> RpcTensor:
    if t.type not in TYPES:
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: src id={t.id:#x} invalid type {t.type}")
    return t


Src = Callable[..., "RpcTensor | None"]


def _acc_set(dst: RpcTensor, name: str, src: Src) -> None:
    """ACC / SET: op_params = {nb1, nb2, nb3, offset, inplace} (ggml_acc_impl / ggml_set_impl).
    The CPU kernel writes src1's shape at dst.data + offset with those strides and checks only the
    far corner in size_t arithmetic, so negative values that cancel out pass it (#25764)."""
    s1, s2, s3, offset = dst.param0, dst.param1, dst.param2, dst.param3
    if min(s1, s2, s3, offset) < 0:
        raise _refuse(
            "graph_op_params_invalid", f"node id={dst.id:#x} op {name}: negative stride/offset {(s1, s2, s3, offset)}"
        )
    a = _typed(src(0), dst, name)  # type: ignore[arg-type]
    b = _typed(src(1), dst, name)  # type: ignore[arg-type]
    if a.type != dst.type or a.ne != dst.ne:
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst differs from src[0] in type or shape")
    if not (b.ne0 and b.ne1 and b.ne2 and b.ne3):
        return  # nothing is written
    esz = TYPES[a.type].type_size  # "nb0 is implicitly element_size" (ops.cpp)
    end = offset + (b.ne0 - 1) * esz + (b.ne1 - 1) * s1 + (b.ne2 - 1) * s2 + (b.ne3 - 1) * s3 + esz
    limit = nbytes(dst, TYPES[dst.type])
    if name == "ACC":
        limit = min(limit, nbytes(a, TYPES[a.type]))  # ACC also reads src[0] at the same offsets
    if end > limit:
        raise _refuse(
            "graph_op_params_invalid",
            f"node id={dst.id:#x} op {name}: region ends at byte {end}, past the {limit}-byte tensor",
        )


def _pad_reflect_1d(dst: RpcTensor, name: str, src: Src) -> None:
    """PAD_REFLECT_1D: op_params = {p0, p1}; ggml_pad_reflect_1d asserts 0 <= p0, p1 < a.ne0 and
    builds dst as (a.ne0 + p0 + p1, a.ne1, a.ne2, a.ne3) F32; the kernel writes around each row."""
    p0, p1 = dst.param0, dst.param1
    a = _typed(src(0), dst, name)  # type: ignore[arg-type]
    if p0 < 0 or p1 < 0 or p0 >= a.ne0 or p1 >= a.ne0:
        raise _refuse(
            "graph_op_params_invalid", f"node id={dst.id:#x} op {name}: pads ({p0}, {p1}) for ne0={a.ne0}"
        )
    if (dst.ne0, dst.ne1, dst.ne2, dst.ne3) != (a.ne0 + p0 + p1, a.ne1, a.ne2, a.ne3):
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst shape {dst.ne} != src shape + pads")
    if dst.type != F32 or a.type != F32 or not _rows_ok(dst) or not _rows_ok(a):
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: needs contiguous F32 rows")


def _get_rows(dst: RpcTensor, name: str, src: Src) -> None:
    """GET_ROWS: ggml_get_rows(a, b) asserts a.ne2 == b.ne1, a.ne3 == b.ne2, b.ne3 == 1, b I32,
    and builds dst = (a.ne0, b.ne0, b.ne1, b.ne2), F32 (I32 when a is I32). Row indices are data
    (checked by the kernel with GGML_ASSERT), shapes are not checked by the server (#26825)."""
    a = _typed(src(0), dst, name)  # type: ignore[arg-type]
    b = _typed(src(1), dst, name)  # type: ignore[arg-type]
    if b.type != I32 or a.ne2 != b.ne1 or a.ne3 != b.ne2 or b.ne3 != 1:
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: src shapes {a.ne} / {b.ne} do not match")
    if (dst.ne0, dst.ne1, dst.ne2, dst.ne3) != (a.ne0, b.ne0, b.ne1, b.ne2):
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst shape {dst.ne} wrong")
    if dst.type != (I32 if a.type == I32 else F32) or not _rows_ok(dst) or not _rows_ok(a):
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst type/stride wrong")


def _set_rows(dst: RpcTensor, name: str, src: Src) -> None:
    """SET_ROWS: dst = view of a, srcs {b, c, a} (ggml_set_rows): a.ne0 == b.ne0, a.ne2 == b.ne2,
    a.ne3 == b.ne3, b.ne1 == c.ne0, b.ne2 % c.ne1 == 0, b.ne3 % c.ne2 == 0, c.ne3 == 1, b F32/F16,
    c I64/I32, rows of a and b contiguous (#26912). The kernel writes through dst's own shape."""
    b = _typed(src(0), dst, name)  # type: ignore[arg-type]
    c = _typed(src(1), dst, name)  # type: ignore[arg-type]
    a = src(2, required=False)
    bad = (
        b.type not in (F32, F16)
        or c.type not in (I64, I32)
        or c.ne3 != 1
        or b.ne1 != c.ne0
        or c.ne1 == 0
        or c.ne2 == 0
        or b.ne2 % c.ne1
        or b.ne3 % c.ne2
        or not _rows_ok(b)
    )
    if bad:
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: src shapes {b.ne} / {c.ne} do not match")
    if dst.ne0 != b.ne0 or dst.ne2 != b.ne2 or dst.ne3 != b.ne3 or not _rows_ok(dst):
        raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst shape {dst.ne} wrong")
    if a is not None:
        _typed(a, dst, name)
        if a.ne != dst.ne or a.type != dst.type:
            raise _refuse("graph_shape_invalid", f"node id={dst.id:#x} op {name}: dst is not a view of src[2]")


# Per-node op checks, by ggml op name (the ids come from the version's op table).
_SPECIAL: Mapping[str, Callable[[RpcTensor, str, Src], None]] = {
    "ACC": _acc_set,
    "SET": _acc_set,
    "GET_ROWS": _get_rows,
    "SET_ROWS": _set_rows,
    "PAD_REFLECT_1D": _pad_reflect_1d,
}
