"""The firewall's checks of request heads, one method per kind of head (spec §6.2).

How this works: ``RequestChecks`` holds what a check needs (the session's state, the policy's
switches, the graph validator) and one method per kind of request head, each with the signature
``(rule, payload, body_len)``; the command table (``commands.ROWS``) names the method of each
command in its check column, and the ``Firewall`` (protocol/firewall.py) runs it for every
frame. The table sits between the two: it refers to these methods, the firewall dispatches by
it. Every method raises ``FirewallRefusal(reason, detail)`` with a stable reason from
docs/design.md and never anything else, and only reads ``SessionState``: the session records
buffers, bases, frees and stored graphs.

Check groups (``FirewallPolicy.disabled_checks``): ``tensor`` (per-tensor type/shape/nbytes/
flags/name, SET_TENSOR cache_flag), ``buffer_bounds`` (handles, data ranges, SET/GET/MEMSET/
COPY ranges, ALLOC_BUFFER size and the session's allocation quota, INIT_TENSOR padded size),
``graph_structure``, ``graph_ops``, ``op_params`` (op_params and shape rules of ACC/SET/
PAD_REFLECT_1D/GET_ROWS/SET_ROWS), ``recompute_after_free`` (both GRAPH_RECOMPUTE rules),
``device_index``; ``graph_ops`` also covers GET_DEVICE_SUPPORTS_OP's op id and sources.
"""

from __future__ import annotations

import struct
from typing import Final

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.backend import check_alloc_command
from rpcguard.protocol.graph import GraphValidator, OpRules, op_rules
from rpcguard.protocol.memshare import check_alloc as check_share
from rpcguard.protocol.settings import CHECK_NAMES, FirewallPolicy
from rpcguard.protocol.state import Buffer, SessionState, hash_miss_key
from rpcguard.protocol.tensor import (
    CHECK_BUFFER,
    CHECK_TENSOR,
    FOREIGN_BUFFER_OK,
    RpcTensor,
    alloc_size_key,
    check_tensor,
    decode_tensor,
)
from rpcguard.protocol.versions import TENSOR_BYTES, CommandRule

__all__ = ["RequestChecks", "HASH_THRESHOLD_BYTES"]

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_U64x2: Final = struct.Struct("<QQ")
_DEV_U64: Final = struct.Struct("<IQ")
_SET_TENSOR_CACHE_HEAD: Final = TENSOR_BYTES + 9  # 7.0.0 SET_TENSOR head: rpc_tensor, cache_flag, offset
# The client asks the server to store a tensor in its -c cache (cache_flag=1) only after a
# SET_TENSOR_HASH miss for that tensor, and only above this size (ggml-rpc.cpp:87 HASH_THRESHOLD,
# :717 rpc_use_hash_cache `size > HASH_THRESHOLD`, :723-739 set_tensor).
HASH_THRESHOLD_BYTES: Final = 10 * 1024 * 1024


