"""What rpcguard does with each ggml-rpc command, one row per command.

How this works: the wire layout of a command in each protocol version is in versions.py; what
rpcguard *does* with it is one ``CommandRow`` here: the ``RequestChecks`` method that checks
its request head (protocol/checks.py) and whether an accepted head may be cached, the
request's ``effect`` on the session (it changes ``SessionState`` and returns the context the
response will need: a handle, a device, an ``AllocAsked``, a copy of the head) and the
response's ``learn`` function (what the answer teaches: buffers, bases, device facts,
hash-cache misses), which gets that context back typed: ``row()`` makes mypy hold each
effect's context type to its learner's. The ``answer`` column is for requests the proxy may
answer itself instead of forwarding (the payload of its answer, or None to forward): a
SET_TENSOR_HASH on a cache other identities share, a supports_op query for an op the firewall
never forwards. The columns are resolved at import into tuples indexed by command id
(``CHECKS``, ``CACHEABLE``, ``EFFECTS``, ``LEARNERS``, ``BATCH``, ``ANSWERS``), so a frame pays
one index each, never a name lookup. Effects and answers run after the firewall accepted the
frame; learners run on the exactly sized response. A learner that finds an answer the protocol
or the backend rules out raises ``response_value_invalid``: it ends the session that got it (the
facts it would have taught are that session's only, state.py).
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Final, Mapping, NamedTuple, Protocol, TypeVar, final

from rpcguard.errors import FirewallRefusal, ProtocolRefusal
from rpcguard.protocol import memshare
from rpcguard.protocol.checks import RequestChecks
from rpcguard.protocol.settings import FirewallPolicy, SessionPolicy
from rpcguard.protocol.state import SessionState, hash_miss_key
from rpcguard.protocol.stats import SessionStats
from rpcguard.protocol.supportsop import layer_supports
from rpcguard.protocol.tensor import alloc_size_key, decode_tensor, nbytes, types_of
from rpcguard.protocol.versions import COMMAND_IDS, COMMAND_NAMES, TENSOR_BYTES, CommandRule, Version

__all__ = ["CommandRow", "AllocAsked", "SessionOps", "Expected", "FirewallOps", "row", "ROWS", "CHECKS", "CACHEABLE",
           "EFFECTS", "LEARNERS", "BATCH", "ANSWERS", "BATCH_MAX_BYTES", "HASH_MISSES_MAX", "ALLOC_SIZES_MAX",
           "SUPPORTS_OP_MAX", "graph_buffers"]

# A BATCH frame larger than this is urgent all the same: its body is streamed as it comes (held
# bytes are copied; a model load's multi-MB SET_TENSORs must not be).
BATCH_MAX_BYTES: Final = 64 * 1024
HASH_MISSES_MAX: Final = 1024  # SET_TENSOR_HASH misses remembered per session (the client uses each at once)
ALLOC_SIZES_MAX: Final = 4096  # padded GET_ALLOC_SIZE answers remembered per session
# supports_op answers remembered per session (the client asks once per op signature: a model's
# few hundred; test-backend-ops' thousands)
SUPPORTS_OP_MAX: Final = 16384

_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")
_U64x2: Final = struct.Struct("<QQ")
_DEV_U64: Final = struct.Struct("<IQ")
_CLEAR: Final = struct.Struct("<QB")
_SET_TENSOR_CACHE_HEAD: Final = TENSOR_BYTES + 9  # 7.0.0: rpc_tensor, u8 cache_flag, u64 offset
_BUFFER_CLEAR: Final = COMMAND_IDS["BUFFER_CLEAR"]
_MISS: Final = b"\x00"  # SET_TENSOR_HASH / GET_DEVICE_SUPPORTS_OP: u8 0 (not found / not supported)
# The buffer field of each rpc_tensor of a graph is at 12 (after id u64, type u32), every 296 bytes.
_TENSOR_STRIDE_U64: Final = TENSOR_BYTES // 8
_SRC_AT: Final = 4 + TENSOR_BYTES  # GET_DEVICE_SUPPORTS_OP: the srcs after u32 device + the op
_OP_AT: Final = 52  # rpc_tensor.op: after id u64, type u32, buffer u64, ne[4] u32, nb[4] u32

C = TypeVar("C")  # what a request's effect leaves for its response's learner (Expect.ctx)
C_co = TypeVar("C_co", covariant=True)


# -- the seam to session.py (which imports this table): what effects, learners and answers use of
# a session, its firewall and an expected response; session.Session, firewall.Firewall and
# session.Expect have it, mypy checks them where session.py calls the table
class FirewallOps(Protocol):
    @property
    def policy(self) -> FirewallPolicy: ...  # the firewall's own (connect: checks left to the node)
    def check_quota(self, device: int) -> None: ...
    def forwards_op(self, op: int) -> bool: ...


class Expected(Protocol[C_co]):
    @property
    def ctx(self) -> C_co: ...  # what the request's effect left
    @property
    def swallow(self) -> bool: ...  # the proxy asked (inject): the response is not forwarded


class SessionOps(Protocol):
    """What the command table's functions read and call of a session (session.Session)."""
    @property
    def state(self) -> SessionState: ...
    @property
    def stats(self) -> SessionStats: ...
    @property
    def policy(self) -> SessionPolicy: ...
    @property
    def firewall(self) -> FirewallOps: ...
    @property
    def multi_device(self) -> bool: ...
    @property
    def version(self) -> Version | None: ...
    @property
    def hash_forwarded(self) -> bool: ...
    def rule(self, cmd: int) -> CommandRule: ...
    def inject(self, cmd: int, payload: bytes, response: int, ctx: object = None) -> None: ...
    def learn_memory(self) -> None: ...
    def learn_alignment(self) -> None: ...
    def violated(self, refusal: FirewallRefusal, command: str) -> None: ...


