"""rpc_tensor decoding, exact ggml_nbytes, and the per-tensor firewall rules.

How this works: ``decode_tensor`` turns 296 wire bytes into a flat ``RpcTensor`` tuple with one
``TENSOR_STRUCT.unpack_from`` call. ``nbytes`` is ggml's ``ggml_nbytes`` in exact Python ints
(the server computes it in wrapping 64-bit arithmetic, spec §3.1). ``check_tensor`` applies the
"every T" row of spec §6.2 and returns the tensor's nbytes for the command-level range checks;
which rule groups run is a small bit mask (``CHECK_*``) the firewall derives from its policy.

Rules (reason strings are stable, see docs/design.md):
  * ``tensor_type_invalid``       type unknown to that version or a removed type (blck_size 0)
  * ``tensor_shape_invalid``      ne[0] not a multiple of the block size (#25288), or more
                                  elements than ggml_new_tensor accepts (int64, a server abort)
  * ``tensor_nbytes_overflow``    exact nbytes >= 2^63
  * ``tensor_flags_invalid``      flag bits above bit 4
  * ``tensor_name_unterminated``  no NUL inside the 64 name bytes
  * ``tensor_data_without_buffer`` buffer == 0 but data != 0 (CVE-2026-34159)
  * ``buffer_unknown``            non-zero buffer that is not a live handle of this session
  * ``tensor_out_of_buffer``      data range not inside the buffer, or the buffer base unknown
"""

from __future__ import annotations

from typing import Final, Mapping, NamedTuple

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.ggml import TYPES, TypeInfo, types_for
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.versions import TENSOR_BYTES, Version

__all__ = [
    "RpcTensor",
    "decode_tensor",
    "nbytes",
    "alloc_size_key",
    "check_tensor",
    "types_of",
    "CHECK_TENSOR",
    "CHECK_BUFFER",
    "FOREIGN_BUFFER_OK",
    "STRICT",
    "NBYTES_LIMIT",
    "FLAGS_MASK",
    "TENSOR_CACHE_MAX",
]

# Rule groups for check_tensor (bit mask).
CHECK_TENSOR: Final = 1  # type, shape, nbytes, flags, name
CHECK_BUFFER: Final = 2  # buffer/data consistency and the data range inside the buffer
# GET_ALLOC_SIZE only: the server treats an unknown handle as "no buffer" and never touches the
# data there, and the 7.0.0 client serialises srcs living on *another* RPC server with that
# server's handle, so an unknown handle is not refused for it (known handles are range-checked).
FOREIGN_BUFFER_OK: Final = 4
STRICT: Final = CHECK_TENSOR | CHECK_BUFFER

NBYTES_LIMIT: Final = 1 << 63  # the server's size_t arithmetic wraps; anything this large is a lie
INT64_MAX: Final = (1 << 63) - 1  # ggml_new_tensor_impl asserts the element count fits in int64_t
FLAGS_MASK: Final = 0x1F  # INPUT, OUTPUT, PARAM, LOSS, COMPUTE; other bits are undefined (spec §3.1)
# Validated tensors are remembered by their 296 raw bytes (SessionState.tensor_cache). A graph's
# weight tensors repeat every token; node ids change when shapes change, so the cache is bounded:
# 65536 entries is about 30 MB, several times the tensors of one large-model graph.
# Not Final: tests shrink it (an insert-time bound, off the per-frame path).
TENSOR_CACHE_MAX = 1 << 16


class RpcTensor(NamedTuple):
    """One decoded ``rpc_tensor`` (spec §3.1); fields flat, in wire order, ``name`` is 64 raw bytes.

    Written out field by field so that the type checker knows each one; at run time this is the
    same ``collections.namedtuple`` class as before (tuple equality, hashing, ``_make``, pickling
    by value), which ``tests/unit/protocol/test_tensor_class.py`` compares with the computed-field version.
    """

    id: int
    type: int
    buffer: int
    ne0: int
    ne1: int
    ne2: int
    ne3: int
    nb0: int
    nb1: int
    nb2: int
    nb3: int
    op: int
    param0: int
    param1: int
    param2: int
    param3: int
    param4: int
    param5: int
    param6: int
    param7: int
    param8: int
    param9: int
    param10: int
    param11: int
    param12: int
    param13: int
    param14: int
    param15: int
    flags: int
    src0: int
    src1: int
    src2: int
    src3: int
    src4: int
    src5: int
    src6: int
    src7: int
    src8: int
    src9: int
    view_src: int
    view_offs: int
    data: int
    name: bytes
    use_count: int

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return self[3:7]

    @property
    def nb(self) -> tuple[int, int, int, int]:
        return self[7:11]

    @property
    def op_params(self) -> tuple[int, ...]:
        return self[12:28]

    @property
    def src(self) -> tuple[int, ...]:
        return self[29:39]


_make = RpcTensor._make
_unpack_from = TENSOR_STRUCT.unpack_from
assert len(RpcTensor._fields) == len(TENSOR_STRUCT.unpack(bytes(TENSOR_BYTES)))


def decode_tensor(buf: memoryview | bytes, offset: int = 0) -> RpcTensor:
    """The ``rpc_tensor`` at ``offset`` of ``buf`` (caller guarantees 296 bytes are there)."""
    return _make(_unpack_from(buf, offset))


