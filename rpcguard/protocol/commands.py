"""What rpcguard does with each ggml-rpc command, one row per command.

How this works: the wire layout of a command in each protocol version is in versions.py; what
rpcguard *does* with it is one ``CommandRow`` here: the ``Firewall`` method that checks its
request head, the request's ``effect`` on the session (it changes ``SessionState`` and returns
what the response will need: a handle, a device, a copy of the head) and the response's
``learn`` function (what the answer teaches: buffers, bases, device facts, hash-cache misses).
``Session`` and ``Firewall`` resolve the rows once into tuples indexed by command id
(``EFFECTS``, ``LEARNERS``, ``CHECKS``), so a frame pays one index each, never a name lookup.
Effects run after the firewall accepted the frame; learners run on the exactly sized response.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, Final, Mapping, NamedTuple

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.state import alloc_size_key, hash_miss_key
from rpcguard.protocol.tensor import decode_tensor, nbytes, types_of
from rpcguard.protocol.versions import COMMAND_IDS, COMMAND_NAMES, TENSOR_BYTES

if TYPE_CHECKING:
    from rpcguard.protocol.session import Expect, Session

__all__ = ["CommandRow", "ROWS", "CHECKS", "EFFECTS", "LEARNERS", "BATCH", "BATCH_MAX_BYTES", "HASH_MISSES_MAX",
           "ALLOC_SIZES_MAX"]

# A BATCH frame larger than this is urgent all the same: its body is streamed as it comes (held
# bytes are copied; a model load's multi-MB SET_TENSORs must not be).
BATCH_MAX_BYTES: Final = 64 * 1024
HASH_MISSES_MAX: Final = 1024  # SET_TENSOR_HASH misses remembered per session (the client uses each at once)
ALLOC_SIZES_MAX: Final = 4096  # padded GET_ALLOC_SIZE answers remembered per upstream

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_U64x2: Final = struct.Struct("<QQ")
_DEV_U64: Final = struct.Struct("<IQ")
_CLEAR: Final = struct.Struct("<QB")
_SET_TENSOR_CACHE_HEAD: Final = TENSOR_BYTES + 9  # 7.0.0: rpc_tensor, u8 cache_flag, u64 offset
_BUFFER_CLEAR: Final = COMMAND_IDS["BUFFER_CLEAR"]

Effect = Callable[["Session", memoryview, int], object]  # (session, head, body_len) -> response context
Learn = Callable[["Session", "Expect", memoryview], None]  # (session, expectation, response head)


class CommandRow(NamedTuple):
    check: str | None  # Firewall method that validates the request head
    effect: Effect | None
    learn: Learn | None
    # The server answers nothing and starts no work: the frame may wait in the proxy and go out
    # with the next one that needs the server's attention (Output.urgent, proxy/link.py).
    batch: bool = False


# ----------------------------------------------------------------------------- request effects
def _multi(s: Session) -> bool:
    return s.state.spec.multi_device  # type: ignore[union-attr]  # requests are planned from a spec


def alloc_request(s: Session, head: memoryview, body_len: int) -> object:
    ctx: tuple[int, int] = _DEV_U64.unpack_from(head) if _multi(s) else (0, _U64.unpack_from(head)[0])
    s.state.charge_alloc(*ctx)  # reserved until the answer says what was granted
    return ctx


def device_request(s: Session, head: memoryview, body_len: int) -> object:
    return _U32.unpack_from(head)[0] if len(head) >= 4 else 0  # no device before 3.0.0


def handle_request(s: Session, head: memoryview, body_len: int) -> object:
    return _U64.unpack_from(head)[0]


def free_request(s: Session, head: memoryview, body_len: int) -> object:
    s.state.free_buffer(_U64.unpack_from(head)[0])
    return None


def set_tensor_request(s: Session, head: memoryview, body_len: int) -> object:
    s.stats.upload_bytes_set += body_len
    if len(head) == _SET_TENSOR_CACHE_HEAD and head[TENSOR_BYTES]:
        s.state.hash_misses.discard(hash_miss_key(head))  # one miss, one cached write
    return None


def head_copy(s: Session, head: memoryview, body_len: int) -> object:
    return bytes(head)


def graph_request(s: Session, head: memoryview, body_len: int) -> object:
    s.state.graph_stored(_U32.unpack_from(head)[0] if _multi(s) else 0)
    return None


def alloc_size_request(s: Session, head: memoryview, body_len: int) -> object:
    return bytes(head[: (4 if _multi(s) else 0) + TENSOR_BYTES])  # [device] + the tensor, not its srcs


# ----------------------------------------------------------------------------- response learners
def alloc_answer(s: Session, exp: Expect, head: memoryview) -> None:
    handle, size = _U64x2.unpack_from(head)
    device: int
    asked: int
    device, asked = exp.ctx  # type: ignore[misc]
    s.state.charge_alloc(device, (size if handle else 0) - asked)
    if handle:
        s.state.add_buffer(handle, device, size)
        s.stats.alloc_bytes += size
        if s.policy.clear_new_buffers:
            # Tenant isolation: new device memory is not zeroed by the server (spec §2.4).
            rule = s.state.spec.commands[_BUFFER_CLEAR]  # type: ignore[union-attr]
            assert rule is not None
            s.inject(_BUFFER_CLEAR, _CLEAR.pack(handle, 0), rule.response)


def base_answer(s: Session, exp: Expect, head: memoryview) -> None:
    s.state.set_base(exp.ctx, _U64.unpack_from(head)[0])  # type: ignore[arg-type]


def device_count_answer(s: Session, exp: Expect, head: memoryview) -> None:
    s.state.upstream.device_count = _U32.unpack_from(head)[0]
    if exp.swallow:
        s.learn_memory()


def alignment_answer(s: Session, exp: Expect, head: memoryview) -> None:
    s.state.upstream.alignment[exp.ctx] = _U64.unpack_from(head)[0]  # type: ignore[index]


def max_size_answer(s: Session, exp: Expect, head: memoryview) -> None:
    s.state.upstream.max_size[exp.ctx] = _U64.unpack_from(head)[0]  # type: ignore[index]


def memory_answer(s: Session, exp: Expect, head: memoryview) -> None:
    device: int = exp.ctx  # type: ignore[assignment]
    s.state.upstream.memory[device] = _U64x2.unpack_from(head)
    # ALLOC_BUFFERs forwarded before the quota was known are held to it now.
    try:
        s.firewall.check_quota(device)
    except FirewallRefusal as refusal:
        s.violated(refusal, "ALLOC_BUFFER")


def alloc_size_answer(s: Session, exp: Expect, head: memoryview) -> None:
    req: bytes = exp.ctx  # type: ignore[assignment]
    at = len(req) - TENSOR_BYTES
    device = _U32.unpack_from(req)[0] if at else 0
    t = decode_tensor(req, at)
    info = types_of(s.version).get(t.type)
    size = _U64.unpack_from(head)[0]
    if info is not None and size > nbytes(t, info):
        sizes = s.state.upstream.alloc_sizes
        if len(sizes) >= ALLOC_SIZES_MAX:
            sizes.clear()
        sizes[alloc_size_key(device, t)] = size


def hash_answer(s: Session, exp: Expect, head: memoryview) -> None:
    req: bytes = exp.ctx  # type: ignore[assignment]
    if head[0] == 0:
        # A miss: the client may now send this tensor once with cache_flag=1.
        misses = s.state.hash_misses
        if len(misses) >= HASH_MISSES_MAX:
            misses.clear()
        misses.add(req[: TENSOR_BYTES + 8])  # rpc_tensor + offset
    elif head[0] == 1:
        # A hit: the server wrote the tensor from its cache instead of receiving it. The client
        # hashes whole tensors (offset 0, nbytes), so count what a SET_TENSOR would have sent.
        t = decode_tensor(req)
        info = types_of(s.version).get(t.type)
        offset = _U64.unpack_from(req, TENSOR_BYTES)[0]
        if info is not None:
            s.stats.upload_bytes_hash_hit += max(0, nbytes(t, info) - offset)


# ----------------------------------------------------------------------------- the table
ROWS: Mapping[str, CommandRow] = {
    #                                firewall check       request effect      response learner
    "ALLOC_BUFFER":      CommandRow("_alloc_buffer",     alloc_request,      alloc_answer),
    "GET_ALIGNMENT":     CommandRow("_device_only",      device_request,     alignment_answer),
    "GET_MAX_SIZE":      CommandRow("_device_only",      device_request,     max_size_answer),
    "BUFFER_GET_BASE":   CommandRow("_handle",           handle_request,     base_answer),
    "FREE_BUFFER":       CommandRow("_handle",           free_request,       None),
    "BUFFER_CLEAR":      CommandRow("_handle",           None,               None),
    "SET_TENSOR":        CommandRow("_set_tensor",       set_tensor_request, None,  batch=True),
    "SET_TENSOR_HASH":   CommandRow("_set_tensor_hash",  head_copy,          hash_answer),
    "GET_TENSOR":        CommandRow("_get_tensor",       None,               None),  # streamed answer
    "COPY_TENSOR":       CommandRow("_copy_tensor",      None,               None),
    "GRAPH_COMPUTE":     CommandRow("_graph_compute",    graph_request,      None),
    "GET_DEVICE_MEMORY": CommandRow("_device_only",      device_request,     memory_answer),
    "INIT_TENSOR":       CommandRow("_init_tensor",      None,               None),
    "GET_ALLOC_SIZE":    CommandRow("_get_alloc_size",   alloc_size_request, alloc_size_answer),
    "HELLO":             CommandRow(None,                None,               None),  # the session's own
    "DEVICE_COUNT":      CommandRow(None,                None,               device_count_answer),
    "GRAPH_RECOMPUTE":   CommandRow("_graph_recompute",  None,               None),
    "MEMSET_TENSOR":     CommandRow("_get_tensor",       None,               None),  # T, offset, size (+ value)
}  # fmt: skip

CHECKS: Final[tuple[str | None, ...]] = tuple(ROWS[name].check for name in COMMAND_NAMES)
EFFECTS: Final[tuple[Effect | None, ...]] = tuple(ROWS[name].effect for name in COMMAND_NAMES)
LEARNERS: Final[tuple[Learn | None, ...]] = tuple(ROWS[name].learn for name in COMMAND_NAMES)
BATCH: Final[tuple[bool, ...]] = tuple(ROWS[name].batch for name in COMMAND_NAMES)