Check = Callable[[RequestChecks, CommandRule, memoryview, int], None]  # (checks, rule, head, body_len)
Effect = Callable[[SessionOps, memoryview, int], C]  # (session, head, body_len) -> response context
# (session, expectation, response head) -> None, or the response frame the client gets instead (memshare.py)
Learn = Callable[[SessionOps, Expected[C], memoryview], "bytes | None"]
Answer = Callable[[SessionOps, memoryview], "bytes | None"]  # (session, head) -> the proxy's answer, or forward


class CommandRow(NamedTuple):
    check: Check | None  # the RequestChecks method that validates the request head
    effect: Effect[Any] | None
    learn: Learn[Any] | None
    # The server answers nothing and starts no work: the frame may wait in the proxy and go out
    # with the next one that needs the server's attention (Output.urgent, proxy/link.py).
    batch: bool = False
    # The head's verdict depends only on the command, the head bytes, the body length and the
    # live buffers (the session's version and checks are fixed), so an accepted head is
    # remembered until the buffer map changes (Firewall.check_request; SET_TENSOR with
    # cache_flag=1 never is).
    cacheable: bool = False
    # The proxy may answer the request itself (the payload, or None: forward it); the effect and
    # learner then do not run.
    answer: Answer | None = None


def row(check: Check | None, effect: Effect[C] | None, learn: Learn[C] | None, *, batch: bool = False,
        cacheable: bool = False, answer: Answer | None = None) -> CommandRow:
    """One command's row; the effect's context type and the learner's are one ``C``."""
    return CommandRow(check, effect, learn, batch, cacheable, answer)


def _invalid(what: str) -> ProtocolRefusal:
    return ProtocolRefusal("response_value_invalid", what)


@final
class AllocAsked:
    """ALLOC_BUFFER's context: the device and the size asked for, charged until the answer."""

    __slots__ = ("device", "size")

    def __init__(self, device: int, size: int) -> None:
        self.device = device
        self.size = size


