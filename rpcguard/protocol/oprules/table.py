"""The op table: every family's rows, which of them walk rows flattened, the ops indexed by
contents, and what holds per op (verified, contents abort, residual risk, contained only, refused)."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from rpcguard.protocol.ggml import DENIED_OPS, Version
from rpcguard.protocol.oprules import attention, conv, elementwise, layout, matmul, recurrent, reduce, training, window
from rpcguard.protocol.oprules import cuda, kerneltypes
from rpcguard.protocol.oprules.base import OpRule

# -- the table -------------------------------------------------------------------------------

_ROWS: tuple[OpRule, ...] = (
    *elementwise.ROWS,
    *matmul.ROWS,
    *layout.ROWS,
    *attention.ROWS,
    *reduce.ROWS,
    *recurrent.ROWS,
    *conv.ROWS,
    *window.ROWS,
    *training.ROWS,
)

# Ops whose every CPU kernel (0.3.36 ggml-cpu/ops.cpp, binary-ops.cpp, unary-ops.cpp) indexes each
# dimension with its own stride (``i01*nb01 + i02*nb02 + i03*nb03``), or never computes (views):
# the flat-row reach rule (OpRule.flat_rows) is not theirs, since real graphs hand them permuted
# views whose flattened rows would leave the buffer. Every other row keeps the rule (scale,
# clamp, argsort, top_k, leaky_relu and the glu kernels walk ``i*nb1`` over ggml_nrows).
PER_DIMENSION_OPS = frozenset({
    "DUP", "CPY", "CONT", "ACC", "SET", "ADD", "SUB", "MUL", "DIV", "ADD_ID", "SUM", "SUM_ROWS", "CUMSUM", "MEAN",
    "REPEAT", "CONCAT", "NORM", "RMS_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "GET_ROWS", "SET_ROWS",
    "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "ROPE", "PAD", "ROLL", "FILL", "FLASH_ATTN_EXT", "IM2COL",
    "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE",
})  # fmt: skip

RULES: Mapping[str, tuple[OpRule, ...]] = {
    op: tuple(replace(r, flat_rows=False) if op in PER_DIMENSION_OPS else r for r in _ROWS if r.op == op)
    for op in dict.fromkeys(r.op for r in _ROWS)
}


# Ops whose CPU kernels index rows, experts or state with tensor *contents*, which no shape rule
# can bound (the index tensor is written by SET_TENSOR or computed in the same graph). The second
# field says what an out-of-range value does on the 0.3.36 CPU backend:
#   "abort":   a GGML_ASSERT stops the server (this session's server: a denial of service, which
#              containment's per-session process confines to the tenant that sent it);
#   "memory":  nothing checks it (or only a plain assert, compiled out in release builds): reads or
#              writes outside the tensor. Forwarded only to a contained server (a fresh sandboxed
#              process per session), or where refusing would break every model of a family
#              (MUL_MAT_ID: every mixture-of-experts model), with that residual risk stated.
CONTENT_INDEXED: Mapping[str, tuple[str, str]] = {
    "GET_ROWS": ("row indices (src[1])", "abort"),  # ops.cpp:5240 GGML_ASSERT(i01 >= 0 && i01 < ne01)
    "SET_ROWS": ("row indices (src[1])", "abort"),  # ops.cpp:5488 GGML_ASSERT(i1 >= 0 && i1 < ne1)
    "ADD_ID": ("row ids (src[2])", "abort"),  # ops.cpp:746 GGML_ASSERT(i11 >= 0 && i11 < ne11)
    "MUL_MAT_ID": ("expert ids (src[2])", "memory"),  # ggml-cpu.c:1655 assert(), not GGML_ASSERT
    "SSM_SCAN": ("state slot ids (src[6])", "memory"),  # ops.cpp:10049 src0 + ids[i3]*nb3 (#25765)
    "GET_ROWS_BACK": ("row indices (src[1])", "abort"),  # ops.cpp:5579/5614 GGML_ASSERT(r >= 0 && r < dst->ne[1])
}
#: content-indexed ops forwarded even to a server that is not contained, and why
RESIDUAL_RISK: Mapping[str, str] = {
    "MUL_MAT_ID": "refusing it would refuse every mixture-of-experts model; an out-of-range expert id "
                  "writes outside the planner's work buffer: run MoE tenants on a contained node",
}


#: ops with no rule by design, and why (status_markdown shows it): no client can build the node
REFUSED_BY_DESIGN: Mapping[str, str] = {
    # ggml_flash_attn_back starts with GGML_ABORT("TODO: adapt to ggml_flash_attn_ext() changes")
    # (ggml.c:5604 of 0.3.36, the same in b11434) and no backward rule calls it
    "FLASH_ATTN_BACK": "no ggml constructor builds it",
    **{op: "its node carries a function pointer of the client's process" for op in DENIED_OPS},
}


def content_effect(op: str, backend: str = "cpu") -> str | None:
    """What an out-of-range index of ``op`` does on ``backend``'s kernels: "abort", "memory",
    "ignored" (the CUDA kernel only compares it), or None (``op`` is not indexed by contents).
    Per backend: CONTENT_INDEXED on the CPU, cuda.CONTENT_INDEXED on CUDA."""
    if backend == "cuda":
        entry = cuda.CONTENT_INDEXED.get(op)
        return entry[0] if entry is not None else None
    cpu = CONTENT_INDEXED.get(op)
    return cpu[1] if cpu is not None else None


def needs_containment(op: str, backend: str = "cpu") -> bool:
    """Whether ``op`` is forwarded only to a contained server on ``backend`` (content-indexed,
    unchecked). On the CPU, RESIDUAL_RISK's ops are forwarded anyway; on CUDA every op whose
    kernel addresses memory with an index is contained only (an index that stays in the
    attacker's own process can reach no other tenant's device memory), MUL_MAT_ID included."""
    if content_effect(op, backend) != "memory":
        return False
    return backend == "cuda" or op not in RESIDUAL_RISK


def op_status(op: str, version: Version, backend: str = "cpu") -> str:
    """What holds for ``op`` at ``version`` on ``backend`` (docs/firewall.md, ``rpcguard ops``;
    docs/gpu.md for CUDA): ``verified`` (a rule; nothing the kernel reads depends on contents, or
    the kernel only compares them), ``verified, contents abort`` (a rule; an out-of-range index
    aborts the server), ``verified, residual risk`` (a rule; an out-of-range index reaches memory:
    RESIDUAL_RISK says why it is forwarded), ``contained only``, or ``refused`` (no rule)."""
    if rule_for(op, version) is None:
        return "refused"
    if needs_containment(op, backend):
        return "contained only"
    effect = content_effect(op, backend)
    if effect is None or effect == "ignored":
        return "verified"
    return "verified, contents abort" if effect == "abort" else "verified, residual risk"


def rule_for(op: str, version: Version) -> OpRule | None:
    """The verified rule of ``op`` for ``version``, or None (the op is refused by default). Its
    derive also refuses what that version's CPU kernel does not run (kerneltypes.py)."""
    for rule in RULES.get(op, ()):
        if rule.since <= version < rule.until:
            return kerneltypes.bind(rule, version)
    return None


