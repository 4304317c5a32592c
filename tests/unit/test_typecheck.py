"""mypy passes on rpcguard/ (config in pyproject.toml: strict for rpcguard.protocol.*).

Runs ``python -m mypy`` in a subprocess so that the suite CI runs type-checks the package; the
failure message is mypy's own output. The cache lives under pytest's cache directory (one cold
run is a few seconds with the compiled mypy wheel; warm runs under one second).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_clean(request):
    pytest_cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cache = pytest_cache.mkdir("mypy") if pytest_cache is not None else ROOT / ".mypy_cache"
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", "--no-color-output"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, f"mypy found type errors:\n{p.stdout}{p.stderr}"