def alloc_size_key(device: int, t: RpcTensor) -> tuple[int, ...]:
    """What a server's allocation size depends on (the client's own cache key, ggml-rpc.cpp:869-887):
    the key of UpstreamFacts.alloc_sizes, written by the command table's learner and read by the firewall."""
    return (device, t.type, *t[3:11], t.op)


def nbytes(t: RpcTensor, info: TypeInfo) -> int:
    """``ggml_nbytes`` in exact integers: 0 if any ne is 0 (strides of size-1 dims never count)."""
    ne0, ne1, ne2, ne3 = t.ne0, t.ne1, t.ne2, t.ne3
    if not (ne0 and ne1 and ne2 and ne3):
        return 0
    blck = info.blck_size
    if blck == 1:
        n = info.type_size + (ne0 - 1) * t.nb0
    else:
        n = ne0 * t.nb0 // blck
    return n + (ne1 - 1) * t.nb1 + (ne2 - 1) * t.nb2 + (ne3 - 1) * t.nb3


_TYPES_BY_VERSION: dict[Version | None, Mapping[int, TypeInfo]] = {}


def types_of(version: Version | None) -> Mapping[int, TypeInfo]:
    """Valid types of ``version``: ids below its GGML_TYPE_COUNT when that was read, else all known.

    New types never bump the protocol version (spec §6.3), so for a version whose type enum was not
    read, every type known to any version is accepted; its server rejects the rest itself.
    """
    table = _TYPES_BY_VERSION.get(version)
    if table is None:
        table = (types_for(version) if version is not None else None) or TYPES
        _TYPES_BY_VERSION[version] = table
    return table


def _refuse(reason: str, t: RpcTensor, what: str) -> FirewallRefusal:
    return FirewallRefusal(reason, f"tensor id={t.id:#x}: {what}")


def check_tensor(t: RpcTensor, state: SessionState, checks: int = STRICT) -> int:
    """Apply the per-tensor rules (spec §6.2 "every T") and return ``nbytes(t)``.

    Raises ``FirewallRefusal``. With ``CHECK_TENSOR`` off, a tensor whose type has no size
    information counts as 0 bytes; its buffer and data are still checked (``CHECK_BUFFER``).
    """
    spec = state.spec
    _, type_, handle, ne0, ne1, ne2, ne3, nb0, nb1, nb2, nb3 = t[:11]
    info = types_of(spec.version if spec is not None else None).get(type_)
    if info is None:
        if checks & CHECK_TENSOR:
            raise _refuse("tensor_type_invalid", t, f"type {type_} is not a valid ggml type here")
        n = 0  # no size information: the buffer rules below still run
    else:
        # nbytes(t, info), inlined: this is the hot path of GRAPH_COMPUTE validation.
        blck = info.blck_size
        if not (ne0 and ne1 and ne2 and ne3):
            n = 0
        elif blck == 1:
            n = info.type_size + (ne0 - 1) * nb0 + (ne1 - 1) * nb1 + (ne2 - 1) * nb2 + (ne3 - 1) * nb3
        else:
            n = ne0 * nb0 // blck + (ne1 - 1) * nb1 + (ne2 - 1) * nb2 + (ne3 - 1) * nb3
        if checks & CHECK_TENSOR:
            if ne0 % blck:
                raise _refuse("tensor_shape_invalid", t, f"ne[0]={ne0} not a multiple of block size {blck} ({info.name})")
            # ggml_new_tensor_impl: GGML_ASSERT(INT64_MAX / ne[i] > current) for each ne[i] > 1 (a 0 in
            # ne[1..3] is skipped, so an empty tensor can still abort the server). Any such product up
            # to 2^62 passes (each ne < 2^32), so the exact replay runs only above that.
            if ne0 * (ne1 or 1) * (ne2 or 1) * (ne3 or 1) > 1 << 62:
                cur = ne0
                for ne in (ne1, ne2, ne3):
                    if ne > 1:
                        if INT64_MAX // ne <= cur:
                            raise _refuse("tensor_shape_invalid", t, "element count does not fit in int64")
                        cur *= ne
            if n >= NBYTES_LIMIT:
                raise _refuse("tensor_nbytes_overflow", t, f"nbytes {n} >= 2^63")
            flags = t.flags
            if flags & ~FLAGS_MASK:
                raise _refuse("tensor_flags_invalid", t, f"flags {flags:#x} has bits above {FLAGS_MASK:#x}")
            if b"\0" not in t.name:
                raise _refuse("tensor_name_unterminated", t, "no NUL in the 64 name bytes")
    if checks & CHECK_BUFFER:
        if handle == 0:
            if t.data != 0:
                raise _refuse("tensor_data_without_buffer", t, f"buffer=0 but data={t.data:#x}")
            return n
        buf = state.buffers.get(handle)
        if buf is None:
            if checks & FOREIGN_BUFFER_OK:
                return n
            raise _refuse("buffer_unknown", t, f"buffer {handle:#x} is not a live buffer of this session")
        base = buf.base
        if base is None:
            raise _refuse("tensor_out_of_buffer", t, f"base of buffer {handle:#x} unknown (no BUFFER_GET_BASE yet)")
        data = t.data
        if data < base or data + n > base + buf.size:
            raise _refuse(
                "tensor_out_of_buffer",
                t,
                f"data [{data:#x}, +{n}) outside buffer {handle:#x} [{base:#x}, +{buf.size})",
            )
    return n
