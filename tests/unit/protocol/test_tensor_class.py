"""The typed ``RpcTensor`` behaves exactly like the computed-field namedtuple it replaced.

The typed class (a ``typing.NamedTuple`` written out field by field, tensor.py) must be the same
value at run time as the old one (tests/support/tensorref.py): equal tuples and fields, equal
hashes and equality across the two classes (so dict/set keys built from either hit the same
entries), the same ``_make``/``_replace``/pickling, and the same firewall verdicts and caches
when every decode in the validators goes through one class or the other.
"""

from __future__ import annotations

import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import checks as checks_mod
from rpcguard.protocol import compiled
from rpcguard.protocol import firewall as firewall_mod
from rpcguard.protocol import graph as graph_mod
from rpcguard.protocol import tensor as tensor_mod
from rpcguard.protocol.encode import TensorSpec, pack_tensor
from rpcguard.protocol.tensor import RpcTensor, alloc_size_key, check_tensor, decode_tensor
from rpcguard.protocol.versions import COMMAND_IDS, TENSOR_BYTES, spec_for
from tests.support.corereplay import run_pytest_pure
from tests.support.tensorref import COMPUTED_FIELDS, ComputedRpcTensor, decode_computed
from tests.unit.protocol.test_tensor import BASE, HANDLE, SPEC_TENSOR, state

PROPS = ("ne", "nb", "op_params", "src")


def _same(new: RpcTensor, old: ComputedRpcTensor) -> None:
    assert type(new) is RpcTensor and type(old) is ComputedRpcTensor
    assert tuple(new) == tuple(old) and new == old and old == new
    assert hash(new) == hash(old) and len(new) == len(old) == 44
    for name in COMPUTED_FIELDS:
        assert getattr(new, name) == getattr(old, name), name
    for name in PROPS:
        assert getattr(new, name) == getattr(old, name), name
    assert new[:11] == old[:11] and new._asdict() == old._asdict()
    assert repr(new).split("(", 1)[1] == repr(old).split("(", 1)[1]


def test_class_shape_matches():
    assert RpcTensor._fields == tuple(COMPUTED_FIELDS)
    assert RpcTensor._field_defaults == ComputedRpcTensor._field_defaults == {}
    assert RpcTensor.__slots__ == () and not hasattr(decode_tensor(SPEC_TENSOR), "__dict__")
    assert RpcTensor.__match_args__ == ComputedRpcTensor.__match_args__
    assert RpcTensor.__mro__[1:] == (tuple, object)  # no base in between: hash/eq are tuple's
    for dunder in ("__hash__", "__eq__", "__lt__", "__getitem__", "__len__"):
        assert getattr(RpcTensor, dunder) is getattr(tuple, dunder) is getattr(ComputedRpcTensor, dunder)


def test_spec_vector_same_in_both():
    _same(decode_tensor(SPEC_TENSOR), decode_computed(SPEC_TENSOR))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(min_size=TENSOR_BYTES, max_size=TENSOR_BYTES * 3), at=st.integers(0, TENSOR_BYTES * 2))
def test_random_bytes_decode_to_equal_tuples(raw, at):
    if at + TENSOR_BYTES > len(raw):
        at = len(raw) - TENSOR_BYTES
    new, old = decode_tensor(memoryview(raw), at), decode_computed(memoryview(raw), at)
    _same(new, old)
    assert decode_tensor(raw, at) == new  # bytes and memoryview alike
    # _make / _replace / pickling round trips stay in each class and stay equal
    assert RpcTensor._make(old) == new and ComputedRpcTensor._make(new) == old
    bumped = new._replace(ne0=new.ne0 ^ 1, name=b"y" * 64)
    assert type(bumped) is RpcTensor and bumped == old._replace(ne0=old.ne0 ^ 1, name=b"y" * 64)
    back = pickle.loads(pickle.dumps(new))
    assert type(back) is RpcTensor and back == new


def test_cache_keys_interchangeable():
    """A dict keyed on tensors of one class answers for the other: same hash, same equality;
    distinct tensors stay distinct keys in both (no collision introduced)."""
    raws = [pack_tensor(TensorSpec(id=i, buffer=HANDLE, data=BASE, ne=(4, i + 1, 1, 1))) for i in range(64)]
    raws += [r[:8] + bytes([i]) + r[9:] for i, r in enumerate(raws[:8])]  # type ids differ only
    old_cache = {decode_computed(r): i for i, r in enumerate(raws)}
    new_cache = {decode_tensor(r): i for i, r in enumerate(raws)}
    assert len(old_cache) == len(new_cache) == len(set(raws))
    for r in raws:
        assert old_cache[decode_tensor(r)] == new_cache[decode_computed(r)] == new_cache[decode_tensor(r)]
    # the firewall's allocation-size key (tensor.alloc_size_key) is the same tuple from either
    for r in raws:
        assert alloc_size_key(0, decode_tensor(r)) == alloc_size_key(0, decode_computed(r))


