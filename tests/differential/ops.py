"""Seeded generators of valid-looking inputs for every ggml op the harness can build.

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

__all__ = ["Case", "R", "GENERATORS", "QUANT", "FLOAT", "KEEP", "UNBUILDABLE"]

# Ops whose 7.0.0 constructor refuses every input: ggml_flash_attn_back starts with
# GGML_ABORT("TODO: adapt to ggml_flash_attn_ext() changes") (ggml/src/ggml.c:5604). No real client
# can send such a node, so the generated inputs must all be refused (checked by the tests).
UNBUILDABLE = frozenset({"FLASH_ATTN_BACK"})

KEEP = "keep"  # in a dst_args result: leave that argument as it was

BLCK = {t.name: t.blck_size for t in TYPES.values()}
TSIZE = {t.name: t.type_size for t in TYPES.values()}
FLOAT = ("f32", "f16", "bf16")
QUANT = ("q8_0", "q4_0", "q4_1", "q5_0", "q4_K", "q6_K", "iq4_nl", "mxfp4")


@dataclass
class Case:
    op: str  # the GGML_OP name of the last call's result
    recipe: dict
    params: dict[int, tuple[int, list[int]]] = field(default_factory=dict)  # arg -> (word, values)
    nullable: dict[int, int] = field(default_factory=dict)  # src slot -> arg index
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

    def leaf(self, type_: str, ne: list[int], nb: list[int] | None = None, param: bool = False) -> tuple:
        d: dict[str, Any] = {"type": type_, "ne": (list(ne) + [1, 1, 1])[:4]}
        if nb:
            d["nb"] = nb
        if param:
            d["param"] = True
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


def _ne(rng: random.Random, dims: int = 4, big: int = 9) -> list[int]:
    out = [rng.choice((1, 1, 2, 3, 4, 5, 7, 8, big)) for _ in range(dims)]
    return out + [1] * (4 - dims)


def _row(rng: random.Random, type_: str) -> int:
    b = BLCK[type_]
    return b * rng.choice((1, 2, 3)) if b > 1 else rng.choice((1, 2, 3, 5, 8, 16, 31, 64))


def _bcast(rng: random.Random, ne: list[int]) -> list[int]:
    return [n if rng.random() < 0.6 else rng.choice([d for d in range(1, n + 1) if n % d == 0]) for n in ne]


Gen = Callable[[random.Random], Case]
GENERATORS: dict[str, tuple[str, Gen]] = {}  # generator name -> (GGML op, generator)


def gen(name: str, op: str) -> Callable[[Gen], Gen]:
    def deco(f: Gen) -> Gen:
        GENERATORS[name] = (op, f)
        return f

    return deco


# -- element-wise binary ----------------------------------------------------------------------


def _binary(fn: str, op: str) -> None:
    @gen(fn, op)
    def g(rng: random.Random) -> Case:
        r = R(rng)
        ta = rng.choice(("f32", "f32", "f16", "bf16"))
        ne = _ne(rng)
        ne[0] = _row(rng, "f32")
        a = r.inp(ta, ne)
        b = r.inp(rng.choice(("f32", ta)), _bcast(rng, ne))
        r.op(fn, a, b)
        return Case(op, r.recipe())


for _fn, _op in (("add", "ADD"), ("sub", "SUB"), ("mul", "MUL"), ("div", "DIV"),
                 ("add_inplace", "ADD"), ("mul_inplace", "MUL")):  # fmt: skip
    _binary(_fn, _op)


@gen("add1", "ADD1")
def _add1(rng: random.Random) -> Case:
    r = R(rng)
    a = r.inp("f32", _ne(rng))
    r.op("add1", a, r.leaf("f32", [1]))
    return Case("ADD1", r.recipe())


@gen("add_id", "ADD_ID")
def _add_id(rng: random.Random) -> Case:
    r = R(rng)
    ne0, n_used, n_tok, n_exp = _row(rng, "f32"), rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 8)
    a = r.inp("f32", [ne0, n_used, n_tok])
    r.op("add_id", a, r.leaf("f32", [ne0, n_exp]), r.leaf("i32", [n_used, n_tok]))
    return Case("ADD_ID", r.recipe())


def _acc_set(fn: str, op: str) -> None:
    @gen(fn, op)
    def g(rng: random.Random) -> Case:
        r = R(rng)
        ne = _ne(rng, 3)
        ne[0] = rng.randint(2, 12)
        a = r.leaf("f32", ne)
        bne = [rng.randint(1, n) for n in ne]
        b = r.leaf("f32", bne)
        nb1, nb2 = 4 * ne[0], 4 * ne[0] * ne[1]
        off = 4 * rng.randint(0, ne[0] - bne[0])
        r.op(fn, a, b, nb1, nb2, nb2 * ne[2], off)
        vals = [0, 4, nb1 + 4, 1 << 20]
        return Case(op, r.recipe(), params={2: (0, vals), 3: (1, vals), 5: (3, [0, 4, 4 * ne[0], 1 << 20])})


_acc_set("acc", "ACC")
_acc_set("set", "SET")


# -- element-wise unary -----------------------------------------------------------------------


def _plain_unary(fn: str, op: str, types: tuple[str, ...] = ("f32", "f16"), *extra: Any) -> None:
    @gen(fn, op)
    def g(rng: random.Random) -> Case:
        r = R(rng)
        t = rng.choice(types)
        ne = _ne(rng)
        a = r.inp(t, ne, 0.3)
        r.op(fn, a, *extra)
        return Case(op, r.recipe())


for _fn, _op in (("sqr", "SQR"), ("sqrt", "SQRT"), ("log", "LOG"), ("sin", "SIN"), ("cos", "COS"),
                 ("sum", "SUM"), ("sum_rows", "SUM_ROWS"), ("mean", "MEAN"), ("cont", "CONT"), ("dup", "DUP"),
                 ("transpose", "TRANSPOSE"), ("soft_max", "SOFT_MAX"),
                 ("abs", "UNARY"), ("sgn", "UNARY"), ("neg", "UNARY"), ("step", "UNARY"), ("tanh", "UNARY"),
                 ("elu", "UNARY"), ("relu", "UNARY"), ("sigmoid", "UNARY"), ("gelu", "UNARY"),
                 ("gelu_quick", "UNARY"), ("silu", "UNARY"), ("hardswish", "UNARY"), ("hardsigmoid", "UNARY"),
                 ("exp", "UNARY"), ("expm1", "UNARY"), ("softplus", "UNARY"), ("gelu_erf", "UNARY"),
                 ("floor", "UNARY"), ("ceil", "UNARY"), ("round", "UNARY"), ("trunc", "UNARY"),
                 ("silu_inplace", "UNARY")):  # fmt: skip
    _plain_unary(_fn, _op)
_plain_unary("cumsum", "CUMSUM", ("f32",))
_plain_unary("rms_norm", "RMS_NORM", ("f32",), 1e-6)
_plain_unary("norm", "NORM", ("f32",), 1e-5)
_plain_unary("l2_norm", "L2_NORM", ("f32",), 1e-6)
_plain_unary("scale", "SCALE", ("f32",), 0.125)
_plain_unary("scale_bias", "SCALE", ("f32",), 0.5, 1.0)
_plain_unary("clamp", "CLAMP", ("f32",), -1.0, 1.0)
_plain_unary("leaky_relu", "LEAKY_RELU", ("f32",), 0.1, False)
_plain_unary("xielu", "UNARY", ("f32",), 0.8, 0.8, 0.5, 1e-6)
_plain_unary("fill", "FILL", ("f32", "f16"), 2.0)


@gen("unary", "UNARY")
def _unary(rng: random.Random) -> Case:
    r = R(rng)
    a = r.inp(rng.choice(("f32", "f16")), _ne(rng), 0.3)
    r.op("unary", a, rng.randrange(0, 22))
    return Case("UNARY", r.recipe(), params={1: (0, [0, 10, 21])})


@gen("argmax", "ARGMAX")
def _argmax(rng: random.Random) -> Case:
    r = R(rng)
    r.op("argmax", r.inp("f32", _ne(rng, 2), 0.2))
    return Case("ARGMAX", r.recipe())


@gen("diag", "DIAG")
def _diag(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    ne[1] = 1
    r.op("diag", r.leaf("f32", ne))
    return Case("DIAG", r.recipe())


@gen("count_equal", "COUNT_EQUAL")
def _count_equal(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("count_equal", r.leaf("i32", ne), r.leaf("i32", ne))
    return Case("COUNT_EQUAL", r.recipe())


@gen("silu_back", "SILU_BACK")
def _silu_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("silu_back", r.inp("f32", ne), r.inp("f32", ne))
    return Case("SILU_BACK", r.recipe())


@gen("rms_norm_back", "RMS_NORM_BACK")
def _rms_norm_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("rms_norm_back", r.leaf("f32", ne), r.leaf("f32", ne), 1e-6)
    return Case("RMS_NORM_BACK", r.recipe())


@gen("group_norm", "GROUP_NORM")
def _group_norm(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("group_norm", r.leaf("f32", ne), rng.randint(1, 4), 1e-6)
    return Case("GROUP_NORM", r.recipe(), params={1: (0, [1, 2, 32])})


# -- shapes: repeat, concat, views ------------------------------------------------------------


@gen("repeat", "REPEAT")
def _repeat(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    a = r.inp("f32", _bcast(rng, ne))
    r.op("repeat", a, r.leaf(rng.choice(("f32", "f16")), ne))
    return Case("REPEAT", r.recipe())


@gen("repeat_4d", "REPEAT")
def _repeat_4d(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    small = _bcast(rng, ne)
    r.op("repeat_4d", r.inp("f32", small), *ne)
    return Case("REPEAT", r.recipe(), dst_args=lambda ne_, nb_: [KEEP, *ne_])


@gen("repeat_back", "REPEAT_BACK")
def _repeat_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("repeat_back", r.leaf("f32", ne), r.leaf("f32", _bcast(rng, ne)))
    return Case("REPEAT_BACK", r.recipe())


@gen("concat", "CONCAT")
def _concat(rng: random.Random) -> Case:
    r = R(rng)
    t = rng.choice(("f32", "f16", "i32"))
    dim = rng.randrange(4)
    ne = _ne(rng)
    ne2 = list(ne)
    ne2[dim] = rng.randint(1, 6)
    r.op("concat", r.inp(t, ne), r.inp(t, ne2), dim)
    return Case("CONCAT", r.recipe(), params={2: (0, [0, 1, 2, 3])})


@gen("reshape", "RESHAPE")
def _reshape(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    n = ne[0] * ne[1] * ne[2] * ne[3]
    k = rng.choice([d for d in range(1, n + 1) if n % d == 0])
    dims = rng.choice((1, 2, 3, 4))
    t = rng.choice(("f32", "f16"))
    a = r.leaf(t, ne)
    shape = {1: [n], 2: [k, n // k], 3: [k, n // k, 1], 4: [1, k, 1, n // k]}[dims]
    r.op(f"reshape_{dims}d", a, *shape)

    def dst_args(ne_: tuple, nb_: tuple) -> list[Any]:
        return [KEEP, *ne_[:dims]]

    return Case("RESHAPE", r.recipe(), dst_args=dst_args)


@gen("reshape_like", "RESHAPE")
def _reshape_like(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    a = r.leaf("f32", ne)
    b = r.leaf("f16", [ne[0] * ne[1], ne[2], ne[3]])
    r.op("reshape", a, b)
    return Case("RESHAPE", r.recipe(), dst_args=lambda ne_, nb_: {"fn": "reshape_4d", "args": [KEEP, *ne_]})


@gen("view", "VIEW")
def _view(rng: random.Random) -> Case:
    r = R(rng)
    t = rng.choice(("f32", "f16", "q8_0", "q4_0", "q4_K", "i32"))
    ne = _ne(rng, 4)
    ne[0] = _row(rng, t)
    a = r.inp(t, ne, 0.15)
    row = ne[0] // BLCK[t] * TSIZE[t]
    dims = rng.choice((1, 2, 3, 4))
    v = [rng.randint(1, n) for n in ne]
    if BLCK[t] > 1:
        v[0] = ne[0] if rng.random() < 0.5 else BLCK[t]
    nb1, nb2, nb3 = row, row * ne[1], row * ne[1] * ne[2]
    off = rng.choice((0, row, row * (ne[1] - v[1]))) if rng.random() < 0.7 else 0
    if dims == 1:
        n = v[0]
        r.op("view_1d", a, n, off)
        args = lambda ne_, nb_: [KEEP, ne_[0], off]  # noqa: E731
        oa = 2
    elif dims == 2:
        r.op("view_2d", a, v[0], v[1], nb1, off)
        args = lambda ne_, nb_: [KEEP, ne_[0], ne_[1], nb_[1], off]  # noqa: E731
        oa = 4
    elif dims == 3:
        r.op("view_3d", a, v[0], v[1], v[2], nb1, nb2, off)
        args = lambda ne_, nb_: [KEEP, ne_[0], ne_[1], ne_[2], nb_[1], nb_[2], off]  # noqa: E731
        oa = 6
    else:
        r.op("view_4d", a, v[0], v[1], v[2], v[3], nb1, nb2, nb3, off)
        args = lambda ne_, nb_: [KEEP, *ne_, nb_[1], nb_[2], nb_[3], off]  # noqa: E731
        oa = 8
    return Case("VIEW", r.recipe(), dst_args=args, offset_arg=oa)


@gen("permute", "PERMUTE")
def _permute(rng: random.Random) -> Case:
    r = R(rng)
    ax = [0, 1, 2, 3]
    rng.shuffle(ax)
    a = r.inp(rng.choice(("f32", "f16")), _ne(rng), 0.2)
    r.op("permute", a, *ax)
    return Case("PERMUTE", r.recipe(), params={1: (0, [0, 1, 2, 3]), 2: (1, [0, 1, 2, 3]),
                                                3: (2, [0, 1, 2, 3]), 4: (3, [0, 1, 2, 3])})


@gen("cont_nd", "CONT")
def _cont_nd(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    n = ne[0] * ne[1] * ne[2] * ne[3]
    a = r.inp("f32", ne, 0.5)
    k = rng.choice([d for d in range(1, n + 1) if n % d == 0])
    r.op("cont_2d", a, k, n // k)
    return Case("CONT", r.recipe(), dst_args=lambda ne_, nb_: {"fn": "cont_4d", "args": [KEEP, *ne_]})


@gen("cpy", "CPY")
def _cpy(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(("f32", "f16"))
    tb = rng.choice(("f32", "f16", "bf16", "q8_0", "q4_0"))
    ne = _ne(rng)
    ne[0] = BLCK[tb] * rng.randint(1, 2) if BLCK[tb] > 1 else _row(rng, "f32")
    a = r.inp(ta, ne, 0.3)
    shape = list(ne) if rng.random() < 0.7 else [ne[0] * ne[1], ne[2], ne[3], 1]
    r.op("cpy", a, r.leaf(tb, shape))
    return Case("CPY", r.recipe())


@gen("cast", "CPY")
def _cast(rng: random.Random) -> Case:
    r = R(rng)
    r.op("cast", r.inp("f32", _ne(rng)), rng.choice((0, 1, 30)))
    return Case("CPY", r.recipe(), type_arg=1)


# -- matrix products --------------------------------------------------------------------------


@gen("mul_mat", "MUL_MAT")
def _mul_mat(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT)
    k = _row(rng, ta)
    m = rng.choice((1, 2, 3, 7, 8, 16))
    n = rng.choice((1, 1, 2, 5, 8, 32))
    a2, a3 = rng.choice((1, 2)), rng.choice((1, 2))
    b2, b3 = a2 * rng.choice((1, 2, 3)), a3 * rng.choice((1, 2))
    a = r.inp(ta, [k, m, a2, a3], 0.15 if BLCK[ta] == 1 else 0.0)
    b = r.inp(rng.choice(("f32", "f32", "f16")), [k, n, b2, b3], 0.3)
    r.op("mul_mat", a, b)
    return Case("MUL_MAT", r.recipe())


@gen("mul_mat_id", "MUL_MAT_ID")
def _mul_mat_id(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT)
    k, m, n_as = _row(rng, ta), rng.choice((1, 4, 8)), rng.randint(1, 8)
    n_used, n_tok = rng.randint(1, n_as), rng.randint(1, 6)
    as_ = r.leaf(ta, [k, m, n_as])
    b = r.inp("f32", [k, rng.choice((1, n_used)), n_tok], 0.2)
    ids = r.leaf("i32", [n_used, n_tok])
    r.op("mul_mat_id", as_, b, ids)
    return Case("MUL_MAT_ID", r.recipe())


@gen("out_prod", "OUT_PROD")
def _out_prod(rng: random.Random) -> Case:
    r = R(rng)
    k = rng.randint(1, 6)
    a = r.leaf(rng.choice(("f32", "f16", "q8_0")), [32, k, 2, 1])
    r.op("out_prod", a, r.leaf("f32", [rng.randint(1, 7), k, 2 * rng.randint(1, 2), 1]))
    return Case("OUT_PROD", r.recipe())


# -- rows -------------------------------------------------------------------------------------


@gen("get_rows", "GET_ROWS")
def _get_rows(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT + ("i32",))
    ne0 = _row(rng, ta)
    n_rows, b1, b2 = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 2)
    a = r.leaf(ta, [ne0, n_rows, b1, b2])
    r.op("get_rows", a, r.leaf("i32", [rng.randint(1, 7), b1, b2]))
    return Case("GET_ROWS", r.recipe())


@gen("get_rows_back", "GET_ROWS_BACK")
def _get_rows_back(rng: random.Random) -> Case:
    r = R(rng)
    ne0, n = rng.randint(1, 9), rng.randint(1, 5)
    r.op("get_rows_back", r.leaf("f32", [ne0, n]), r.leaf("i32", [n]), r.leaf("f32", [ne0, rng.randint(1, 9)]))
    return Case("GET_ROWS_BACK", r.recipe())


@gen("set_rows", "SET_ROWS")
def _set_rows(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(("f32", "f16", "bf16", "q8_0", "q4_0"))
    ne0 = _row(rng, ta) if BLCK[ta] == 1 else BLCK[ta] * rng.randint(1, 3)
    n_rows, n2, n3 = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 2)
    a = r.leaf(ta, [ne0, rng.randint(n_rows, n_rows + 5), n2, n3])
    k = rng.randint(1, n_rows)
    b = r.inp(rng.choice(("f32", "f16")), [ne0, k, n2, n3], 0.2)
    c = r.leaf(rng.choice(("i64", "i32")), [k, rng.choice([d for d in (1, n2) if n2 % d == 0]), 1])
    r.op("set_rows", a, b, c)
    return Case("SET_ROWS", r.recipe())


@gen("diag_mask_inf", "DIAG_MASK_INF")
def _dmi(rng: random.Random) -> Case:
    r = R(rng)
    r.op("diag_mask_inf", r.leaf("f32", _ne(rng)), rng.randint(0, 5))
    return Case("DIAG_MASK_INF", r.recipe(), params={1: (0, [0, 3, 100])})


@gen("diag_mask_zero", "DIAG_MASK_ZERO")
def _dmz(rng: random.Random) -> Case:
    r = R(rng)
    r.op("diag_mask_zero", r.leaf("f32", _ne(rng)), rng.randint(0, 5))
    return Case("DIAG_MASK_ZERO", r.recipe(), params={1: (0, [0, 3, 100])})


# -- attention --------------------------------------------------------------------------------


@gen("soft_max_ext", "SOFT_MAX")
def _soft_max_ext(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    ne[0] = rng.choice((1, 3, 8, 32, 33))
    a = r.inp("f32", ne, 0.2)
    mask = None
    if rng.random() < 0.7:
        m2 = rng.choice([d for d in range(1, ne[2] + 1) if ne[2] % d == 0])
        mask = r.leaf(rng.choice(("f32", "f16")), [ne[0], ne[1] + rng.choice((0, 0, 3)), m2, 1])
    r.op("soft_max_ext", a, mask, 0.125, rng.choice((0.0, 8.0)))
    return Case("SOFT_MAX", r.recipe(), nullable={1: 1})


@gen("soft_max_ext_back", "SOFT_MAX_BACK")
def _soft_max_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("soft_max_ext_back", r.leaf("f32", ne), r.leaf("f32", ne), 1.0, 0.0)
    return Case("SOFT_MAX_BACK", r.recipe())


def _rope_case(rng: random.Random, back: bool = False) -> Case:
    r = R(rng)
    head = rng.choice((2, 4, 8, 64, 128))
    n_head, n_tok = rng.choice((1, 2, 3, 8)), rng.choice((1, 2, 5, 7))
    a = r.inp(rng.choice(("f32", "f16")) if not back else "f32", [head, n_head, n_tok, 1], 0.2)
    pos = r.leaf("i32", [n_tok])
    n_dims = rng.choice([d for d in (2, 4, head // 2, head) if d <= head and d % 2 == 0])
    mode = rng.choice((0, 2))
    ff = r.leaf("f32", [n_dims // 2]) if rng.random() < 0.3 else None
    r.op("rope_ext_back" if back else "rope_ext", a, pos, ff, n_dims, mode, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    return Case("ROPE_BACK" if back else "ROPE", r.recipe(), nullable={2: 2},
                params={3: (1, [2, head, head + 2, 0]), 4: (2, [0, 2, 8, 24, 40]), 5: (4, [0, 1 << 20])})


gen("rope_ext", "ROPE")(lambda rng: _rope_case(rng))
gen("rope_ext_back", "ROPE_BACK")(lambda rng: _rope_case(rng, True))


@gen("rope_multi", "ROPE")
def _rope_multi(rng: random.Random) -> Case:
    r = R(rng)
    head, n_head, n_tok = 16, rng.choice((1, 2)), rng.choice((1, 3))
    a = r.leaf("f32", [head, n_head, n_tok])
    pos = r.leaf("i32", [4 * n_tok])
    r.op("rope_multi", a, pos, None, 8, [2, 1, 1, 0], 8, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    return Case("ROPE", r.recipe(), nullable={2: 2})


@gen("flash_attn_ext", "FLASH_ATTN_EXT")
def _fa(rng: random.Random) -> Case:
    r = R(rng)
    d, dv = rng.choice((32, 64, 128)), None
    dv = d if rng.random() < 0.8 else rng.choice((32, 64))
    n_q, n_kv = rng.choice((1, 2, 7)), rng.choice((16, 32, 256))
    h_kv = rng.choice((1, 2))
    h = h_kv * rng.choice((1, 2, 4))
    kt = rng.choice(("f16", "f16", "f32", "q8_0"))
    q = r.inp("f32", [d, n_q, h, 1], 0.3)
    k = r.inp(kt, [d, n_kv, h_kv, 1], 0.3)
    v = r.inp(kt, [dv, n_kv, h_kv, 1], 0.3)
    mask = r.leaf("f16", [n_kv, n_q + rng.choice((0, 1)), 1, 1]) if rng.random() < 0.8 else None
    r.op("flash_attn_ext", q, k, v, mask, 0.125, 0.0, rng.choice((0.0, 30.0)))
    return Case("FLASH_ATTN_EXT", r.recipe(), nullable={3: 3})


# -- glu --------------------------------------------------------------------------------------


@gen("glu", "GLU")
def _glu(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    ne[0] = 2 * rng.randint(1, 16)
    r.op("glu", r.inp(rng.choice(("f32", "f16")), ne, 0.2), rng.randrange(0, 6), rng.random() < 0.5)
    return Case("GLU", r.recipe(), params={1: (0, [0, 2, 5]), 2: (1, [0, 1])})


@gen("swiglu_split", "GLU")
def _glu_split(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    fn = rng.choice(("swiglu_split", "geglu_split", "reglu_split"))
    r.op(fn, r.inp("f32", ne, 0.2), r.inp("f32", ne, 0.2))
    return Case("GLU", r.recipe())


@gen("swiglu_oai", "GLU")
def _swiglu_oai(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("swiglu_oai", r.leaf("f32", ne), r.leaf("f32", ne), 1.702, 7.0)
    return Case("GLU", r.recipe())


# -- sort, pad, misc --------------------------------------------------------------------------


@gen("argsort", "ARGSORT")
def _argsort(rng: random.Random) -> Case:
    r = R(rng)
    r.op("argsort", r.inp("f32", _ne(rng), 0.2), rng.randrange(2))
    return Case("ARGSORT", r.recipe(), params={1: (0, [0, 1])})


@gen("top_k", "TOP_K")
def _top_k(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    ne[0] = rng.randint(1, 40)
    r.op("top_k", r.inp("f32", ne, 0.2), rng.randint(1, ne[0]))
    return Case("TOP_K", r.recipe(), dst_args=lambda ne_, nb_: [KEEP, ne_[0]])


@gen("pad", "PAD")
def _pad(rng: random.Random) -> Case:
    r = R(rng)
    p = [rng.choice((0, 0, 1, 3)) for _ in range(4)]
    r.op("pad", r.inp("f32", _ne(rng), 0.2), *p)
    return Case("PAD", r.recipe(), params={1: (1, [0, 5]), 2: (3, [0, 5])})


@gen("pad_ext", "PAD")
def _pad_ext(rng: random.Random) -> Case:
    r = R(rng)
    p = [rng.choice((0, 0, 1, 2)) for _ in range(8)]
    r.op("pad_ext", r.leaf("f32", _ne(rng)), *p)
    return Case("PAD", r.recipe(), params={1: (0, [0, 4]), 2: (1, [0, 4]), 8: (7, [0, 4])})


@gen("pad_reflect_1d", "PAD_REFLECT_1D")
def _pad_reflect(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    ne[0] = rng.randint(2, 9)
    r.op("pad_reflect_1d", r.leaf("f32", ne), rng.randint(0, ne[0] - 1), rng.randint(0, ne[0] - 1))
    return Case("PAD_REFLECT_1D", r.recipe(), params={1: (0, [0, 1, 8, -1]), 2: (1, [0, 2, 9, -1])})


@gen("roll", "ROLL")
def _roll(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("roll", r.leaf("f32", ne), *[rng.randint(-n + 1, n - 1) for n in ne])
    return Case("ROLL", r.recipe(), params={1: (0, [0, 1, 100, -100])})


@gen("arange", "ARANGE")
def _arange(rng: random.Random) -> Case:
    r = R(rng)
    start = float(rng.randint(-5, 5))
    r.op("arange", start, start + rng.randint(1, 20), float(rng.choice((1, 2, 3))))
    return Case("ARANGE", r.recipe())


@gen("timestep_embedding", "TIMESTEP_EMBEDDING")
def _tsemb(rng: random.Random) -> Case:
    r = R(rng)
    r.op("timestep_embedding", r.leaf("f32", [rng.randint(1, 6)]), rng.choice((4, 7, 16, 32)), 10000)
    return Case("TIMESTEP_EMBEDDING", r.recipe(), params={1: (0, [2, 8, 64, 1 << 16])})


@gen("tri", "TRI")
def _tri(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 8)
    r.op("tri", r.leaf("f32", [n, n, rng.randint(1, 3)]), rng.randrange(4))
    return Case("TRI", r.recipe(), params={1: (0, [0, 3])})


@gen("upscale", "UPSCALE")
def _upscale(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("interpolate", r.leaf("f32", ne), *[n * rng.choice((1, 2, 3)) for n in ne], rng.choice((0, 1)))
    return Case("UPSCALE", r.recipe(), params={5: (0, [0, 1, 2])}, dst_args=lambda ne_, nb_: [KEEP, *ne_, KEEP])


@gen("concat_i32", "CONCAT")
def _concat_q(rng: random.Random) -> Case:
    return _concat(rng)


# -- convolution and pooling ------------------------------------------------------------------


@gen("im2col", "IM2COL")
def _im2col(rng: random.Random) -> Case:
    r = R(rng)
    two_d = rng.random() < 0.6
    kw, kh, ic = rng.choice((1, 3, 5)), rng.choice((1, 3)), rng.randint(1, 3)
    iw, ih, n = rng.randint(kw, 12), rng.randint(kh, 9), rng.randint(1, 2)
    s0, s1, p0, p1, d0, d1 = rng.randint(1, 2), rng.randint(1, 2), rng.randint(0, 1), rng.randint(0, 1), 1, 1
    if two_d:
        a = r.leaf("f16", [kw, kh, ic, 4])
        b = r.leaf("f32", [iw, ih, ic, n])
    else:
        a = r.leaf("f16", [kw, ic, 4])
        b = r.leaf("f32", [iw, ic, n])
    r.op("im2col", a, b, s0, s1, p0, p1, d0, d1, two_d, rng.choice((0, 1)))
    return Case("IM2COL", r.recipe(), params={2: (0, [1, 2, 7]), 4: (2, [0, 1, 4]), 6: (4, [1, 2, 3])}, type_arg=9)


@gen("conv_transpose_1d", "CONV_TRANSPOSE_1D")
def _convt1d(rng: random.Random) -> Case:
    r = R(rng)
    k, oc, ic = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
    r.op("conv_transpose_1d", r.leaf("f32", [k, oc, ic]), r.leaf("f32", [rng.randint(1, 9), ic]), rng.randint(1, 3), 0, 1)
    return Case("CONV_TRANSPOSE_1D", r.recipe(), params={2: (0, [1, 2, 5])})


@gen("conv_transpose_2d", "CONV_TRANSPOSE_2D")
def _convt2d(rng: random.Random) -> Case:
    r = R(rng)
    ic = rng.randint(1, 3)
    a = r.leaf("f16", [rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3), ic])
    b = r.leaf("f32", [rng.randint(1, 6), rng.randint(1, 6), ic, 1])
    r.op("conv_transpose_2d_p0", a, b, rng.randint(1, 3))
    return Case("CONV_TRANSPOSE_2D", r.recipe(), params={2: (0, [1, 2, 5])})


@gen("conv_2d_direct", "CONV_2D")
def _conv2d(rng: random.Random) -> Case:
    r = R(rng)
    ic = rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(1, 3), rng.randint(1, 3), ic, rng.randint(1, 4)])
    b = r.leaf("f32", [rng.randint(3, 9), rng.randint(3, 9), ic, rng.randint(1, 2)])
    r.op("conv_2d_direct", a, b, 1, 1, rng.randint(0, 1), rng.randint(0, 1), 1, 1)
    return Case("CONV_2D", r.recipe(), params={2: (0, [1, 2, 3]), 4: (2, [0, 2]), 6: (4, [1, 2])})


@gen("conv_2d_dw_direct", "CONV_2D_DW")
def _conv2d_dw(rng: random.Random) -> Case:
    r = R(rng)
    c = rng.randint(1, 4)
    a = r.leaf("f32", [rng.randint(1, 3), rng.randint(1, 3), 1, c])
    b = r.leaf("f32", [rng.randint(3, 9), rng.randint(3, 9), c, 1])
    r.op("conv_2d_dw_direct", a, b, 1, 1, rng.randint(0, 1), rng.randint(0, 1), 1, 1)
    return Case("CONV_2D_DW", r.recipe(), params={2: (0, [1, 2, 3]), 4: (2, [0, 2])})


@gen("conv_3d_direct", "CONV_3D")
def _conv3d(rng: random.Random) -> Case:
    r = R(rng)
    ic, oc, n = rng.randint(1, 2), rng.randint(1, 2), 1
    a = r.leaf("f32", [rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2), ic * oc])
    b = r.leaf("f32", [rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 4), ic * n])
    r.op("conv_3d_direct", a, b, 1, 1, 1, 0, 0, 0, 1, 1, 1, ic, n, oc)
    return Case("CONV_3D", r.recipe(), params={2: (0, [1, 2])})


@gen("pool_1d", "POOL_1D")
def _pool1d(rng: random.Random) -> Case:
    r = R(rng)
    k = rng.randint(1, 3)
    r.op("pool_1d", r.leaf("f32", [rng.randint(k, 9), rng.randint(1, 3)]), rng.randrange(2), k, rng.randint(1, 2), 0)
    return Case("POOL_1D", r.recipe(), params={2: (1, [1, 2, 5]), 3: (2, [1, 3])})


@gen("pool_2d", "POOL_2D")
def _pool2d(rng: random.Random) -> Case:
    r = R(rng)
    k0, k1 = rng.randint(1, 3), rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(k0, 9), rng.randint(k1, 9), rng.randint(1, 3)])
    r.op("pool_2d", a, rng.randrange(2), k0, k1, rng.randint(1, 2), rng.randint(1, 2), 0.0, 0.0)
    return Case("POOL_2D", r.recipe(), params={2: (1, [1, 2, 5]), 4: (3, [1, 3])})


@gen("col2im_1d", "COL2IM_1D")
def _col2im(rng: random.Random) -> Case:
    r = R(rng)
    k, oc = rng.randint(1, 4), rng.randint(1, 3)
    r.op("col2im_1d", r.leaf("f32", [k * oc, rng.randint(1, 6)]), rng.randint(1, 3), oc, rng.randint(0, 1))
    return Case("COL2IM_1D", r.recipe(), params={1: (0, [1, 2, 5]), 2: (1, [1, 2, 3])})


# -- recurrent / state-space ------------------------------------------------------------------


@gen("ssm_conv", "SSM_CONV")
def _ssm_conv(rng: random.Random) -> Case:
    r = R(rng)
    d_conv, d_inner, n_t, n_s = rng.randint(2, 4), rng.randint(1, 8), rng.randint(1, 5), rng.randint(1, 2)
    r.op("ssm_conv", r.leaf("f32", [d_conv - 1 + n_t, d_inner, n_s]), r.leaf("f32", [d_conv, d_inner]))
    return Case("SSM_CONV", r.recipe())


@gen("win_part", "WIN_PART")
def _win_part(rng: random.Random) -> Case:
    r = R(rng)
    r.op("win_part", r.leaf("f32", [rng.randint(1, 4), rng.randint(1, 9), rng.randint(1, 9)]), rng.randint(1, 4))
    return Case("WIN_PART", r.recipe(), params={1: (2, [1, 2, 7])})


@gen("win_unpart", "WIN_UNPART")
def _win_unpart(rng: random.Random) -> Case:
    r = R(rng)
    w = rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(1, 4), w, w, rng.randint(1, 6)])
    r.op("win_unpart", a, rng.randint(1, 6), rng.randint(1, 6), w)
    return Case("WIN_UNPART", r.recipe(), params={3: (0, [1, 2, 5])},
                dst_args=lambda ne_, nb_: [KEEP, ne_[1], ne_[2], KEEP])


@gen("get_rel_pos", "GET_REL_POS")
def _get_rel_pos(rng: random.Random) -> Case:
    r = R(rng)
    q = rng.randint(1, 5)
    r.op("get_rel_pos", r.leaf("f16", [rng.randint(1, 4), 2 * q - 1]), q, q)
    return Case("GET_REL_POS", r.recipe())


@gen("rwkv_wkv6", "RWKV_WKV6")
def _wkv6(rng: random.Random) -> Case:
    r = R(rng)
    s, h, t, n = rng.choice((1, 4)), rng.randint(1, 2), rng.randint(1, 4), 1
    k, v, rr = (r.leaf("f32", [s, h, t]) for _ in range(3))
    tf = r.leaf("f32", [s, h])
    td = r.leaf("f32", [s, h, t])
    st = r.leaf("f32", [s * s * h, n])
    r.op("rwkv_wkv6", k, v, rr, tf, td, st)
    return Case("RWKV_WKV6", r.recipe())


@gen("gated_linear_attn", "GATED_LINEAR_ATTN")
def _gla(rng: random.Random) -> Case:
    r = R(rng)
    s, h, t = rng.choice((1, 4)), rng.randint(1, 2), rng.randint(1, 4)
    k, v, q, g = (r.leaf("f32", [s, h, t]) for _ in range(4))
    r.op("gated_linear_attn", k, v, q, g, r.leaf("f32", [s * s * h, 1]), 0.5)
    return Case("GATED_LINEAR_ATTN", r.recipe())


@gen("rwkv_wkv7", "RWKV_WKV7")
def _wkv7(rng: random.Random) -> Case:
    r = R(rng)
    s, h, t = rng.choice((1, 4)), rng.randint(1, 2), rng.randint(1, 4)
    xs = [r.leaf("f32", [s, h, t]) for _ in range(6)]
    r.op("rwkv_wkv7", *xs, r.leaf("f32", [s * s * h, 1]))
    return Case("RWKV_WKV7", r.recipe())


@gen("solve_tri", "SOLVE_TRI")
def _solve_tri(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 6)
    r.op("solve_tri", r.leaf("f32", [n, n, 2]), r.leaf("f32", [rng.randint(1, 4), n, 2]), True, True, False)
    return Case("SOLVE_TRI", r.recipe())


# -- training ---------------------------------------------------------------------------------


@gen("cross_entropy_loss", "CROSS_ENTROPY_LOSS")
def _cel(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng, 2)
    r.op("cross_entropy_loss", r.leaf("f32", ne), r.leaf("f32", ne))
    return Case("CROSS_ENTROPY_LOSS", r.recipe())


@gen("cross_entropy_loss_back", "CROSS_ENTROPY_LOSS_BACK")
def _celb(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng, 2)
    r.op("cross_entropy_loss_back", r.leaf("f32", [1]), r.leaf("f32", ne), r.leaf("f32", ne))
    return Case("CROSS_ENTROPY_LOSS_BACK", r.recipe())


@gen("opt_step_adamw", "OPT_STEP_ADAMW")
def _adamw(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    xs = [r.leaf("f32", ne, param=i == 0) for i in range(4)]
    r.op("opt_step_adamw", *xs, r.leaf("f32", [7]))
    return Case("OPT_STEP_ADAMW", r.recipe())


@gen("opt_step_sgd", "OPT_STEP_SGD")
def _sgd(rng: random.Random) -> Case:
    r = R(rng)
    ne = _ne(rng)
    r.op("opt_step_sgd", r.leaf("f32", ne, param=True), r.leaf("f32", ne), r.leaf("f32", [2]))
    return Case("OPT_STEP_SGD", r.recipe())


# -- less common ops --------------------------------------------------------------------------


@gen("im2col_back", "IM2COL_BACK")
def _im2col_back(rng: random.Random) -> Case:
    r = R(rng)
    kw, ic, iw, n = rng.randint(1, 3), rng.randint(1, 3), rng.randint(3, 9), 1
    ow = iw - kw + 1
    a = r.leaf("f16", [kw, ic, 2])
    b = r.leaf("f32", [kw * ic, ow, n])
    r.op("im2col_back", a, b, [iw, ic, n, 1], 1, 1, 0, 0, 1, 1, False)
    return Case("IM2COL_BACK", r.recipe(), params={3: (0, [1, 2])}, dst_args=lambda ne_, nb_: [KEEP, KEEP, list(ne_)] + [KEEP] * 7)


@gen("im2col_3d", "IM2COL_3D")
def _im2col_3d(rng: random.Random) -> Case:
    r = R(rng)
    ic, oc, n = rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2)
    a = r.leaf("f16", [rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2), ic * oc])
    b = r.leaf("f32", [rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 4), ic * n])
    r.op("im2col_3d", a, b, ic, 1, 1, 1, 0, 0, 0, 1, 1, 1, rng.choice((0, 1)))
    return Case("IM2COL_3D", r.recipe(), params={3: (0, [1, 2, 3])}, type_arg=12)


@gen("pool_2d_back", "POOL_2D_BACK")
def _pool_2d_back(rng: random.Random) -> Case:
    r = R(rng)
    k = rng.randint(1, 3)
    w, h, c = rng.randint(k, 8), rng.randint(k, 8), rng.randint(1, 3)
    af = r.leaf("f32", [w, h, c])
    a = r.leaf("f32", [(w - k) // k + 1, (h - k) // k + 1, c])
    r.op("pool_2d_back", a, af, rng.randrange(2), k, k, k, k, 0.0, 0.0)
    return Case("POOL_2D_BACK", r.recipe(), params={3: (1, [1, 2, 4])})


@gen("flash_attn_back", "FLASH_ATTN_BACK")
def _fa_back(rng: random.Random) -> Case:
    r = R(rng)
    d, n, m, h = rng.choice((4, 8)), rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 2)
    q = r.leaf("f32", [d, n, h, 1])
    k = r.leaf("f32", [d, m, h, 1])
    v = r.leaf("f32", [m, d, h, 1])
    r.op("flash_attn_back", q, k, v, r.leaf("f32", [d, n, h, 1]), rng.random() < 0.5)
    return Case("FLASH_ATTN_BACK", r.recipe())


@gen("ssm_scan", "SSM_SCAN")
def _ssm_scan(rng: random.Random) -> Case:
    r = R(rng)
    ds, hd, nh, t, s = rng.choice((4, 16)), rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 2)
    st = r.leaf("f32", [ds, hd, nh, s])
    x = r.leaf("f32", [hd, nh, t, s])
    dt = r.leaf("f32", [nh, t, s])
    a = r.leaf("f32", [rng.choice((1, ds)), nh])
    b = r.leaf("f32", [ds, 1, t, s])
    c = r.leaf("f32", [ds, 1, t, s])
    r.op("ssm_scan", st, x, dt, a, b, c, r.leaf("i32", [s]), 1)
    return Case("SSM_SCAN", r.recipe(), params={7: (0, [2, 4])})


@gen("add_rel_pos", "ADD_REL_POS")
def _add_rel_pos(rng: random.Random) -> Case:
    r = R(rng)
    w, h, c = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3)
    a = r.leaf("f32", [w * w, w * h, c])
    r.op("add_rel_pos", a, r.leaf("f32", [w, w, h, c]), r.leaf("f32", [w, w, h, c]))
    return Case("ADD_REL_POS", r.recipe())


@gen("gated_delta_net", "GATED_DELTA_NET")
def _gdn(rng: random.Random) -> Case:
    r = R(rng)
    sv, h, t, s = rng.choice((2, 4, 8)), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 2)
    q, k, v = (r.leaf("f32", [sv, h, t, s]) for _ in range(3))
    g = r.leaf("f32", [rng.choice((1, sv)), h, t, s])
    beta = r.leaf("f32", [1, h, t, s])
    r.op("gated_delta_net", q, k, v, g, beta, r.leaf("f32", [sv, sv, h, s]), rng.randint(1, 2))
    return Case("GATED_DELTA_NET", r.recipe(), params={6: (0, [1, 3, 64])})


@gen("lightning_indexer", "LIGHTNING_INDEXER")
def _lightning(rng: random.Random) -> Case:
    r = R(rng)
    d, nh, nq, nkv, b = rng.choice((4, 8)), rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 9), rng.randint(1, 2)
    q = r.leaf("f32", [d, nh, nq, b])
    k = r.leaf(rng.choice(("f32", "f16")), [d, 1, nkv, b])
    w = r.leaf("f32", [nh, nq, 1, b])
    r.op("lightning_indexer", q, k, w, r.leaf("f16", [nkv, nq, 1, rng.choice((1, b))]))
    return Case("LIGHTNING_INDEXER", r.recipe())


@gen("dsv4_hc_comb", "DSV4_HC_COMB")
def _hc_comb(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 5)
    mix = 24  # hc * (hc + 2) with hc == 4 (the only value the constructor takes)
    r.op("dsv4_hc_comb", r.leaf("f32", [mix, n]), r.leaf("f32", [rng.randint(3, 4)]), r.leaf("f32", [mix]),
         1e-6, rng.randint(1, 5))  # fmt: skip
    return Case("DSV4_HC_COMB", r.recipe(), params={4: (0, [1, 7])})


@gen("dsv4_hc_pre", "DSV4_HC_PRE")
def _hc_pre(rng: random.Random) -> Case:
    r = R(rng)
    e, hc, n = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 4)
    w = r.leaf("f32", [hc, n]) if rng.random() < 0.5 else r.leaf("f32", [e, hc, n])
    r.op("dsv4_hc_pre", r.leaf("f32", [e, hc, n]), w)
    return Case("DSV4_HC_PRE", r.recipe())


@gen("dsv4_hc_post", "DSV4_HC_POST")
def _hc_post(rng: random.Random) -> Case:
    r = R(rng)
    e, hc, n = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 4)
    x = r.leaf("f32", [e, n])
    res = r.leaf("f32", [e, hc, n])
    post = r.leaf("f32", [hc, n])
    r.op("dsv4_hc_post", x, res, post, r.leaf("f32", [hc, hc, n]))
    return Case("DSV4_HC_POST", r.recipe())


@gen("rope_multi_back", "ROPE_BACK")
def _rope_multi_back(rng: random.Random) -> Case:
    r = R(rng)
    n_tok = rng.choice((1, 3))
    a = r.leaf("f32", [16, rng.choice((1, 2)), n_tok])
    r.op("rope_multi_back", a, r.leaf("i32", [4 * n_tok]), None, 8, [2, 1, 1, 0], 8, 4096, 10000.0, 1.0, 0.0, 1.0,
         32.0, 1.0)  # fmt: skip
    return Case("ROPE_BACK", r.recipe(), nullable={2: 2})


@gen("conv_1d_dw_composite", "RESHAPE")
def _conv1d_dw(rng: random.Random) -> Case:
    """ggml_conv_1d_dw builds reshape -> im2col -> mul_mat -> reshape: a multi-node recipe."""
    r = R(rng)
    c, k = rng.randint(1, 3), rng.randint(1, 3)
    a = r.leaf("f16", [k, 1, c])
    b = r.leaf("f32", [rng.randint(k, 9), c, 1])
    r.op("conv_1d_dw", a, b, 1, 0, 1)
    return Case("RESHAPE", r.recipe())


# -- a whole transformer block, as llama.cpp builds it -----------------------------------------


@gen("llama_block", "ADD")
def _llama_block(rng: random.Random) -> Case:
    """One llama layer: norm, Q/K/V, RoPE, KV-cache SET_ROWS, cache views, attention (plain or
    flash), output projection, SwiGLU FFN, residuals. Its last node is the residual ADD."""
    r = R(rng)
    wt = rng.choice(("f32", "f16", "q8_0", "q4_0", "q4_K", "q6_K"))
    e = 256 if BLCK[wt] == 256 else 64
    d = rng.choice((16, 32))
    h = e // d
    hkv = rng.choice([x for x in (1, 2, h) if h % x == 0])
    t, kv = rng.choice((1, 1, 3, 7)), 64
    n_kv = rng.choice((32, 64))
    f = 2 * e
    x = r.leaf("f32", [e, t])
    attn_norm, ffn_norm = r.leaf("f32", [e]), r.leaf("f32", [e])
    wq, wk, wv, wo = r.leaf(wt, [e, e]), r.leaf(wt, [e, hkv * d]), r.leaf(wt, [e, hkv * d]), r.leaf(wt, [e, e])
    wg, wu, wd = r.leaf(wt, [e, f]), r.leaf(wt, [e, f]), r.leaf(wt, [f, e]) if BLCK[wt] <= f else r.leaf("f16", [f, e])
    pos = r.leaf("i32", [t])
    ct = rng.choice(("f16", "f32", "q8_0")) if d % 32 == 0 else "f16"
    kc, vc = r.leaf(ct, [hkv * d, kv]), r.leaf(ct, [hkv * d, kv])
    idx = r.leaf(rng.choice(("i64", "i32")), [t])
    flash = rng.random() < 0.5
    mask = r.leaf("f16", [n_kv, t if not flash else -(-t // 64) * 64])
    cur = r.op("mul", r.op("rms_norm", x, 1e-6), attn_norm)
    q = r.op("reshape_3d", r.op("mul_mat", wq, cur), d, h, t)
    k = r.op("reshape_3d", r.op("mul_mat", wk, cur), d, hkv, t)
    v = r.op("mul_mat", wv, cur)
    rope = (10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    q = r.op("rope_ext", q, pos, None, d, rng.choice((0, 2)), 4096, *rope)
    k = r.op("rope_ext", k, pos, None, d, 0, 4096, *rope)
    sk = r.op("set_rows", kc, r.op("reshape_2d", k, d * hkv, t), idx)
    sv = r.op("set_rows", vc, v, idx)
    row = TSIZE[ct] * d // BLCK[ct]
    kview = r.op("view_3d", kc, d, hkv, n_kv, row, row * hkv, 0)
    vview = r.op("view_3d", vc, d, hkv, n_kv, row, row * hkv, 0)
    qp = r.op("permute", q, 0, 2, 1, 3)
    kp = r.op("permute", kview, 0, 2, 1, 3)
    if flash:
        vp = r.op("permute", vview, 0, 2, 1, 3)
        att = r.op("reshape_2d", r.op("flash_attn_ext", qp, kp, vp, mask, 0.125, 0.0, 0.0), e, t)
    else:
        kq = r.op("soft_max_ext", r.op("mul_mat", kp, qp), mask, 0.125, 0.0)
        vt = r.op("cont", r.op("permute", vview, 1, 2, 0, 3))
        kqv = r.op("permute", r.op("mul_mat", vt, kq), 0, 2, 1, 3)
        att = r.op("cont_2d", kqv, e, t)
    cur = r.op("add", r.op("mul_mat", wo, att), x)
    n = r.op("mul", r.op("rms_norm", cur, 1e-6), ffn_norm)
    ff = r.op("swiglu_split", r.op("mul_mat", wg, n), r.op("mul_mat", wu, n))
    out = r.op("add", r.op("mul_mat", wd, ff), cur)
    return Case("ADD", r.recipe(outputs=[sk, sv, out]))
