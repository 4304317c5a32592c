"""Source trees the rpcguard arms run: the working tree, and a baseline git revision.

How this works: ``bench/run.py --baseline REV`` compares the working tree's rpcguard with the
code of an earlier revision in the same run (same machine drift). ``working_tree()`` describes
the repository this harness lives in. ``prepare(REV)`` resolves REV to a commit, extracts it
with ``git archive`` into ``<bench cache>/trees/<commit>/`` (no git metadata is touched; a
``.complete`` marker makes the extraction reusable across runs) and picks the Python that runs
it: the harness's own interpreter with ``PYTHONPATH`` set to the tree when the revision's
``pyproject.toml`` declares the same runtime dependencies (its compiled core is then built in
place, as ``pip install`` would, marked ``.compiled``), else a venv of its own in the tree
(``pip install`` of the tree, not editable). Every rpcguard process of an arm is started with
``cwd`` and ``PYTHONPATH`` set to its tree, so ``python -m rpcguard`` imports that tree's
package first (``sys.path[0]`` is the cwd) and the editable install of the working tree, which
sits later on ``sys.path``, cannot shadow it. ``Tree.verify()`` proves it: it imports rpcguard
the same way and checks that ``rpcguard.__file__`` lies inside the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Tree", "working_tree", "prepare", "dependencies_of"]

ROOT = Path(__file__).resolve().parent.parent
GIT_TIMEOUT_S = 120
PIP_TIMEOUT_S = 600


@dataclass
class Tree:
    """One rpcguard source tree and the interpreter that runs it."""

    label: str  # "working tree" or "rev <short commit>"
    path: Path
    revision: str  # `git describe --always --dirty` for the working tree, the full commit otherwise
    python: str
    imported_from: str = ""  # rpcguard.__file__ as that interpreter sees it (set by verify())
    core: str = "unknown"  # protocol core the tree runs (verify): "compiled" or "pure Python"
    notes: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """Environment overrides for a process of this tree (a PYTHONPATH of the caller is dropped)."""
        return {"PYTHONPATH": str(self.path)}

    def verify(self) -> str:
        """Import rpcguard exactly as the arm will; raise RuntimeError unless it comes from this tree."""
        env = dict(os.environ, **self.env())
        code = "import rpcguard, rpcguard.protocol.session as s; print(rpcguard.__file__); print(s.__file__)"
        p = subprocess.run([self.python, "-c", code], cwd=self.path, env=env, capture_output=True, text=True,
                           timeout=60)
        where, _, session_file = p.stdout.strip().partition("\n")
        # the protocol core this tree runs: compiled (mypyc extension modules, setup.py) or pure
        self.core = "compiled" if session_file.endswith((".so", ".pyd")) else "pure Python"
        if p.returncode or not where:
            raise RuntimeError(f"{self.label}: cannot import rpcguard: {p.stderr.strip()[-300:]}")
        if not Path(where).resolve().is_relative_to(self.path.resolve()):
            raise RuntimeError(f"{self.label}: rpcguard imported from {where}, not from {self.path}")
        self.imported_from = where
        return where

    def describe(self) -> dict:
        return {"label": self.label, "path": str(self.path), "revision": self.revision, "python": self.python,
                "rpcguard_imported_from": self.imported_from, "notes": self.notes,
                "core": self.core}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True,
                          timeout=GIT_TIMEOUT_S).stdout.strip()


def working_tree() -> Tree:
    """The tree this harness belongs to, run by the harness's own interpreter."""
    try:
        rev = _git("describe", "--always", "--dirty", "--abbrev=12")
    except (OSError, subprocess.SubprocessError):
        rev = "unknown"
    return Tree("working tree", ROOT, rev, sys.executable)


def dependencies_of(pyproject_text: str) -> list[str]:
    """The runtime dependencies a pyproject.toml declares, sorted (``[]`` when there are none)."""
    data = tomllib.loads(pyproject_text)
    return sorted(data.get("project", {}).get("dependencies", []))


def prepare(rev: str, cache: Path, *, compile_core: bool = True) -> Tree:
    """Extract ``rev`` into the bench cache and choose the interpreter that runs it (see module doc).

    ``compile_core=False``: leave its protocol core pure Python (bench/memory.py ``--pure``)."""
    try:
        commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"--baseline {rev}: not a git revision ({exc.stderr.strip()})") from None
    short = commit[:7]
    path = cache / "trees" / commit
    marker = path / ".complete"
    if not marker.exists():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit],
                                 check=True, capture_output=True, timeout=GIT_TIMEOUT_S).stdout
        subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True, timeout=GIT_TIMEOUT_S)
        marker.write_text(commit + "\n")
    tree = Tree(f"rev {short}", path, commit, sys.executable)
    changed = _git("diff", "--shortstat", commit, "--", "rpcguard", "pyproject.toml")
    same = "identical sources (an A/A run if both run the same protocol core)"
    tree.notes.append(f"against the working tree, rpcguard/ and pyproject.toml: {changed or same}")
    ours = dependencies_of((ROOT / "pyproject.toml").read_text())
    theirs = dependencies_of((path / "pyproject.toml").read_text())
    if ours != theirs:
        venv = path / ".venv"
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=PIP_TIMEOUT_S)
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(path)], check=True,
                           timeout=PIP_TIMEOUT_S)
        tree.python = str(venv / "bin" / "python")
        tree.notes.append(f"own venv: its dependencies differ from the working tree's ({theirs} vs {ours})")
    elif compile_core:
        _compile(tree)
    return tree


def _compile(tree: Tree) -> None:
    """Build the revision's compiled protocol core in its tree (mypyc, as ``pip install`` does), so
    a compiled working tree is compared with a compiled baseline. A revision without one, or a
    build that fails, runs pure Python; ``Tree.verify`` reports which core runs."""
    marker = tree.path / ".compiled"
    if marker.exists() or not (tree.path / "setup.py").exists():
        return
    p = subprocess.run([tree.python, "setup.py", "build_ext", "--inplace"], cwd=tree.path, capture_output=True,
                       text=True, timeout=PIP_TIMEOUT_S)
    if p.returncode:
        tree.notes.append(f"compiled core not built, runs pure Python: {p.stderr.strip()[-200:]}")
        return
    marker.write_text(tree.revision + "\n")
