"""``rpcguard ops``: every graph op of a protocol version with what the firewall does with it.

How this works: the op enum of the version (``protocol.ggml.op_table``) and the verified rules
(``protocol.oprules.rule_for``) give one row per op: ``denied`` (its op_params carry a function
pointer: always refused), a status of ``oprules.op_status``: ``verified`` (a rule re-derives the node as its ggml
constructor would; the row names the constructor), ``verified, contents abort`` /
``verified, residual risk`` (its kernel indexes with tensor contents), ``contained only``
(forwarded only to a contained server), ``leaf`` (NONE: a parameter listed as a node, never computed,
forwarded with the layout checks only), or ``not verified`` (refused as ``op_not_verified``
unless ``policy.allow_unverified_ops`` names it). Read-only: the tables are the lead's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rpcguard.protocol.ggml import DENIED_OPS, op_table
from rpcguard.protocol.oprules import op_status, rule_for
from rpcguard.protocol.versions import KNOWN_VERSIONS, Version, format_version

__all__ = ["OpRow", "op_rows", "versions_with_ops"]


@dataclass(frozen=True)
class OpRow:
    id: int
    op: str
    status: str  # oprules.op_status ("not verified" for its "refused"), "denied", "leaf"
    ctor: str = ""


def versions_with_ops() -> tuple[Version, ...]:
    """The known versions whose op enum rpcguard has (the others refuse every graph)."""
    return tuple(v for v in KNOWN_VERSIONS if op_table(v, allow_inferred=True) is not None)


def op_rows(version: Version) -> list[OpRow]:
    """One row per op of ``version``'s enum; ValueError when rpcguard has no op table for it."""
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
            rows.append(OpRow(i, name, op_status(name, version), rule.ctor))
    return rows
