"""What a module of the package imports, read from its source (never imported)."""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["imported"]

ROOT = Path(__file__).resolve().parents[2]


def imported(module_path: str) -> set[str]:
    """Every module ``module_path`` (relative to the repository) imports, and ``module.name`` for
    each name it imports from one; ``if TYPE_CHECKING:`` blocks and function bodies included."""
    tree = ast.parse((ROOT / module_path).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found
