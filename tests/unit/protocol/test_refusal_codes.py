"""Every refusal at or before HELLO reaches llama.cpp as its own 0.0.N, and the README's table says
what each N means: the table, the code table and the reason catalogue agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rpcguard import reasons
from rpcguard.protocol.versions import REFUSAL_CODES, REFUSAL_REASONS

ROOT = Path(__file__).resolve().parents[3]
# Where sessions are refused before they are active: admission (identity, usage, caps), the dial
# to the node or upstream, and the upstream slot. Every reason they raise is answered at HELLO.
BEFORE_HELLO = ("rpcguard/proxy/endpoint.py", "rpcguard/proxy/route.py", "rpcguard/pki/identity.py")


def readme_rows() -> dict[int, str]:
    rows = {}
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*(?:`(\w+)`|refused \(other\))\s*\|", line)
        if m:
            rows[int(m.group(1))] = m.group(2) or "refused"
    return rows


def raised_reasons(path: str) -> set[str]:
    """String literals given as the first argument of a ``*Refusal(...)`` call (and conditional ones)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")).endswith("Refusal"):
            if node.args:
                for sub in ast.walk(node.args[0]):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        out.add(sub.value)
    return out


def test_the_readme_table_is_the_code_table():
    assert readme_rows() == dict(REFUSAL_REASONS)


def test_every_code_is_a_catalogued_reason():
    assert set(REFUSAL_CODES) <= set(reasons.REFUSAL_REASONS) | {"refused"}


def test_every_reason_refused_before_hello_has_its_own_code():
    found = set().union(*(raised_reasons(p) for p in BEFORE_HELLO))
    assert {"node_name_mismatch", "identity_not_allowed", "upstream_busy"} <= found  # the parse sees them
    # closed at accept, before any TLS (proxy/route.py handshake cap): there is no HELLO to answer
    before_tls = {"too_many_handshakes_per_source"}
    missing = sorted(found - set(REFUSAL_CODES) - {"refused"} - before_tls)
    assert not missing, f"refused before HELLO without a 0.0.N code (llama.cpp sees 0.0.1): {missing}"