def _verdicts(monkeypatch, decoder, frames):
    """Per-frame verdicts of one Firewall over ``frames`` with every decode done by ``decoder``."""
    calls = []

    def counted(buf, offset=0):
        t = decoder(buf, offset)
        calls.append(type(t))
        return t

    for mod in (tensor_mod, graph_mod, checks_mod):
        monkeypatch.setattr(mod, "decode_tensor", counted)
    st_ = state()
    fw = firewall_mod.Firewall(st_, firewall_mod.FirewallPolicy())
    out = []
    for rule, payload in frames:
        try:
            fw.check_request(rule, memoryview(payload), 0)
            out.append("ok")
        except FirewallRefusal as exc:
            out.append(exc.reason)
    caches = (dict(st_.tensor_cache), set(st_.node_cache), {k: set(v) for k, v in st_.layout_cache.items()},
              set(st_.head_cache))
    monkeypatch.undo()
    assert len(calls) > len(frames) and set(calls) == {type(decoder(SPEC_TENSOR))}  # every decode went through it
    return out, caches


def _graph(tensors: list[bytes], nodes: list[int]) -> bytes:
    return (struct.pack("<II", 0, len(nodes)) + b"".join(struct.pack("<Q", n) for n in nodes)
            + struct.pack("<I", len(tensors)) + b"".join(tensors))


def test_firewall_verdicts_and_caches_identical(monkeypatch):
    """Graphs, GET_TENSOR heads and bad tensors through one Firewall: the typed class and the
    computed class give the same verdict for every frame and leave the same cache contents."""
    if compiled():  # the decoder swap cannot reach compiled modules: this test on the pure core
        run_pytest_pure(f"{__file__}::test_firewall_verdicts_and_caches_identical")
        return
    spec = spec_for((7, 0, 0))
    graph_rule, get_rule = spec.rule(COMMAND_IDS["GRAPH_COMPUTE"]), spec.rule(COMMAND_IDS["GET_TENSOR"])
    assert graph_rule is not None and get_rule is not None
    a = pack_tensor(TensorSpec(id=1, buffer=HANDLE, data=BASE, ne=(8, 4, 1, 1), name=b"a"))
    b = pack_tensor(TensorSpec(id=2, buffer=HANDLE, data=BASE + 4096, ne=(8, 4, 1, 1), name=b"b"))
    add = pack_tensor(TensorSpec(id=3, buffer=HANDLE, data=BASE + 8192, ne=(8, 4, 1, 1), op=2, src=(1, 2),
                                 name=b"add"))
    bad = pack_tensor(TensorSpec(id=4, buffer=HANDLE, data=BASE + (1 << 40), ne=(8, 4, 1, 1)))
    frames = [
        (graph_rule, _graph([a, b, add], [3])),
        (graph_rule, _graph([a, b, add], [3])),  # all cached now
        (graph_rule, _graph([a, b, bad], [4])),
        (get_rule, a + struct.pack("<QQ", 0, 16)),
        (get_rule, a + struct.pack("<QQ", 0, 16)),
        (get_rule, bad + struct.pack("<QQ", 0, 16)),
    ]
    new = _verdicts(monkeypatch, decode_tensor, frames)
    old = _verdicts(monkeypatch, decode_computed, frames)
    assert new == old
    assert new[0][:2] == ["ok", "ok"] and "ok" not in new[0][2:3] and new[0][5] == "tensor_out_of_buffer"
    assert new[1][0] and new[1][3]  # the tensor and head caches were exercised


@pytest.mark.parametrize("reason, spec", [
    ("tensor_type_invalid", TensorSpec(type=99, buffer=HANDLE, data=BASE)),
    ("tensor_data_without_buffer", TensorSpec(buffer=0, data=BASE)),
])
def test_check_tensor_same_refusal(reason, spec):
    raw = pack_tensor(spec)
    for t in (decode_tensor(raw), decode_computed(raw)):
        with pytest.raises(FirewallRefusal) as exc:
            check_tensor(t, state())  # type: ignore[arg-type]
        assert exc.value.reason == reason
