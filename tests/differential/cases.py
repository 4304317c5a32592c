"""What a generator of the differential oracle returns, the recipe builder, and the registry.

How this works: each generator takes a ``random.Random`` and returns a ``Case``: a recipe for
tests/support/ggmlref.py whose LAST op call is the op under test, plus what the mutation engine
needs to know about that call: which integer arguments are stored verbatim in ``op_params``
(``params``: arg index -> op_params word, with values to try), which tensor arguments may be
NULL (``nullable``: src slot -> arg index), and for view-like ops how a different dst shape maps
back to arguments (``dst_args``). Shapes mix 1s, odd sizes and broadcasts; inputs are sometimes
non-contiguous (a transposed leaf, a row-subset view, a leaf with padded strides). The real
constructor decides what is valid: a generated recipe it refuses is only counted, never checked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from rpcguard.protocol.ggml import TYPES

__all__ = ["Case", "R", "GENERATORS", "QUANT", "FLOAT", "KEEP", "UNBUILDABLE", "BLCK", "TSIZE", "gen", "rand_ne",
           "rand_row", "bcast"]

# Ops whose 7.0.0 constructor refuses every input: ggml_flash_attn_back starts with
# GGML_ABORT("TODO: adapt to ggml_flash_attn_ext() changes") (ggml/src/ggml.c:5604). No real client
# can send such a node, so the generated inputs must all be refused (checked by the tests).
UNBUILDABLE = frozenset({"FLASH_ATTN_BACK"})

KEEP = "keep"  # in a dst_args result: leave that argument as it was

BLCK = {t.name: t.blck_size for t in TYPES.values()}
TSIZE = {t.name: t.type_size for t in TYPES.values()}
FLOAT = ("f32", "f16", "bf16")
QUANT = tuple(t.name for t in TYPES.values() if t.blck_size > 1)  # every block type of 7.0.0


@dataclass
class Case:
    op: str  # the GGML_OP name of the last call's result
    recipe: dict
    params: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # arg -> (word, values)
    # src slot -> arg index of the last call, or (call, arg) of an earlier one
    nullable: dict[int, int | tuple[int, int]] = field(default_factory=dict)
    # For ops whose dst shape/strides are arguments: the call that would give a dst of (ne, nb),
    # as the last op's new args or a whole {"fn", "args"} (another constructor of the same op).
    dst_args: Callable[[tuple, tuple], list[Any] | dict] | None = None
    offset_arg: int | None = None  # the view offset argument (op_params words 0-1, view_offs)
    type_arg: int | None = None  # the argument that is the dst type (im2col, cast)


class R:
    """Recipe builder: tensors are ("L", i) / ("O", j) tokens, resolved to indexes at the end."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.leaves: list[dict] = []
        self.ops: list[tuple[str, list[Any]]] = []

    def leaf(self, type_: str, ne: list[int], nb: list[int] | None = None, param: bool = False,
             room: int = 0) -> tuple:
        """A leaf tensor; ``room``: bytes of its buffer past it (ggmlref: a kernel may read them)."""
        d: dict[str, Any] = {"type": type_, "ne": (list(ne) + [1, 1, 1])[:4]}
        if nb:
            d["nb"] = nb
        if param:
            d["param"] = True
        if room:
            d["room"] = room
        self.leaves.append(d)
        return ("L", len(self.leaves) - 1)

    def op(self, fn: str, *args: Any) -> tuple:
        self.ops.append((fn, list(args)))
        return ("O", len(self.ops) - 1)

    def inp(self, type_: str, ne: list[int], noncontig: float = 0.25) -> tuple:
        """An input tensor of shape ``ne``: a leaf, or sometimes a non-contiguous tensor."""
        ne = (list(ne) + [1, 1, 1])[:4]
        rng = self.rng
        roll = rng.random()
        if roll >= noncontig:
            return self.leaf(type_, ne)
        kind = rng.choice(("transpose", "rows", "padded"))
        blk = BLCK[type_]
        if kind == "transpose" and blk == 1:
            lf = self.leaf(type_, [ne[1], ne[0], ne[2], ne[3]])
            return self.op("transpose", lf)
        if kind == "rows":
            extra = rng.choice((1, 2, 3))
            lf = self.leaf(type_, [ne[0], ne[1] + extra, ne[2], ne[3]])
            row = ne[0] // blk * TSIZE[type_]
            nb1, nb2 = row, row * (ne[1] + extra)
            return self.op("view_4d", lf, ne[0], ne[1], ne[2], ne[3], nb1, nb2, nb2 * ne[2], row * rng.randint(0, extra))
        row = ne[0] // blk * TSIZE[type_]
        nb1 = row + TSIZE[type_] * rng.choice((1, 4, 16))
        nb = [TSIZE[type_], nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]]
        return self.leaf(type_, ne, nb)

    def recipe(self, outputs: list[tuple] | None = None) -> dict:
        n = len(self.leaves)

        def res(a: Any) -> Any:
            if isinstance(a, tuple):
                return a[1] if a[0] == "L" else n + a[1]
            return a

        r = {"leaves": self.leaves, "ops": [{"fn": f, "args": [res(a) for a in args]} for f, args in self.ops]}
        if outputs:
            r["outputs"] = [res(o) for o in outputs]
        return r


def rand_ne(rng: random.Random, dims: int = 4, big: int = 9) -> list[int]:
    out = [rng.choice((1, 1, 2, 3, 4, 5, 7, 8, big)) for _ in range(dims)]
    return out + [1] * (4 - dims)


def rand_row(rng: random.Random, type_: str) -> int:
    b = BLCK[type_]
    return b * rng.choice((1, 2, 3)) if b > 1 else rng.choice((1, 2, 3, 5, 8, 16, 31, 64))


def bcast(rng: random.Random, ne: list[int]) -> list[int]:
    return [n if rng.random() < 0.6 else rng.choice([d for d in range(1, n + 1) if n % d == 0]) for n in ne]


Gen = Callable[[random.Random], Case]
GENERATORS: dict[str, tuple[str, Gen]] = {}  # generator name -> (GGML op, generator)


def gen(name: str, op: str) -> Callable[[Gen], Gen]:
    def deco(f: Gen) -> Gen:
        GENERATORS[name] = (op, f)
        return f

    return deco
