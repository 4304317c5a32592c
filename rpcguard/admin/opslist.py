"""``rpcguard ops``: every graph op of a protocol version with what the firewall does with it.

How this works: the op enum of the version (``protocol.ggml.op_table``) and the verified rules
(``protocol.oprules.rule_for``) give one row per op: ``denied`` (its op_params carry a function
pointer: always refused), a status of ``oprules.op_status``: ``verified`` (a rule re-derives the node as its ggml
constructor would; the row names the constructor), ``verified, contents abort`` /
``verified, residual risk`` (its kernel indexes with tensor contents), ``contained only``
(forwarded only to a contained server), ``leaf`` (NONE: a parameter listed as a node, never computed,
forwarded with the layout checks only), or ``not verified`` (refused as ``op_not_verified``
unless ``policy.allow_unverified_ops`` names it). ``backend="cuda"`` gives each op's status on a
CUDA node (``op_status(op, version, "cuda")``: GET_ROWS, SET_ROWS ... contained only) and the CUDA
layer's facts about it (``oprules.cuda.layer_notes``: what it refuses, its reach, where each was
read); ``cuda_markdown`` is docs/firewall.md's "On a CUDA node, per op" (tests/unit/admin/test_opslist.py
keeps them equal). Read-only: the tables are the lead's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rpcguard.protocol.ggml import DENIED_OPS, op_table
from rpcguard.protocol.oprules import op_status, rule_for
from rpcguard.protocol.oprules.cuda import NO_KERNEL, layer_notes
from rpcguard.protocol.versions import KNOWN_VERSIONS, Version, format_version

__all__ = ["BACKENDS", "OpRow", "op_rows", "versions_with_ops", "cuda_markdown"]

#: ``rpcguard ops --backend``: the layers of the rules (protocol/backend.py LAYERS)
BACKENDS = ("cpu", "cuda")
#: the status on a CUDA node of an op ggml-cuda has no kernel for (oprules/cuda.py NO_KERNEL)
NO_CUDA_KERNEL = "refused: no CUDA kernel"


@dataclass(frozen=True)
class OpRow:
    id: int
    op: str
    status: str  # oprules.op_status ("not verified" for its "refused"), "denied", "leaf", NO_CUDA_KERNEL
    ctor: str = ""
    # backend "cuda": the CUDA layer's facts about the op, (what, where read) each
    layer: tuple[tuple[str, str], ...] = ()


def versions_with_ops() -> tuple[Version, ...]:
    """The known versions whose op enum rpcguard has (the others refuse every graph)."""
    return tuple(v for v in KNOWN_VERSIONS if op_table(v, allow_inferred=True) is not None)


def op_rows(version: Version, backend: str = "cpu") -> list[OpRow]:
    """One row per op of ``version``'s enum on ``backend`` (cpu or cuda); ValueError when
    rpcguard has no op table for it or the backend is not one of BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {', '.join(BACKENDS)}")
    table = op_table(version, allow_inferred=True)
    if table is None:
        known = ", ".join(format_version(v) for v in versions_with_ops())
        raise ValueError(f"no op table for protocol {format_version(version)} (rpcguard has {known})")
    rows = []
    for i, name in enumerate(table.names[:table.count]):
        if name in DENIED_OPS:
            rows.append(OpRow(i, name, "denied"))
            continue
        if name == "NONE":  # graph.py: a PARAM leaf listed as a node is never computed
            rows.append(OpRow(i, name, "leaf"))
            continue
        rule = rule_for(name, version)
        if rule is None:
            rows.append(OpRow(i, name, "not verified"))
        else:
            layer = layer_notes(name) if backend == "cuda" else ()
            status = NO_CUDA_KERNEL if backend == "cuda" and name in NO_KERNEL else op_status(name, version, backend)
            rows.append(OpRow(i, name, status, rule.ctor, layer))
    return rows


def cuda_markdown(version: Version) -> str:
    """Per op with a verified rule at ``version``: its status on a CPU node and on a CUDA node,
    and what the CUDA layer refuses or requires of it (docs/firewall.md "On a CUDA node, per op");
    ops with nothing CUDA-specific are left out."""
    lines = ["| op | CPU node | CUDA node | the CUDA layer (ggml-cuda, b11434) |", "|---|---|---|---|"]
    cpu = {r.op: r.status for r in op_rows(version)}
    for r in op_rows(version, "cuda"):
        if not r.layer and r.status == cpu[r.op]:
            continue
        what = "; ".join(f"{w} (`{c}`)" for w, c in r.layer)
        lines.append(f"| {r.op} | {cpu[r.op]} | {r.status} | {what} |")
    return "\n".join(lines) + "\n"