# ----------------------------------------------------------------------------- request effects
def alloc_request(s: SessionOps, head: memoryview, body_len: int) -> AllocAsked:
    device, size = _DEV_U64.unpack_from(head) if s.multi_device else (0, _U64.unpack_from(head)[0])
    s.state.charge_alloc(device, size)  # reserved until the answer says what was granted
    return AllocAsked(device, size)


def device_request(s: SessionOps, head: memoryview, body_len: int) -> int:
    return _U32.unpack_from(head)[0] if len(head) >= 4 else 0  # no device before 3.0.0


def handle_request(s: SessionOps, head: memoryview, body_len: int) -> int:
    handle: int = _U64.unpack_from(head)[0]
    return handle


def free_request(s: SessionOps, head: memoryview, body_len: int) -> None:
    s.state.free_buffer(_U64.unpack_from(head)[0])


def set_tensor_request(s: SessionOps, head: memoryview, body_len: int) -> None:
    s.stats.upload_bytes_set += body_len
    if len(head) == _SET_TENSOR_CACHE_HEAD and head[TENSOR_BYTES]:
        s.state.hash_misses.discard(hash_miss_key(head))  # one miss, one cached write


def head_copy(s: SessionOps, head: memoryview, body_len: int) -> bytes:
    return bytes(head)


def graph_buffers(payload: memoryview | bytes, header: int) -> frozenset[int] | None:
    """The buffer handles a GRAPH_COMPUTE payload's tensors name (None: the payload is not whole)."""
    if len(payload) < header:
        return None
    n_nodes = _U32.unpack_from(payload, header - 4)[0]
    at = header + 8 * n_nodes
    if len(payload) < at + 4:
        return None
    m = _U32.unpack_from(payload, at)[0]
    if len(payload) != at + 4 + TENSOR_BYTES * m:
        return None
    if m == 0:
        return frozenset()
    # every tensor's buffer field as one strided u64 view (296 = 37 * 8): read in C, no Python loop
    first = at + 4 + 12
    return frozenset(memoryview(payload)[first : first + (_TENSOR_STRIDE_U64 * (m - 1) + 1) * 8]
                     .cast("B").cast("Q")[::_TENSOR_STRIDE_U64])


def graph_request(s: SessionOps, head: memoryview, body_len: int) -> None:
    # The server stores the graph for GRAPH_RECOMPUTE, pointing into the buffers it names.
    device = _U32.unpack_from(head)[0] if s.multi_device else 0
    spec = s.state.spec
    s.state.graph_stored(device, graph_buffers(head, spec.graph_header) if spec is not None else None)


def supports_op_request(s: SessionOps, head: memoryview, body_len: int) -> tuple[int, int, tuple[int, ...]]:
    # (device, op, the op tensor's type and each src's, -1 where absent): the answer's key
    t = decode_tensor(head, 4)
    types = [t.type]
    for off in range(_SRC_AT, len(head), TENSOR_BYTES):
        src = decode_tensor(head, off)
        types.append(src.type if src.id else -1)
    return _U32.unpack_from(head)[0], t.op, tuple(types)


def alloc_size_request(s: SessionOps, head: memoryview, body_len: int) -> bytes:
    return bytes(head[: (4 if s.multi_device else 0) + TENSOR_BYTES])  # [device] + the tensor, not its srcs


# ----------------------------------------------------------------------------- response learners
def alloc_answer(s: SessionOps, exp: Expected[AllocAsked], head: memoryview) -> None:
    handle, size = _U64x2.unpack_from(head)
    device = exp.ctx.device
    s.state.charge_alloc(device, (size if handle else 0) - exp.ctx.size)
    if handle:
        s.state.add_buffer(handle, device, size)
        s.stats.alloc_bytes += size
        if s.policy.clear_new_buffers:
            # Tenant isolation: new device memory is not zeroed by the server (spec §2.4).
            s.inject(_BUFFER_CLEAR, _CLEAR.pack(handle, 0), s.rule(_BUFFER_CLEAR).response)


