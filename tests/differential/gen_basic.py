"""Generators: element-wise, unary, reductions, shapes and views (see cases.py)."""

from __future__ import annotations

import random
from typing import Any

from tests.differential.cases import BLCK, KEEP, R, TSIZE, Case, bcast, gen, rand_ne, rand_row


# -- element-wise binary ----------------------------------------------------------------------


def _binary(fn: str, op: str) -> None:
    @gen(fn, op)
    def g(rng: random.Random) -> Case:
        r = R(rng)
        ta = rng.choice(("f32", "f32", "f16", "bf16"))
        ne = rand_ne(rng)
        ne[0] = rand_row(rng, "f32")
        a = r.inp(ta, ne)
        b = r.inp(rng.choice(("f32", ta)), bcast(rng, ne))
        r.op(fn, a, b)
        return Case(op, r.recipe())


for _fn, _op in (("add", "ADD"), ("sub", "SUB"), ("mul", "MUL"), ("div", "DIV"),
                 ("add_inplace", "ADD"), ("mul_inplace", "MUL")):  # fmt: skip
    _binary(_fn, _op)


@gen("add1", "ADD1")
def _add1(rng: random.Random) -> Case:
    r = R(rng)
    a = r.inp("f32", rand_ne(rng))
    r.op("add1", a, r.leaf("f32", [1]))
    return Case("ADD1", r.recipe())


@gen("add_id", "ADD_ID")
def _add_id(rng: random.Random) -> Case:
    r = R(rng)
    ne0, n_used, n_tok, n_exp = rand_row(rng, "f32"), rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 8)
    a = r.inp("f32", [ne0, n_used, n_tok])
    r.op("add_id", a, r.leaf("f32", [ne0, n_exp]), r.leaf("i32", [n_used, n_tok]))
    return Case("ADD_ID", r.recipe())


def _acc_set(fn: str, op: str) -> None:
    @gen(fn, op)
    def g(rng: random.Random) -> Case:
        r = R(rng)
        ne = rand_ne(rng, 3)
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
        ne = rand_ne(rng)
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
    a = r.inp(rng.choice(("f32", "f16")), rand_ne(rng), 0.3)
    r.op("unary", a, rng.randrange(0, 22))
    return Case("UNARY", r.recipe(), params={1: (0, [0, 10, 21])})


@gen("argmax", "ARGMAX")
def _argmax(rng: random.Random) -> Case:
    r = R(rng)
    r.op("argmax", r.inp("f32", rand_ne(rng, 2), 0.2))
    return Case("ARGMAX", r.recipe())


@gen("diag", "DIAG")
def _diag(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    ne[1] = 1
    r.op("diag", r.leaf("f32", ne))
    return Case("DIAG", r.recipe())


@gen("count_equal", "COUNT_EQUAL")
def _count_equal(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("count_equal", r.leaf("i32", ne), r.leaf("i32", ne))
    return Case("COUNT_EQUAL", r.recipe())


@gen("silu_back", "SILU_BACK")
def _silu_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("silu_back", r.inp("f32", ne), r.inp("f32", ne))
    return Case("SILU_BACK", r.recipe())


@gen("rms_norm_back", "RMS_NORM_BACK")
def _rms_norm_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("rms_norm_back", r.leaf("f32", ne), r.leaf("f32", ne), 1e-6)
    return Case("RMS_NORM_BACK", r.recipe())


@gen("group_norm", "GROUP_NORM")
def _group_norm(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("group_norm", r.leaf("f32", ne), rng.randint(1, 4), 1e-6)
    return Case("GROUP_NORM", r.recipe(), params={1: (0, [1, 2, 32])})


# -- shapes: repeat, concat, views ------------------------------------------------------------


@gen("repeat", "REPEAT")
def _repeat(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    a = r.inp("f32", bcast(rng, ne))
    r.op("repeat", a, r.leaf(rng.choice(("f32", "f16")), ne))
    return Case("REPEAT", r.recipe())


@gen("repeat_4d", "REPEAT")
def _repeat_4d(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    small = bcast(rng, ne)
    r.op("repeat_4d", r.inp("f32", small), *ne)
    return Case("REPEAT", r.recipe(), dst_args=lambda ne_, nb_: [KEEP, *ne_])


@gen("repeat_back", "REPEAT_BACK")
def _repeat_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("repeat_back", r.leaf("f32", ne), r.leaf("f32", bcast(rng, ne)))
    return Case("REPEAT_BACK", r.recipe())


@gen("concat", "CONCAT")
def _concat(rng: random.Random) -> Case:
    r = R(rng)
    t = rng.choice(("f32", "f16", "i32"))
    dim = rng.randrange(4)
    ne = rand_ne(rng)
    ne2 = list(ne)
    ne2[dim] = rng.randint(1, 6)
    r.op("concat", r.inp(t, ne), r.inp(t, ne2), dim)
    return Case("CONCAT", r.recipe(), params={2: (0, [0, 1, 2, 3])})


@gen("reshape", "RESHAPE")
def _reshape(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
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
    ne = rand_ne(rng)
    a = r.leaf("f32", ne)
    b = r.leaf("f16", [ne[0] * ne[1], ne[2], ne[3]])
    r.op("reshape", a, b)
    return Case("RESHAPE", r.recipe(), dst_args=lambda ne_, nb_: {"fn": "reshape_4d", "args": [KEEP, *ne_]})


@gen("view", "VIEW")
def _view(rng: random.Random) -> Case:
    r = R(rng)
    t = rng.choice(("f32", "f16", "q8_0", "q4_0", "q4_K", "i32"))
    ne = rand_ne(rng, 4)
    ne[0] = rand_row(rng, t)
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
    a = r.inp(rng.choice(("f32", "f16")), rand_ne(rng), 0.2)
    r.op("permute", a, *ax)
    return Case("PERMUTE", r.recipe(), params={1: (0, [0, 1, 2, 3]), 2: (1, [0, 1, 2, 3]),
                                                3: (2, [0, 1, 2, 3]), 4: (3, [0, 1, 2, 3])})


@gen("cont_nd", "CONT")
def _cont_nd(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
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
    ne = rand_ne(rng)
    ne[0] = BLCK[tb] * rng.randint(1, 2) if BLCK[tb] > 1 else rand_row(rng, "f32")
    a = r.inp(ta, ne, 0.3)
    shape = list(ne) if rng.random() < 0.7 else [ne[0] * ne[1], ne[2], ne[3], 1]
    r.op("cpy", a, r.leaf(tb, shape))
    return Case("CPY", r.recipe())


@gen("cast", "CPY")
def _cast(rng: random.Random) -> Case:
    r = R(rng)
    r.op("cast", r.inp("f32", rand_ne(rng)), rng.choice((0, 1, 30)))
    return Case("CPY", r.recipe(), type_arg=1)
