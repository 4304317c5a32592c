"""The pre-typing ``RpcTensor`` (a namedtuple built from a computed field list) as a reference.

How this works: until issue 10 ``rpcguard.protocol.tensor.RpcTensor`` was a subclass of
``collections.namedtuple("_Base", FIELDS)`` with ``FIELDS`` computed from ranges, which mypy
cannot see through. It is now a ``typing.NamedTuple`` written out field by field.
``ComputedRpcTensor`` / ``decode_computed`` rebuild the old class exactly (bdc25d6:
rpcguard/protocol/tensor.py) so that tests can prove the two decode to equal tuples and behave
the same as dict/set keys, and so that the hot-path cost can be measured in one process:

    python -m tests.support.tensorref        # decode_tensor, old vs new class, ns per call
"""

from __future__ import annotations

import sys
import time
import timeit
from collections import namedtuple

from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.tensor import RpcTensor, decode_tensor

__all__ = ["COMPUTED_FIELDS", "ComputedRpcTensor", "decode_computed", "bench"]

COMPUTED_FIELDS = (
    ["id", "type", "buffer", "ne0", "ne1", "ne2", "ne3", "nb0", "nb1", "nb2", "nb3", "op"]
    + [f"param{i}" for i in range(16)]
    + ["flags"]
    + [f"src{i}" for i in range(10)]
    + ["view_src", "view_offs", "data", "name", "use_count"]
)
_Base = namedtuple("_Base", COMPUTED_FIELDS)  # type: ignore[misc]  # the computed list is the point


class ComputedRpcTensor(_Base):  # type: ignore[misc, valid-type]
    """The old class, verbatim: the computed namedtuple plus the four slice properties."""

    __slots__ = ()

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return self[3:7]  # type: ignore[no-any-return]

    @property
    def nb(self) -> tuple[int, int, int, int]:
        return self[7:11]  # type: ignore[no-any-return]

    @property
    def op_params(self) -> tuple[int, ...]:
        return self[12:28]  # type: ignore[no-any-return]

    @property
    def src(self) -> tuple[int, ...]:
        return self[29:39]  # type: ignore[no-any-return]


_make_computed = ComputedRpcTensor._make
_unpack_from = TENSOR_STRUCT.unpack_from


def decode_computed(buf: memoryview | bytes, offset: int = 0) -> ComputedRpcTensor:
    """The old ``decode_tensor``: same struct, old class."""
    return _make_computed(_unpack_from(buf, offset))  # type: ignore[no-any-return]


def bench(number: int = 200_000, repeat: int = 7) -> dict[str, float]:
    """Best-of-``repeat`` ns per call of each decoder (and of a hot-path field read after it),
    old and new interleaved in one process so that machine load hits both alike; timed in this
    thread's CPU time (``time.thread_time``), so preemption by other processes is not counted."""
    raw = bytes(range(256)) + bytes(40)
    view = memoryview(raw * 4)
    cases = {
        "decode computed (old)": lambda: decode_computed(view, 296),
        "decode typed (new)": lambda: decode_tensor(view, 296),
        "decode+fields computed (old)": lambda: _fields(decode_computed(view, 296)),
        "decode+fields typed (new)": lambda: _fields(decode_tensor(view, 296)),
    }
    best = {k: float("inf") for k in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            timer = timeit.Timer(fn, timer=time.thread_time)
            best[name] = min(best[name], timer.timeit(number=number) / number * 1e9)
    return best


def _fields(t: RpcTensor | ComputedRpcTensor) -> object:
    # what check_tensor reads of every tensor (tensor.py): the first 11 fields, flags, name, data
    return (t[:11], t.flags, t.name, t.data, t.ne, t.src)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    for name, ns in bench(n).items():
        print(f"{name:32s} {ns:7.1f} ns/call")
