"""The end notice: how serve tells connect why it ended a session (issue 31.3).

How this works: ggml-rpc has no error frame, so a session that serve ends in the middle (a
refused frame, a fair-slot end, a revoked certificate at reload, the client certificate's
notAfter, a drain) used to reach the llama.cpp user as a bare close ("Remote RPC server
crashed"), its reason only in the node's log on another machine. When both ends said in the
TLS handshake that they know the notice (pki/tls.py: the ``+notice`` ALPN forms), serve writes
one notice to connect just before it closes, in place of a response header and only at a
response boundary (never inside a response), and connect logs it as one line next to
llama-server.

On the wire a notice is a response header whose u64 size is ``NOTICE_SIZE`` (the bytes
``\\xff\\xffrgEND\\x01``, about 9.1e16, 81 PB: above any size a response may have, so a peer that does not
know the notice refuses it as ``response_size_invalid`` rather than misreading it) followed by
``NOTICE_HEAD`` bytes: the reason (snake_case ASCII), a NUL, the detail (UTF-8, cut to fit), NUL
padding; no control character in the detail (it ends up in a log line). The head has a fixed size so that FrameReader handles it like any response head, whole,
byte by byte or split anywhere. A notice is the last thing serve sends on the connection.
"""

from __future__ import annotations

import re
import struct
from typing import Final, NamedTuple

from rpcguard.errors import ProtocolRefusal

__all__ = ["NOTICE_SIZE", "NOTICE_HEAD", "NOTICE_BYTES", "Notice", "encode_notice", "decode_notice"]

NOTICE_SIZE: Final = struct.unpack("<Q", b"\xff\xffrgEND\x01")[0]
NOTICE_HEAD: Final = 256  # reason NUL detail NUL-padding
NOTICE_BYTES: Final = 8 + NOTICE_HEAD
_REASON = re.compile(rb"[a-z][a-z0-9_]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # never in a detail: it goes into a log line as it is


class Notice(NamedTuple):
    reason: str  # the stable reason string serve ended the session with
    detail: str  # free text for people


def encode_notice(reason: str, detail: str = "") -> bytes:
    """The bytes serve writes: header and head (``NOTICE_BYTES`` long)."""
    r = reason.encode("ascii")
    if not _REASON.fullmatch(r):
        raise ValueError(f"not a reason string: {reason!r}")
    room = NOTICE_HEAD - len(r) - 1
    d = _CONTROL.sub(" ", detail).encode("utf-8")[:room]
    d = d.decode("utf-8", "ignore").encode("utf-8")  # never cut a character in half
    return struct.pack("<Q", NOTICE_SIZE) + (r + b"\0" + d).ljust(NOTICE_HEAD, b"\0")


def decode_notice(head: memoryview | bytes) -> Notice:
    """The head of a notice (``NOTICE_HEAD`` bytes after the header); a malformed one is the node's
    fault: ``notice_invalid``."""
    if len(head) != NOTICE_HEAD:
        raise ProtocolRefusal("notice_invalid", f"end notice of {len(head)} bytes, expected {NOTICE_HEAD}")
    raw = bytes(head)
    reason, sep, rest = raw.partition(b"\0")
    if not sep or not _REASON.fullmatch(reason):
        raise ProtocolRefusal("notice_invalid", "end notice without a reason string")
    detail = rest.rstrip(b"\0")
    if b"\0" in detail:
        raise ProtocolRefusal("notice_invalid", "end notice with bytes after its padding")
    try:
        text = detail.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolRefusal("notice_invalid", "end notice detail is not UTF-8") from None
    if _CONTROL.search(text):
        raise ProtocolRefusal("notice_invalid", "end notice detail with control characters")
    return Notice(reason.decode("ascii"), text)
