"""The package map of docs/design.md holds in the code: each package imports only the packages
below it, and no module imports itself back through others.

How this works: every module of rpcguard/ is parsed (never imported). Its imports are collected
with where they sit: at module level (run at import time) or inside a function (run when it is
called); imports under ``if TYPE_CHECKING:`` are annotations only and are left out. ``from
rpcguard.upstream import sandbox`` is an import of the submodule ``upstream.sandbox``. The layering rule
(``MAY_IMPORT``) and the cycle rule apply to both kinds (a lazy import that closes a cycle only
hides it). docs/design.md's package map is generated from ``MAY_IMPORT`` and
``PACKAGE_ROLES`` and must match it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rpcguard"

# Package (or top-level module) -> what it may import besides itself. Lowest first.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "protocol": frozenset({"errors"}),
    "pki": frozenset({"errors"}),
    "reasons": frozenset({"errors", "protocol", "pki"}),
    "observe": frozenset({"errors", "protocol", "pki", "reasons"}),
    "upstream": frozenset({"errors", "protocol", "observe"}),
    "config": frozenset({"errors", "protocol", "pki", "observe", "upstream"}),
    "admin": frozenset({"errors", "protocol", "pki", "reasons", "observe", "config"}),
    "proxy": frozenset({"errors", "protocol", "pki", "reasons", "observe", "upstream", "config"}),
    "cli": frozenset({"errors", "protocol", "pki", "reasons", "observe", "upstream", "config", "proxy", "admin"}),
    "__main__": frozenset({"cli"}),
    "__init__": frozenset(),
}
PACKAGE_ROLES = {
    "errors": "the typed refusals and errors every layer raises, each with its party",
    "protocol": "sans-IO: frames, commands, the firewall, the link lifecycle; no asyncio, ssl, socket or prometheus",
    "pki": "the private CA, CSRs, key files, TLS contexts, peer identity and the allow-list, the TLS-only node probe",
    "reasons": "the catalogue of stable reason strings (metric labels known before they occur)",
    "observe": "metrics and their HTTP endpoint, web config, log formatting, downgrades said loudly, sd_notify",
    "upstream": "serve's own ggml-rpc-server processes: sandbox, process, pool",
    "config": "YAML and flags into the frozen settings, key by key; what a reload changes",
    "admin": "the operator commands check, status and ops",
    "proxy": "the I/O layer: listeners, reload and drain, readiness, links, endpoints, routes, TLS material in use",
    "cli": "main(argv): the only place that prints or exits",
}


def _unit(module: str) -> str:
    """The package (or top-level module) a dotted rpcguard module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports() -> dict[str, tuple[set[str], set[str]]]:
    """module -> (rpcguard modules imported at module level, imported inside functions)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        top: set[str] = set()
        lazy: set[str] = set()

        def visit(node: ast.AST, at_top: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if isinstance(child, ast.Import):
                        found = [a.name for a in child.names]
                    elif child.level == 0 and child.module:
                        subs = [f"{child.module}.{a.name}" for a in child.names]
                        found = [s for s in subs if _is_module(s)] or [child.module]
                    else:
                        found = ["<relative import>"]
                    (top if at_top else lazy).update(n for n in found if n.startswith(("rpcguard", "<")))
                else:
                    visit(child, at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(path.read_text()), True)
        out[name] = (top - {name}, lazy - {name})
    return out


def test_no_relative_imports():
    bad = [m for m, (top, lazy) in imports().items() if "<relative import>" in top | lazy]
    assert not bad, f"modules with relative imports (write rpcguard.x.y): {bad}"


def test_every_package_is_in_the_map():
    units = {_unit(m) for m in imports()}
    assert units == set(MAY_IMPORT), (units ^ set(MAY_IMPORT))


def test_packages_import_only_what_is_below_them():
    bad = []
    for module, (top, lazy) in imports().items():
        unit = _unit(module)
        for dep in sorted(top | lazy):
            other = _unit(dep)
            if other not in (unit, "__init__") and other not in MAY_IMPORT[unit]:  # __init__: __version__
                bad.append(f"{module} imports {dep} ({unit} may import: {', '.join(sorted(MAY_IMPORT[unit])) or 'nothing'})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    # at module level or inside a function: a lazy import that closes a cycle only hides it
    found = imports()
    graph = {m: {d for d in top | lazy if d in found} for m, (top, lazy) in found.items()}
    done: set[str] = set()
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        path.append(m)
        for d in sorted(graph[m]):
            if d in path:
                return path[path.index(d):] + [d]
            if d not in done and (cycle := walk(d)):
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        if m not in done:
            cycle = walk(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_a_cycle_and_a_layering_breach(tmp_path, monkeypatch):
    # the rules above are not vacuous: a tree with both faults fails both
    pkg = tmp_path / "rpcguard"
    (pkg / "pki").mkdir(parents=True)
    (pkg / "proxy").mkdir()
    for d in (pkg, pkg / "pki", pkg / "proxy"):
        (d / "__init__.py").write_text("")
    (pkg / "pki" / "a.py").write_text("from rpcguard.proxy import b\n")
    (pkg / "proxy" / "b.py").write_text("from rpcguard.pki import a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PKG", pkg)
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match="rpcguard.pki.a imports rpcguard.proxy.b"):
        test_packages_import_only_what_is_below_them()


def package_map() -> str:
    lines = []
    for unit in MAY_IMPORT:
        if unit in PACKAGE_ROLES:
            kind = f"{unit}/" if (PKG / unit).is_dir() else f"{unit}.py"
            deps = ", ".join(u for u in MAY_IMPORT if u in MAY_IMPORT[unit]) or "nothing"
            lines.append(f"| `{kind}` | {PACKAGE_ROLES[unit]} | {deps} |")
    return "| package | what it is for | may import |\n|---|---|---|\n" + "\n".join(lines) + "\n"


def test_design_md_opens_with_the_package_map():
    text = (ROOT / "docs/design.md").read_text()
    m = re.search(r"<!-- package-map -->\n(.*?)<!-- /package-map -->", text, re.S)
    assert m, "docs/design.md has no <!-- package-map --> block"
    assert m.group(1) == package_map(), "docs/design.md's package map is stale: paste tests.unit.test_layout.package_map()"
    assert text.index("<!-- package-map -->") < text.index("## Layout")
