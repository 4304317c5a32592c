"""The package map of docs/design.md holds in the code: each package imports only the packages
below it, and no module or package imports itself back through others.

How this works: every module of rpcguard/ is parsed (never imported). Every import is collected,
wherever it sits: at module level, inside a function (run when it is called) or under ``if
TYPE_CHECKING:`` (annotations only, but the module still needs the other's concrete class: a seam
is a ``typing.Protocol`` instead). ``from rpcguard.upstream import sandbox`` is an import of the
submodule ``upstream.sandbox``. The layering rule (``MAY_IMPORT``) and the cycle rules (between
modules, and between packages) apply to all three kinds: a lazy or annotation-only import that
closes a cycle only hides it. docs/design.md's package map is generated from ``MAY_IMPORT`` and
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


def _type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def imports() -> dict[str, dict[str, str]]:
    """module -> {rpcguard module it imports: where (module level, in a function, TYPE_CHECKING)}.
    Every kind counts; ``where`` only makes the messages say which kind closes a cycle."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps: dict[str, str] = {}

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    if isinstance(child, ast.Import):
                        found = [a.name for a in child.names]
                    elif child.level == 0 and child.module:
                        subs = [f"{child.module}.{a.name}" for a in child.names]
                        found = [s for s in subs if _is_module(s)] or [child.module]
                    else:
                        found = ["<relative import>"]
                    for dep in found:
                        if dep.startswith(("rpcguard", "<")) and dep != name:
                            deps.setdefault(dep, where)
                elif isinstance(child, ast.If) and _type_checking(child.test):
                    visit(ast.Module(body=child.body, type_ignores=[]), "TYPE_CHECKING")
                    visit(ast.Module(body=child.orelse, type_ignores=[]), where)
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, "in a function" if where == "module level" else where)
                else:
                    visit(child, where)

        visit(ast.parse(path.read_text()), "module level")
        out[name] = deps
    return out


def components(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan's
    algorithm, iterative): each is a set of nodes that import each other round a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        members.add(m)
                        if m == node:
                            break
                    if len(members) > 1:
                        found.add(frozenset(members))
    return found


def _describe(component: frozenset[str], edges: dict[str, dict[str, str]]) -> str:
    return "{" + "; ".join(f"{m} -> {d} ({edges[m][d]})" for m in sorted(component)
                           for d in sorted(edges[m]) if d in component) + "}"


def test_no_relative_imports():
    bad = [m for m, deps in imports().items() if "<relative import>" in deps]
    assert not bad, f"modules with relative imports (write rpcguard.x.y): {bad}"


def test_every_package_is_in_the_map():
    units = {_unit(m) for m in imports()}
    assert units == set(MAY_IMPORT), (units ^ set(MAY_IMPORT))


def test_the_map_is_layered():
    # each unit may import only units listed before it: the map itself has no cycle
    order = list(MAY_IMPORT)
    bad = [f"{u} may import {d}, listed after it" for u in order for d in MAY_IMPORT[u]
           if d not in order or order.index(d) >= order.index(u)]
    assert not bad, "\n".join(bad)


def test_packages_import_only_what_is_below_them():
    bad = []
    for module, deps in imports().items():
        unit = _unit(module)
        for dep, where in sorted(deps.items()):
            other = _unit(dep)
            if other not in (unit, "__init__") and other not in MAY_IMPORT[unit]:  # __init__: __version__
                bad.append(f"{module} imports {dep} ({where}; {unit} may import: "
                           f"{', '.join(sorted(MAY_IMPORT[unit])) or 'nothing'})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    # TYPE_CHECKING and in-function imports count: either kind closing a cycle only hides it
    found = imports()
    graph = {m: {d for d in deps if d in found} for m, deps in found.items()}
    cycles = components(graph)
    new = [_describe(c, found) for c in sorted(cycles, key=sorted)]
    assert not new, "import cycle: " + "\n".join(new)


def test_no_package_cycle():
    found = imports()
    edges: dict[str, dict[str, str]] = {}
    for module, deps in found.items():
        for dep, where in deps.items():
            if _unit(dep) != _unit(module) and _unit(dep) in MAY_IMPORT:
                edges.setdefault(_unit(module), {}).setdefault(_unit(dep), f"{module} -> {dep}, {where}")
    graph = {u: set(edges.get(u, {})) for u in MAY_IMPORT}
    cycles = components(graph)
    assert not cycles, "package cycle: " + "\n".join(_describe(c, edges) for c in sorted(cycles, key=sorted))


# protocol/ is sans-IO: what it may not import (the I/O layer owns sockets, loops, TLS, threads, the
# clock and the garbage collector's hooks, and hands the core what it needs: graph.set_clock)
SANS_IO_BANNED = frozenset({"asyncio", "ssl", "socket", "select", "selectors", "threading", "concurrent",
                            "gc", "time", "prometheus_client"})


def test_protocol_is_sans_io():
    bad = []
    for path in sorted((PKG / "protocol").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in SANS_IO_BANNED]
    assert not bad, "\n".join(bad)


def test_the_checks_see_cycles_and_a_layering_breach(tmp_path, monkeypatch):
    # the rules above are not vacuous: a tree with a module cycle, a package cycle and a layering
    # breach, each closed by an annotation-only import, fails all three
    pkg = tmp_path / "rpcguard"
    (pkg / "pki").mkdir(parents=True)
    (pkg / "proxy").mkdir()
    for d in (pkg, pkg / "pki", pkg / "proxy"):
        (d / "__init__.py").write_text("")
    (pkg / "pki" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from rpcguard.proxy import b\n")
    (pkg / "proxy" / "b.py").write_text("def f():\n    from rpcguard.pki import a\n")
    (pkg / "proxy" / "c.py").write_text("from rpcguard.proxy import d\n")
    (pkg / "proxy" / "d.py").write_text("if True:\n    import rpcguard.proxy.c\n")
    this = __import__(__name__, fromlist=["x"])
    monkeypatch.setattr(this, "ROOT", tmp_path)
    monkeypatch.setattr(this, "PKG", pkg)
    with pytest.raises(AssertionError, match=r"import cycle: .*rpcguard.pki.a -> rpcguard.proxy.b \(TYPE_CHECKING\)"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match=r"rpcguard.proxy.c -> rpcguard.proxy.d \(module level\)"):
        test_no_import_cycle()
    with pytest.raises(AssertionError, match=r"package cycle: .*pki -> proxy \(rpcguard.pki.a -> rpcguard.proxy.b, TYPE_CHECKING\)"):
        test_no_package_cycle()
    with pytest.raises(AssertionError, match=r"rpcguard.pki.a imports rpcguard.proxy.b \(TYPE_CHECKING"):
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


def test_a_module_over_400_lines_says_why_it_stays_whole():
    """issue 30.6: a module over 400 lines gives a design reason in its docstring (the line
    "Stays whole (over 400 lines): ...") or is split."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 400 and "Stays whole (over 400 lines):" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, "over 400 lines without a reason to stay whole: " + ", ".join(long)