class RequestChecks:
    """The checks of one session's request heads; each raises ``FirewallRefusal``."""

    def __init__(self, state: SessionState, policy: FirewallPolicy) -> None:
        self.state = state
        self.policy = policy
        on = {name: name not in policy.disabled_checks for name in CHECK_NAMES}
        self._tensor = on["tensor"]
        self._bounds = on["buffer_bounds"]
        self._device = on["device_index"]
        self._recompute = on["recompute_after_free"]
        self._ops = on["graph_ops"]
        self._denied = frozenset(policy.denied_ops)
        self._tchecks = (CHECK_TENSOR if self._tensor else 0) | (CHECK_BUFFER if self._bounds else 0)
        self._graph = GraphValidator(policy)

    def quota(self, device: int) -> tuple[int, int] | None:
        """(bytes charged, cap) of the allocation quota that applies to ``device``, or None when
        there is no cap yet (no ``max_session_alloc_bytes`` and the device total not learned)."""
        state = self.state
        cap = self.policy.max_session_alloc_bytes
        if cap:
            return state.alloc_total, cap
        memory = state.upstream.memory.get(device)
        if memory is None:
            return None
        return state.alloc_by_device.get(device, 0), memory[1]

    def check_quota(self, device: int, size: int = 0) -> None:
        """Refuse when ``size`` more bytes would put the session past its allocation quota."""
        if not self._bounds:
            return
        q = self.quota(device)
        if q is not None and q[0] + size > q[1]:
            raise FirewallRefusal(
                "alloc_quota_exceeded",
                f"device {device}: {q[0]} bytes allocated in this session + {size} > quota {q[1]}",
            )

    # -- helpers -----------------------------------------------------------------------------

    def _check_device(self, device: int) -> None:
        if self._device:
            count = self.state.device_count()
            if device >= count:
                raise FirewallRefusal("device_out_of_range", f"device {device} >= device count {count}")

    def _buffer_tensor(
        self, payload: memoryview, offset: int = 0, what: str = "tensor"
    ) -> tuple[RpcTensor, int, Buffer | None]:
        """Decode and check a tensor that must live in a known buffer; the Buffer is None only
        when ``buffer_bounds`` is off (then no range check follows)."""
        t = decode_tensor(payload, offset)
        n = check_tensor(t, self.state, self._tchecks)
        if not self._bounds:
            return t, n, None
        buf = self.state.buffers.get(t.buffer) if t.buffer else None
        if buf is None or buf.base is None:  # check_tensor refused these already; never a KeyError
            if t.buffer == 0:
                raise FirewallRefusal("tensor_null", f"{what} id={t.id:#x} has no buffer")
            raise FirewallRefusal("buffer_unknown", f"{what} id={t.id:#x}: buffer {t.buffer:#x} is not live")
        return t, n, buf

    def _range(self, t: RpcTensor, n: int, buf: Buffer | None, offset: int, size: int) -> None:
        """``[data+offset, +size)`` inside the buffer (the server's own bounds, checked first) and
        ``offset+size <= nbytes`` (ggml_backend_tensor_set/get GGML_ASSERT it: a server abort)."""
        if buf is None:
            return
        if t.data + offset + size > buf.base + buf.size:  # type: ignore[operator]
            raise FirewallRefusal(
                "range_out_of_buffer",
                f"tensor id={t.id:#x}: [{t.data:#x}+{offset}, +{size}) past the end of buffer {buf.handle:#x}",
            )
        if offset + size > n:
            raise FirewallRefusal(
                "range_out_of_tensor", f"tensor id={t.id:#x}: offset {offset} + size {size} > nbytes {n}"
            )

    # -- the checks (the check column of commands.ROWS) ----------------------------------------

    def device_only(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        if rule.has_device:
            self._check_device(_U32.unpack_from(payload)[0])

    def alloc_buffer(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        # size 0 is legal: the server returns a dummy buffer with base NULL (the real client never
        # sends it, ggml_backend_buft_alloc_buffer short-circuits), so it is not refused.
        device, size = _DEV_U64.unpack_from(payload) if rule.has_device else (0, _U64.unpack_from(payload)[0])
        self._check_device(device)
        if not self._bounds:
            return
        cap = self.policy.max_alloc_bytes
        if cap and size > cap:
            raise FirewallRefusal("alloc_size_invalid", f"size {size} > cap {cap}")
        max_size = self.state.upstream.max_size.get(device)
        if max_size is not None and size > max_size:
            raise FirewallRefusal("alloc_size_invalid", f"size {size} > GET_MAX_SIZE {max_size} of device {device}")
        self.check_quota(device, size)
        check_share(self.policy, self.state, device, size)  # protocol/memshare.py

    def handle(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        if self._bounds:
            handle = _U64.unpack_from(payload)[0]
            if handle not in self.state.buffers:
                raise FirewallRefusal(
                    "buffer_unknown", f"{rule.name}: {handle:#x} is not a live buffer of this session"
                )

    def set_tensor(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        t, n, buf = self._buffer_tensor(payload)
        at = TENSOR_BYTES
        if rule.request == _SET_TENSOR_CACHE_HEAD:  # >= 7.0.0: u8 cache_flag before the offset
            flag = payload[at]
            if self._tensor and flag:
                self._cache_flag(payload, flag, body_len)
            at += 1
        self._range(t, n, buf, _U64.unpack_from(payload, at)[0], body_len)

    def _cache_flag(self, payload: memoryview, flag: int, body_len: int) -> None:
        """cache_flag=1 makes a server run with -c write the data to a new file in its cache
        directory: accepted only the way the client sends it, once per SET_TENSOR_HASH miss of the
        same tensor and offset, for more than HASH_THRESHOLD_BYTES of data."""
        if flag > 1:
            raise FirewallRefusal("set_tensor_flag_invalid", f"cache_flag {flag} not 0 or 1")
        if body_len <= HASH_THRESHOLD_BYTES:
            raise FirewallRefusal(
                "set_tensor_cache_flag_invalid",
                f"cache_flag=1 with {body_len} bytes: the client sets it only above {HASH_THRESHOLD_BYTES}",
            )
        if hash_miss_key(payload) not in self.state.hash_misses:
            raise FirewallRefusal(
                "set_tensor_cache_flag_invalid",
                "cache_flag=1 without a SET_TENSOR_HASH miss for this tensor and offset",
            )

    def set_tensor_hash(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        # The data size is the size of the server's cache file, unknown here: only the offset is
        # checked. (A cache file larger than the tensor makes the server abort; see the report.)
        t, n, buf = self._buffer_tensor(payload)
        self._range(t, n, buf, _U64.unpack_from(payload, TENSOR_BYTES)[0], 0)

    def get_tensor(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        t, n, buf = self._buffer_tensor(payload)
        offset, size = _U64x2.unpack_from(payload, TENSOR_BYTES)
        self._range(t, n, buf, offset, size)

    def copy_tensor(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        src, n_src, _ = self._buffer_tensor(payload, 0, "src")
        dst, _, dbuf = self._buffer_tensor(payload, TENSOR_BYTES, "dst")
        if dbuf is not None and dst.data + n_src > dbuf.base + dbuf.size:  # type: ignore[operator]
            raise FirewallRefusal(
                "copy_out_of_buffer",
                f"dst data {dst.data:#x} + nbytes(src) {n_src} past the end of buffer {dbuf.handle:#x}",
            )

    def init_tensor(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        # A padding backend's init_tensor zeroes [data+nbytes, data+alloc_size) (CUDA, quantized
        # rows: ggml-cuda.cu:758-766), past the server's own [data, +nbytes) check. The padded size
        # is the server's GET_ALLOC_SIZE answer for that shape, when the proxy has seen one.
        t, n, buf = self._buffer_tensor(payload)
        if buf is None:
            return
        padded = self.state.upstream.alloc_sizes.get(alloc_size_key(buf.device, t))
        if padded is not None and t.data + padded > buf.base + buf.size:  # type: ignore[operator]
            raise FirewallRefusal(
                "tensor_out_of_buffer",
                f"tensor id={t.id:#x}: padded size {padded} (GET_ALLOC_SIZE) from {t.data:#x} past the end "
                f"of buffer {buf.handle:#x}",
            )
        # on CUDA the padding is computed, asked for or not (protocol/backend.py)
        check_alloc_command(self.policy.backend, "INIT_TENSOR", t, [], self.state, buf.device)

    def get_alloc_size(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        at = 0
        device = 0
        if rule.has_device:
            device = _U32.unpack_from(payload)[0]
            self._check_device(device)
            at = 4
        checks = self._tchecks | FOREIGN_BUFFER_OK
        state = self.state
        t = decode_tensor(payload, at)
        check_tensor(t, state, checks)
        srcs: list[RpcTensor | None] = []
        for off in range(at + TENSOR_BYTES, len(payload), TENSOR_BYTES):
            src = decode_tensor(payload, off)
            if src.id != 0:  # id 0 means "no src": the server skips it
                check_tensor(src, state, checks)
            srcs.append(src if src.id != 0 else None)
        if self._tensor:  # CUDA's get_alloc_size asserts (protocol/backend.py)
            check_alloc_command(self.policy.backend, "GET_ALLOC_SIZE", t, srcs, state, device)

    def _op_rules(self) -> OpRules | None:
        spec = self.state.spec
        return op_rules(spec.version, self._denied) if spec is not None else None

    def forwards_op(self, op: int) -> bool:
        """Whether a graph node of ``op`` could pass the op checks at all (the op level of
        GraphValidator._ops: a table, in range, not denied, a verified rule that this server may
        run, or named in allow_unverified_ops); GET_DEVICE_SUPPORTS_OP of any other op is
        answered "not supported" by the proxy (commands.supports_op_local)."""
        if not self._ops:
            return True
        rules = self._op_rules()
        allowed = self.policy.allow_unverified_ops
        if rules is None or op >= rules.count:
            return "*" in allowed
        if op in rules.denied:
            return False
        if "*" in allowed or rules.names[op] in allowed:
            return True
        return op in rules.rows and (op not in rules.contained_only or self.policy.contained)

    def device_supports_op(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        """GET_DEVICE_SUPPORTS_OP (7.0.1): ``u32 device, rpc_tensor op, rpc_tensor srcs[10]``. The
        server deserializes the op and every src whose id is not 0, then calls its backend's
        supports_op, which reads the sources the op has (ggml-cpu.cpp ggml_backend_cpu_device_
        supports_op: src0/src1 types, SSM_SCAN's src[3]): a query without them is a NULL
        dereference. Checked like GET_ALLOC_SIZE's tensors, plus the op: in range for the version
        and with the sources its constructor always sets (its oprules row), present and, for a
        non-empty op, non-empty unless the op's kernels take empty ones."""
        self._check_device(_U32.unpack_from(payload)[0])
        checks = self._tchecks | FOREIGN_BUFFER_OK
        state = self.state
        op = decode_tensor(payload, 4)
        check_tensor(op, state, checks)
        srcs: list[RpcTensor | None] = []
        for off in range(4 + TENSOR_BYTES, len(payload), TENSOR_BYTES):
            src = decode_tensor(payload, off)
            if src.id != 0:  # id 0 means "no src": the server leaves it NULL
                check_tensor(src, state, checks)
                srcs.append(src)
            else:
                srcs.append(None)
        if not self._ops:
            return
        rules = self._op_rules()
        if rules is None:
            if "*" in self.policy.allow_unverified_ops:
                return
            raise FirewallRefusal("op_not_verified", "this protocol version has no verified op table")
        if op.op >= rules.count:
            raise FirewallRefusal("graph_op_invalid", f"supports_op of op {op.op} >= OP_COUNT {rules.count}")
        row = rules.rows.get(op.op)
        if row is None:
            return  # never forwarded: the proxy answers "not supported" (forwards_op)
        empty_node = not (op.ne0 and op.ne1 and op.ne2 and op.ne3)
        for i in range(row.srcs):
            need = srcs[i]
            if need is None:
                raise FirewallRefusal("graph_src_missing", f"supports_op of {row.op} without src[{i}]")
            if not empty_node and not row.empty_sources and not (need.ne0 and need.ne1 and need.ne2 and need.ne3):
                raise FirewallRefusal("tensor_layout_invalid", f"supports_op of {row.op}: src[{i}] is empty {need.ne}")

    def graph_compute(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        self._graph.check(payload, self.state)

    def graph_recompute(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        device = _U32.unpack_from(payload)[0]
        self._check_device(device)
        if not self._recompute:
            return
        state = self.state
        if device in state.graph_freed:
            # GHSA-2phh-px2f-2qmx: the server would rerun the stored graph on freed memory
            raise FirewallRefusal(
                "recompute_after_free",
                f"device {device}: a buffer its stored graph uses was freed after the last GRAPH_COMPUTE",
            )
        if device not in state.graph_devices:
            raise FirewallRefusal("recompute_without_graph", f"device {device} has no stored graph")
        # the stored graph runs again: counted, and bounded with what is still queued on the
        # server (GRAPH_RECOMPUTE has no answer: a client could pipeline thousands of them)
        self._graph.charge_recompute(state.graph_flops.get(device, 0), state)