def status_markdown(version: Version, op_names: Sequence[str]) -> str:
    """Per op of ``version``'s table, what holds (op_status) and what its kernel indexes with
    contents: docs/firewall.md "What holds, per op" (tests/unit/protocol/test_oprules.py keeps them equal)."""
    lines = ["| op | status | indexed by contents |", "|---|---|---|"]
    for op in op_names:
        if op == "NONE":
            continue
        what, effect = CONTENT_INDEXED.get(op, ("", ""))
        note = f"{what}: out of range {'aborts' if effect == 'abort' else 'reaches memory'}" if what else ""
        status = op_status(op, version)
        if status == "refused" and op in REFUSED_BY_DESIGN:
            status += f": {REFUSED_BY_DESIGN[op]}"
        lines.append(f"| {op} | {status} | {note} |")
    return "\n".join(lines) + "\n"


def table_markdown() -> str:
    """The op table as docs/firewall.md shows it (tests/unit/protocol/test_oprules.py keeps them equal)."""
    lines = ["| op | versions | constructor mirrored | sources (+optional) | params |", "|---|---|---|---|---|"]
    for op, rows in RULES.items():
        for r in rows:
            since = "" if r.since == (0, 0, 0) else ".".join(map(str, r.since))
            until = "" if r.until == (99, 0, 0) else ".".join(map(str, r.until))
            versions = (f"{since} - <{until}" if since and until else f"{since}+" if since
                        else f"< {until}" if until else "all")
            srcs = f"{r.srcs}" + (f" (+{r.optional})" if r.optional else "") + (", src[1] may be itself" if r.self_src1 else "")
            lines.append(f"| {op} | {versions} | {r.ctor} | {srcs} | {r.params} |")
    return "\n".join(lines) + "\n"