def base_answer(s: SessionOps, exp: Expected[int], head: memoryview) -> None:
    s.state.set_base(exp.ctx, _U64.unpack_from(head)[0])


def device_count_answer(s: SessionOps, exp: Expected[None], head: memoryview) -> None:
    s.state.upstream.device_count = _U32.unpack_from(head)[0]
    if exp.swallow:  # the session's own question after HELLO: then its devices' memory and alignment
        s.learn_memory()
        s.learn_alignment()


def alignment_answer(s: SessionOps, exp: Expected[int], head: memoryview) -> None:
    alignment = _U64.unpack_from(head)[0]
    if alignment == 0 or alignment & (alignment - 1):
        # ggml pads every tensor with GGML_PAD(x, alignment): a power of two (ggml-backend.cpp)
        raise _invalid(f"GET_ALIGNMENT of device {exp.ctx}: {alignment} is not a power of two")
    s.state.upstream.alignment[exp.ctx] = alignment


def max_size_answer(s: SessionOps, exp: Expected[int], head: memoryview) -> None:
    s.state.upstream.max_size[exp.ctx] = _U64.unpack_from(head)[0]


def memory_answer(s: SessionOps, exp: Expected[int], head: memoryview) -> bytes | None:
    device = exp.ctx
    free, total = s.state.upstream.memory[device] = _U64x2.unpack_from(head)
    # ALLOC_BUFFERs forwarded before the quota was known are held to it now.
    try:
        s.firewall.check_quota(device)
    except FirewallRefusal as refusal:
        s.violated(refusal, "ALLOC_BUFFER")
    return memshare.answer(s.firewall.policy, s.state, device, free, total)  # the client is told its share


def alloc_size_answer(s: SessionOps, exp: Expected[bytes], head: memoryview) -> None:
    req = exp.ctx
    at = len(req) - TENSOR_BYTES
    device = _U32.unpack_from(req)[0] if at else 0
    t = decode_tensor(req, at)
    info = types_of(s.version).get(t.type)
    size = _U64.unpack_from(head)[0]
    if info is None:
        return
    n = nbytes(t, info)
    if size < n:
        # a backend's allocation size is never below ggml_nbytes of the tensor it was asked about
        # (ggml_backend_buft_get_alloc_size's default; the padding backends add to it)
        raise _invalid(f"GET_ALLOC_SIZE of a {n}-byte tensor answered {size}")
    if size > n:
        sizes = s.state.upstream.alloc_sizes
        if len(sizes) >= ALLOC_SIZES_MAX:
            sizes.clear()
        sizes[alloc_size_key(device, t)] = size


def hash_answer(s: SessionOps, exp: Expected[bytes], head: memoryview) -> None:
    req = exp.ctx
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


def supports_op_answer(s: SessionOps, exp: Expected[tuple[int, int, tuple[int, ...]]], head: memoryview) -> None:
    value = head[0]
    if value > 1:
        raise _invalid(f"GET_DEVICE_SUPPORTS_OP answered {value}, not 0 or 1")
    answers = s.state.upstream.supports_op
    if len(answers) >= SUPPORTS_OP_MAX:
        answers.clear()
    answers[exp.ctx] = value == 1


# ----------------------------------------------------------------------------- the proxy's answers
def hash_local(s: SessionOps, head: memoryview) -> bytes | None:
    """SET_TENSOR_HASH answers from the server's -c cache, which holds what any client uploaded
    with cache_flag=1: a tenant that knows the FNV-1a hash of another's tensor gets its bytes
    written into its own buffer (issue 28). Only a contained serve gives each identity its own
    cache directory (upstream/pool.py, docs/containment.md); everywhere else the proxy answers
    "not cached" itself, so the client uploads the tensor (and the session keeps its cache_flag
    out of the shared cache: Session._forward)."""
    if s.hash_forwarded:
        return None
    misses = s.state.hash_misses
    if len(misses) >= HASH_MISSES_MAX:
        misses.clear()
    misses.add(bytes(head[: TENSOR_BYTES + 8]))  # the client may send this tensor once with cache_flag=1
    s.stats.hash_answered_by_proxy += 1
    return _MISS


