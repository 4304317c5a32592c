"""Wire constants are defined once, in rpcguard/protocol/: no module outside it writes a protocol
version (the HELLO eras: 4.0.0 and 3.6.1) or a frame header's struct format again."""

from __future__ import annotations

import ast
from pathlib import Path

from rpcguard.protocol.versions import (
    HELLO_CAPS_SINCE, HELLO_REQUEST_SIZES, HELLO_RESPONSE_SIZES, KNOWN_VERSIONS, LAST_BEFORE_CAPS, spec_for,
)

PACKAGE = Path(__file__).resolve().parents[2] / "rpcguard"
_HEADER_FORMATS = {"<Q", "<BQ"}  # protocol/encode.py and protocol/framing.py hold the frame headers


def _written_again(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and all(
                isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
            value = tuple(e.value for e in node.elts)  # type: ignore[attr-defined]
            if value in KNOWN_VERSIONS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: protocol version {value}")
        if isinstance(node, ast.Constant) and node.value in _HEADER_FORMATS:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: frame header format {node.value!r}")
    return found


def test_no_protocol_version_or_header_format_outside_protocol() -> None:
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if "protocol" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(outside) > 50
    assert [hit for p in outside for hit in _written_again(p)] == []


def test_the_hello_eras_come_from_the_version_table() -> None:
    assert LAST_BEFORE_CAPS < HELLO_CAPS_SINCE and LAST_BEFORE_CAPS in KNOWN_VERSIONS
    assert not [v for v in KNOWN_VERSIONS if LAST_BEFORE_CAPS < v < HELLO_CAPS_SINCE]
    for v in KNOWN_VERSIONS:
        spec = spec_for(v)
        assert spec is not None
        assert (spec.hello_request, spec.hello_response) == ((24, 28) if v >= HELLO_CAPS_SINCE else (0, 3)), v
    assert (HELLO_REQUEST_SIZES, HELLO_RESPONSE_SIZES) == ({0, 24}, {3, 28})
