"""rpcguard/reasons.py against the code and docs/design.md.

The catalogue initialises the reason-labelled counters, so it must hold exactly the reasons the
code can produce: every string literal given as a reason (first argument of ``Refusal`` and its
subclasses or of a module's ``_refuse`` helper, second argument of ``Lifecycle._finish``, the value of
``tls_failure``/``refusal``/``firewall_violation``, both branches of a conditional there) is
collected from the source of every module, and compared both ways.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rpcguard import reasons
from rpcguard.pki.tls import HANDSHAKE_ERROR_REASONS

PKG = Path(__file__).resolve().parents[2] / "rpcguard"
DESIGN = PKG.parent / "docs" / "design.md"
_FIRST_ARG = ("tls_failure", "refusal", "firewall_violation", "_refuse")


def _literals(node: ast.expr) -> list[str]:
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value:
        return [node.value]
    return []


def reasons_in_code() -> dict[str, set[str]]:
    """reason -> {"module:kind"}; kind is the Refusal class or helper that carries it."""
    found: dict[str, set[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        # a module's name, or for one of protocol/'s sub-packages (the op table) the package's
        unit = path.parent.name if path.parent.parent.name == "protocol" else path.stem
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            for k in node.keywords:  # a Side's (protocol/side.py) reason for an unreachable upstream
                if k.arg == "unreachable_reason":
                    for lit in _literals(k.value):
                        found.setdefault(lit, set()).add(f"{unit}:{k.arg}")
            if name.endswith("Refusal") or name in _FIRST_ARG:
                args = node.args[:1]
            elif name == "refuse":  # oprules.refuse(node, op, what, reason="graph_shape_invalid")
                args = node.args[3:4] + [k.value for k in node.keywords if k.arg == "reason"]
                if not args:
                    args = [ast.Constant("graph_shape_invalid")]
            elif name == "_finish":
                args = node.args[1:2]
            else:
                continue
            for arg in args:
                for lit in _literals(arg):
                    found.setdefault(lit, set()).add(f"{unit}:{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
                for lit in _literals(node.value):
                    found.setdefault(lit, set()).add(f"{unit}:reason=")
    return found


def design_reasons() -> dict[str, set[str]]:
    """The reason lists of docs/design.md's '## Stable refusal reasons', by paragraph heading."""
    text = DESIGN.read_text(encoding="utf-8")
    section = re.search(r"^## Stable refusal reasons.*?$(.*?)(?=^## )", text, re.S | re.M)
    assert section, "docs/design.md has no '## Stable refusal reasons' section"
    out: dict[str, set[str]] = {}
    for para in section.group(1).strip().split("\n\n"):
        head = para.split(":", 1)[0].strip()
        names = set(re.findall(r"`([a-z_]+)`", para.split(":", 1)[1]))
        out[head] = {n for n in names if not n.endswith("_total")}  # metric names mentioned in passing
    return out


def test_every_reason_raised_in_code_is_catalogued():
    code = reasons_in_code()
    known = set(reasons.REFUSAL_REASONS) | set(reasons.SESSION_ERROR_REASONS)
    missing = {r: sorted(w) for r, w in code.items() if r not in known}
    assert not missing, f"reasons raised in code but missing from rpcguard/reasons.py: {missing}"


def test_every_catalogued_reason_is_raised_somewhere():
    code = set(reasons_in_code()) | {r for _, r in HANDSHAKE_ERROR_REASONS}
    dead = (set(reasons.REFUSAL_REASONS) | set(reasons.SESSION_ERROR_REASONS)) - code
    assert not dead, f"reasons in rpcguard/reasons.py that no code produces: {sorted(dead)}"


def test_firewall_reasons_are_exactly_the_firewall_rules():
    code = reasons_in_code()
    firewall = {r for r, where in code.items()
                if any(w.endswith(":FirewallRefusal") or w.split(":")[0] in ("tensor", "graph", "oprules", "opcheck") for w in where)}
    assert firewall == set(reasons.FIREWALL_REASONS)


def test_design_md_lists_the_same_reasons():
    doc = design_reasons()
    assert set(reasons.FIREWALL_REASONS) - {"frame_size_invalid"} == doc["Firewall (`rule` = reason)"]
    assert set(reasons.SESSION_ERROR_REASONS) <= set().union(*doc.values())
    documented = set().union(*doc.values())
    assert set(reasons.REFUSAL_REASONS) - documented == {"refused"}, "generic `refused` is the HELLO code 1"
    assert documented - set(reasons.REFUSAL_REASONS) - set(reasons.SESSION_ERROR_REASONS) == set()


def test_tls_reasons_never_include_policy_reasons():
    assert "identity_not_allowed" not in reasons.TLS_REASONS
    assert set(reasons.TLS_REASONS) <= set(reasons.REFUSAL_REASONS)
    assert len(set(reasons.REFUSAL_REASONS)) == len(reasons.REFUSAL_REASONS)