def supports_op_local(s: SessionOps, head: memoryview) -> bytes | None:
    """An op the firewall never forwards in a graph (no verified rule, denied, or contained
    only on a server that is not contained), or that the device's backend layer refuses, is "not
    supported": the scheduler then places it on another backend, and the server never sees a query
    whose sources nobody checked."""
    if not s.firewall.forwards_op(_U32.unpack_from(head, 4 + _OP_AT)[0]):
        return _MISS
    # the device's backend layer (protocol/supportsop.py): on CUDA what the CUDA layer refuses
    return None if layer_supports(s.firewall.policy, s.state, head) else _MISS


# ----------------------------------------------------------------------------- the table
ROWS: Mapping[str, CommandRow] = {
    #                         firewall check (protocol/checks.py) request effect  response learner
    "ALLOC_BUFFER":      row(RequestChecks.alloc_buffer,    alloc_request,      alloc_answer),
    "GET_ALIGNMENT":     row(RequestChecks.device_only,     device_request,     alignment_answer),
    "GET_MAX_SIZE":      row(RequestChecks.device_only,     device_request,     max_size_answer),
    "BUFFER_GET_BASE":   row(RequestChecks.handle,          handle_request,     base_answer),
    "FREE_BUFFER":       row(RequestChecks.handle,          free_request,       None),
    "BUFFER_CLEAR":      row(RequestChecks.handle,          None,               None),
    "SET_TENSOR":        row(RequestChecks.set_tensor,      set_tensor_request, None, batch=True, cacheable=True),
    "SET_TENSOR_HASH":   row(RequestChecks.set_tensor_hash, head_copy,          hash_answer, cacheable=True,
                             answer=hash_local),
    "GET_TENSOR":        row(RequestChecks.get_tensor,      None,               None, cacheable=True),  # streamed answer
    "COPY_TENSOR":       row(RequestChecks.copy_tensor,     None,               None),
    "GRAPH_COMPUTE":     row(RequestChecks.graph_compute,   graph_request,      None),
    "GET_DEVICE_MEMORY": row(RequestChecks.device_only,     device_request,     memory_answer),
    "INIT_TENSOR":       row(RequestChecks.init_tensor,     None,               None),
    "GET_ALLOC_SIZE":    row(RequestChecks.get_alloc_size,  alloc_size_request, alloc_size_answer),
    "HELLO":             row(None,                          None,               None),  # the session's own
    "DEVICE_COUNT":      row(None,                          None,               device_count_answer),
    "GRAPH_RECOMPUTE":   row(RequestChecks.graph_recompute, None,               None),
    # MEMSET_TENSOR's head is GET_TENSOR's (rpc_tensor, offset, size) and a value
    "MEMSET_TENSOR":     row(RequestChecks.get_tensor,      None,               None, cacheable=True),
    "NONE":              row(None,                          None,               None),  # never in a version
    "GET_DEVICE_SUPPORTS_OP": row(RequestChecks.device_supports_op, supports_op_request, supports_op_answer,
                                  answer=supports_op_local),
}  # fmt: skip

CHECKS: Final[tuple[Check | None, ...]] = tuple(ROWS[name].check for name in COMMAND_NAMES)
CACHEABLE: Final[tuple[bool, ...]] = tuple(ROWS[name].cacheable for name in COMMAND_NAMES)
EFFECTS: Final[tuple[Effect[Any] | None, ...]] = tuple(ROWS[name].effect for name in COMMAND_NAMES)
LEARNERS: Final[tuple[Learn[Any] | None, ...]] = tuple(ROWS[name].learn for name in COMMAND_NAMES)
BATCH: Final[tuple[bool, ...]] = tuple(ROWS[name].batch for name in COMMAND_NAMES)
ANSWERS: Final[tuple[Answer | None, ...]] = tuple(ROWS[name].answer for name in COMMAND_NAMES)
