"""rpc_tensor decoding, exact nbytes and the per-tensor rules (spec §3.1, §6.2 "every T")."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, pack_tensor
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import (
    CHECK_BUFFER,
    CHECK_TENSOR,
    FOREIGN_BUFFER_OK,
    RpcTensor,
    check_tensor,
    decode_tensor,
    nbytes,
)
from rpcguard.protocol.versions import spec_for

HANDLE = 0x00005555DEADBE00
BASE = 0x00007F0000000000
SIZE = 1 << 20

# Spec §8 SET_TENSOR vector, bytes 9..305: the rpc_tensor of "x" (F32, ne [4,1,1,1]).
SPEC_TENSOR = bytes.fromhex(
    "0010000000000000" "00000000" "00bead de55550000" "04000000" "01000000" "01000000" "01000000"
    "04000000" "10000000" "10000000" "10000000" "00000000"
) + bytes(64 + 4 + 80 + 8 + 8) + bytes.fromhex("00000000007f0000") + b"x" + bytes(63) + bytes(4)


def state(version=(7, 0, 0), base: int | None = BASE, size: int = SIZE) -> SessionState:
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(version))
    st.add_buffer(HANDLE, 0, size)
    st.buffers[HANDLE].base = base
    return st


def tensor(**kw) -> RpcTensor:
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE)
    return decode_tensor(pack_tensor(TensorSpec(**kw)))


def refused(t: RpcTensor, st: SessionState | None = None, checks: int = CHECK_TENSOR | CHECK_BUFFER) -> str:
    with pytest.raises(FirewallRefusal) as exc:
        check_tensor(t, st or state(), checks)
    return exc.value.reason


def test_spec_vector_decodes():
    assert len(SPEC_TENSOR) == 296
    t = decode_tensor(SPEC_TENSOR)
    assert (t.id, t.type, t.buffer, t.data) == (0x1000, 0, HANDLE, BASE)
    assert t.ne == (4, 1, 1, 1) and t.nb == (4, 16, 16, 16)
    assert t.name.rstrip(b"\0") == b"x" and t.use_count == 0
    assert t.op_params == (0,) * 16 and t.src == (0,) * 10
    assert SPEC_TENSOR == pack_tensor(TensorSpec(id=0x1000, buffer=HANDLE, data=BASE, name=b"x"))
    assert check_tensor(t, state()) == 16


def test_decode_at_offset():
    raw = b"\xff" * 7 + pack_tensor(TensorSpec(id=0x42))
    assert decode_tensor(memoryview(raw), 7).id == 0x42


@pytest.mark.parametrize(
    "type_, ne, nb, expected",
    [
        (0, (4, 1, 1, 1), (4, 16, 16, 16), 16),  # strides of size-1 dims never count (#26912)
        (0, (4, 3, 1, 1), (4, 16, 48, 48), 48),
        (0, (0, 3, 1, 1), (4, 16, 48, 48), 0),  # any ne == 0: empty
        (0, (4, 3, 2, 1), (12, 4, 100, 0), 4 + 3 * 12 + 2 * 4 + 100),  # permuted strides
        (8, (64, 2, 1, 1), (34, 68, 136, 136), 64 * 34 // 32 + 68),  # Q8_0 block 32
        (12, (256, 1, 1, 1), (144, 144, 144, 144), 144),  # Q4_K block 256
    ],
)
def test_nbytes_matches_ggml(type_, ne, nb, expected):
    t = tensor(type=type_, ne=ne, nb=nb)
    assert nbytes(t, TYPES[type_]) == expected


def test_nbytes_is_exact_not_wrapping():
    big = 0xFFFFFFFF
    t = tensor(ne=(big, big, big, big), nb=(big, big, big, big))
    n = nbytes(t, TYPES[0])
    assert n == 4 + 4 * (big - 1) * big and n > 1 << 64


def test_accepts_null_buffer_tensor():
    assert check_tensor(tensor(buffer=0, data=0), state()) == 16


def test_accepts_tensor_at_buffer_end():
    assert check_tensor(tensor(data=BASE + SIZE - 16), state()) == 16


def test_accepts_empty_tensor_in_zero_size_buffer():
    st = state(base=0, size=0)
    assert check_tensor(tensor(data=0, ne=(0, 1, 1, 1)), st) == 0


@pytest.mark.parametrize("type_", [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000, 0xFFFFFFFF])
def test_refuses_invalid_type(type_):
    assert refused(tensor(type=type_)) == "tensor_type_invalid"


def test_refuses_type_beyond_the_versions_type_count():
    # Q2_0 (42) appeared with GGML_TYPE_COUNT 43 (4.0.2); a 3.6.1 server has 41 types.
    t = tensor(type=42, ne=(64, 1, 1, 1), nb=(18, 18, 18, 18))
    assert check_tensor(t, state()) == 18
    assert refused(t, state((3, 6, 1))) == "tensor_type_invalid"


def test_refuses_ne0_not_multiple_of_block():
    assert refused(tensor(type=2, ne=(33, 1, 1, 1), nb=(18, 36, 36, 36))) == "tensor_shape_invalid"


def test_refuses_element_count_beyond_int64():
    big = 0xFFFFFFFF
    t = tensor(ne=(big, big, big, 1), nb=(0, 0, 0, 0), buffer=0, data=0)
    assert refused(t) == "tensor_shape_invalid"


def test_element_count_rule_matches_ggml_new_tensor():
    # ggml skips ne[i] <= 1 in its int64 check: an empty tensor (ne1 = 0) can still abort the
    # server, while ne0 = 0 keeps the running product at 0 and always passes.
    big = 0xFFFFFFFF
    assert refused(tensor(ne=(big, 0, big, big), nb=(0, 0, 0, 0), buffer=0, data=0)) == "tensor_shape_invalid"
    assert check_tensor(tensor(ne=(0, big, big, big), nb=(0, 0, 0, 0), buffer=0, data=0), state()) == 0
    assert check_tensor(tensor(ne=(1 << 31, 1 << 31, 1, 1), nb=(0, 0, 0, 0), buffer=0, data=0), state()) == 4


def test_refuses_nbytes_overflow():
    big = 0xFFFFFFFF
    t = tensor(ne=(big, 1, 1, 1), nb=(big, big, big, big), buffer=0, data=0)
    assert refused(t) == "tensor_nbytes_overflow"


@pytest.mark.parametrize("flags", [0x20, 0x80000000, 0xFFFFFFFF])
def test_refuses_undefined_flags(flags):
    assert refused(tensor(flags=flags)) == "tensor_flags_invalid"


def test_accepts_defined_flags():
    assert check_tensor(tensor(flags=0x1F), state()) == 16


def test_refuses_name_without_nul():
    assert refused(tensor(name=b"n" * 64)) == "tensor_name_unterminated"
    assert check_tensor(tensor(name=b"n" * 63), state()) == 16


def test_refuses_data_without_buffer():
    assert refused(tensor(buffer=0, data=0x1234)) == "tensor_data_without_buffer"


def test_refuses_unknown_buffer():
    assert refused(tensor(buffer=HANDLE + 8)) == "buffer_unknown"


def test_foreign_buffer_tolerated_only_when_asked():
    t = tensor(buffer=HANDLE + 8, data=0x1234)
    assert check_tensor(t, state(), CHECK_TENSOR | CHECK_BUFFER | FOREIGN_BUFFER_OK) == 16


def test_refuses_when_base_unknown():
    with pytest.raises(FirewallRefusal) as exc:
        check_tensor(tensor(), state(base=None))
    assert exc.value.reason == "tensor_out_of_buffer" and "base" in exc.value.detail


@pytest.mark.parametrize("data", [BASE - 1, BASE + SIZE - 15, BASE + SIZE, 0, (1 << 64) - 1])
def test_refuses_data_outside_buffer(data):
    assert refused(tensor(data=data)) == "tensor_out_of_buffer"


def test_refuses_range_that_wraps():
    # 0xffff...0 + nbytes wraps in the server's uint64 arithmetic; here it cannot.
    assert refused(tensor(data=(1 << 64) - 8)) == "tensor_out_of_buffer"


def test_disabled_groups_skip_their_rules():
    st = state()
    assert check_tensor(tensor(flags=0x20), st, CHECK_BUFFER) == 16
    assert check_tensor(tensor(data=0), st, CHECK_TENSOR) == 16
    assert check_tensor(tensor(type=4), st, CHECK_BUFFER) == 0
