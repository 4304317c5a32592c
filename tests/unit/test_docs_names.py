"""The modules, classes, functions and files that docs/, README.md, docstrings and comments cite exist.

How this works: every Python file of the repository is parsed (never imported) into an index:
its module path, its top-level names (defined or imported), each class's attributes (methods,
class-level assignments, dataclass fields, ``self.x`` assignments, with its bases' ones) and
every identifier the code defines, uses or holds as a string (reason strings, config keys). The
citations are the code spans of the Markdown files (```x```) and of docstrings and comments
(```x``` or ````x````), plus, in docstrings and comments, bare ``Class.attr``, ``module.attr``
and ``_private`` names. Each is resolved:

* ``rpcguard/x.py``, ``tests/...``: a path under a top-level directory of the repository must exist;
* ``module.name[.attr]`` (a module of rpcguard by its last name, or ``rpcguard.a.b``) and
  ``Class.attr`` (a class of the repository): the name must be in that module or class;
* any other dotted name (``lc.state``, a config path like ``limits.hello_timeout_s``, a
  stdlib call): each part must be an identifier the code knows;
* a bare ``_private`` name must be defined somewhere.

Names of other projects (llama.cpp's C functions, h11's modules) are cited too: they are not
Python names of this repository, so only the forms above are held to it. A name that fails is
reported with its file and line: rename the citation or the code.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rpcguard"
PY_DIRS = ("rpcguard", "tests", "bench", "scripts")
SKIP_DIRS = ("tests/fuzz/findings",)  # recorded crash inputs and their notes, not prose about this code
TOP_DIRS = ("rpcguard", "tests", "bench", "scripts", "deploy", "docs", "config", "certs")
SELF = "tests/unit/test_docs_names.py"  # its docstring shows the forms with made-up names
FILE_SUFFIXES = {"py", "sh", "md", "json", "yaml", "yml", "cmake", "txt", "c", "cpp", "h", "toml", "gguf", "so", "log"}
# Names of other projects that look like ours (a module of the same name here).
EXTERNAL = {
    "tls.CipherSuites": "Go's crypto/tls, the source of observe/webconfig.py's cipher names",
    "_created": "prometheus_client's sample suffix, left out by observe/metrics.py",
}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"{IDENT}(?:\.{IDENT})*")
PATH = re.compile(r"(?:[\w.-]+/)+[\w.-]*")
CODE_SPAN = re.compile(r"``([^`\n]+)``|`([^`\n]+)`")
# bare citations in docstrings and comments: Class.attr, module._private, _private
BARE = re.compile(rf"(?<![\w.`/-])((?:[A-Z]\w*|[a-z]\w*)\.{IDENT}(?:\.{IDENT})*|_[a-z]\w*)(?![\w`/-]|\.\w)")


@dataclass
class Index:
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its top-level names
    stems: dict[str, list[str]] = field(default_factory=dict)  # last part -> dotted modules of rpcguard
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)  # name -> (attrs, bases)
    defined: set[str] = field(default_factory=set)  # every name a def/class/assignment/argument binds
    known: set[str] = field(default_factory=set)  # defined + used + identifier-like strings
    words: set[str] = field(default_factory=set)  # every word of the cited texts (see _fragment)

    def class_attrs(self, name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for attrs, bases in self.classes.get(name, []):
            out |= attrs
            for base in bases:
                if base not in seen:
                    out |= self.class_attrs(base, seen | {name})
        return out


def python_files() -> list[Path]:
    files = []
    for top in PY_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(SKIP_DIRS) and "/.venv/" not in rel and "/build/" not in rel:
                files.append(path)
    return files


def _bound_names(node: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
    return out


def _class_attrs(cls: ast.ClassDef) -> set[str]:
    attrs: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attrs.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            attrs |= _bound_names(stmt)
    for n in ast.walk(cls):  # self.x = ... in any method
        if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                and n.value.id in ("self", "cls")):
            attrs.add(n.attr)
    return attrs


def _top_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
        elif isinstance(stmt, (ast.If, ast.Try)):  # TYPE_CHECKING / optional imports
            names |= _top_level(ast.Module(body=list(ast.iter_child_nodes(stmt)), type_ignores=[]))  # type: ignore[arg-type]
        else:
            names |= _bound_names(stmt)
    return names


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def index() -> Index:
    idx = Index()
    for path in python_files():
        tree = ast.parse(path.read_text(), str(path))
        mod = _module_name(path)
        idx.modules[mod] = _top_level(tree)
        if mod.startswith(PACKAGE):
            idx.stems.setdefault(mod.rsplit(".", 1)[-1], []).append(mod)
            for i in range(1, mod.count(".") + 1):  # rpcguard.protocol is a module too
                idx.modules.setdefault(mod.rsplit(".", i)[0], set()).add(mod.rsplit(".", i)[1].split(".")[0])
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in n.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                idx.classes.setdefault(n.name, []).append((_class_attrs(n), bases))
                idx.defined.add(n.name)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                idx.defined.add(n.name)
            elif isinstance(n, ast.arg):
                idx.defined.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                idx.defined.add(n.arg)
            elif isinstance(n, (ast.Name, ast.Attribute)):
                name = n.id if isinstance(n, ast.Name) else n.attr
                (idx.defined if isinstance(n.ctx, ast.Store) else idx.known).add(name)
            elif isinstance(n, ast.alias):
                idx.defined.add((n.asname or n.name).split(".")[-1])
                idx.known.update(n.name.split("."))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                idx.known.update(re.findall(IDENT, n.value))
    idx.known |= idx.defined | set(idx.modules) | {m.rsplit(".", 1)[-1] for m in idx.modules}
    for path in [*python_files(), ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        idx.words.update(re.findall(r"\w+", path.read_text()))
    return idx


def _resolve_in_module(idx: Index, mod: str, rest: list[str]) -> bool:
    names = idx.modules.get(mod)
    if names is None or not rest:
        return names is not None
    head, tail = rest[0], rest[1:]
    if f"{mod}.{head}" in idx.modules:
        return _resolve_in_module(idx, f"{mod}.{head}", tail)
    if head not in names:
        return False
    return not tail or head not in idx.classes or tail[0] in idx.class_attrs(head) or tail[0] in idx.known


def _fragment(name: str) -> bool:
    """``_inplace``, ``_add_sinks``: the end of a longer name the texts cite (a C function's)."""
    return any(w.endswith(name) and w != name for w in index().words)


def resolves(ref: str, bare: bool = False) -> bool:
    """True when the citation ``ref`` names something that exists (see the module docstring).

    ``bare``: found in running text, not in a code span; only names anchored to a module or
    class of the repository, and private names, are held to it then."""
    idx = index()
    ref = ref.strip().rstrip(".,:;")
    if ref.endswith("()"):
        ref = ref[:-2]
    if ref in EXTERNAL:
        return True
    if "/" in ref:
        path = ref.split("::")[0]
        if path.split("/", 1)[0] not in TOP_DIRS or path.rsplit("/", 1)[-1].isdigit():
            return True  # another project's path (vendor/llama.cpp/..., h11/...), or "rpcguard/1" (ALPN)
        return (ROOT / path).exists() or (ROOT / f"{path}.py").exists()
    if not DOTTED.fullmatch(ref) or ref.startswith("__"):
        return True
    parts = ref.split(".")
    head = parts[0]
    if len(parts) == 1:
        return (not head.startswith("_") or head in idx.defined or head in sys.stdlib_module_names
                or _fragment(head))
    if parts[-1] in FILE_SUFFIXES or head in sys.stdlib_module_names:
        return True  # a file name (any project's), or the standard library
    parts = [p for p in parts if not (p.startswith("__") and p.endswith("__"))]
    if len(parts) == 1:
        return True  # a dunder of something: Class.__init__, rpcguard.__file__
    if head == PACKAGE:
        return _resolve_in_module(idx, PACKAGE, parts[1:])
    private = any(p.startswith("_") for p in parts[1:])
    if head in idx.stems:
        if any(_resolve_in_module(idx, mod, parts[1:]) for mod in idx.stems[head]):
            return True
        if private:
            return False  # module._name must be in that module
    if head[0].isupper():
        if head not in idx.classes:
            return True  # another project's class (asyncio's SSLProtocol, ...)
        if parts[1] in idx.class_attrs(head):
            return True
        return not private and not bare and parts[1] in idx.known
    if bare:
        return head not in idx.stems or not private
    return all((p in idx.defined) if p.startswith("_") else (p in idx.known) for p in parts)


def _candidates(text: str, bare: bool) -> list[tuple[str, bool]]:
    out = [(a or b, False) for a, b in CODE_SPAN.findall(text)]
    if bare:
        out += [(c, True) for c in BARE.findall(CODE_SPAN.sub(" ", text))]
    return [(c, k) for c, k in out if DOTTED.fullmatch(c.strip().rstrip("()")) or PATH.fullmatch(c.strip())]


def citations() -> list[tuple[str, int, str, bool]]:
    """(file, line, citation, bare) of every citation in docs, the README, docstrings and comments."""
    found: list[tuple[str, int, str, bool]] = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        in_fence = False
        for no, line in enumerate(md.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            if not in_fence:
                found += [(md.relative_to(ROOT).as_posix(), no, c, k) for c, k in _candidates(line, bare=False)]
    for path in python_files():
        rel, source = path.relative_to(ROOT).as_posix(), path.read_text()
        if rel == SELF:
            continue
        tree = ast.parse(source)
        for n in ast.walk(tree):
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(n, clean=False)
                if doc and n.body:
                    first = n.body[0].lineno
                    found += [(rel, first + i, c, k) for i, line in enumerate(doc.splitlines())
                              for c, k in _candidates(line, bare=True)]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                found += [(rel, tok.start[0], c, k) for c, k in _candidates(tok.string, bare=True)]
    return found


def test_the_index_sees_the_package():
    idx = index()
    assert "rpcguard.cli" in idx.modules and "main" in idx.modules["rpcguard.cli"]
    assert "rpcguard.protocol" in idx.modules


def test_resolution_rules_catch_what_they_should():
    """The checker would fail on the kinds of stale names it exists for (and not on live ones)."""
    assert resolves("rpcguard/cli.py") and resolves("rpcguard.cli.main") and resolves("cli.main")
    assert not resolves("rpcguard/no_such_module.py")
    assert not resolves("cli._no_such_helper") and not resolves("rpcguard.cli.no_such_function")
    assert not resolves("_no_such_private_helper")
    assert resolves("tests/support/realpeer.py") and resolves("realpeer.reserve_port")
    assert resolves("Index.class_attrs") and not resolves("Index._no_such_method")
    assert resolves("vendor/llama.cpp/ggml/src/ggml.c")  # another project's file: not ours to check


def test_cited_names_exist():
    missing = sorted({(f, n, c) for f, n, c, bare in citations() if not resolves(c, bare)})
    assert not missing, "cited but not found (rename the citation or the code):\n" + "\n".join(
        f"  {f}:{n}: {c}" for f, n, c in missing)


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py`` (one brace group at a time)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]


def test_readme_layout_paths_exist():
    """Every path of the README's layout table, braces expanded, is in the tree (the resolver
    above skips brace forms; the table once named modules that had moved into packages)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout"):]
    paths = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert len(paths) > 10
    missing = [p for raw in paths for p in _expand(raw) if not (ROOT / p.rstrip("/")).exists()]
    assert not missing, missing
