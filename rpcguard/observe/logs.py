"""Logging set-up: human-readable lines by default, JSON lines with ``--log-format json``.

How this works: every module logs through the standard ``logging`` package. The session end
line of ``link.Link`` carries the full audit record (identity, peer, listener, upstream,
protocol version, duration, frames and bytes per command, result and refusal reason) in
``extra={"audit": ...}``; the JSON formatter emits that record as the line's fields, the text
formatter keeps the one-line summary. Only the CLI calls ``setup_logging``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging", "JsonFormatter", "TextFormatter"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus the audit record if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        audit = getattr(record, "audit", None)
        if audit:
            out.update(audit)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; a session end line also gets the audit fields its message lacks
    (upstream, protocol version, duration, model bytes, and ``request_checks=node`` when connect
    left the request firewall to its node), before the free-text ``detail=``. Times are local
    with their UTC offset (``2026-12-01 22:10:03.123 +0000``): a line read on another host, or
    next to a JSON log (UTC), says which time it is."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 (logging's name)
        local = time.localtime(record.created)
        return (time.strftime("%Y-%m-%d %H:%M:%S", local) + f".{int(record.msecs):03d} "
                + time.strftime("%z", local))

    def format(self, record: logging.LogRecord) -> str:
        audit = getattr(record, "audit", None)
        if not audit:
            return super().format(record)
        msg = record.getMessage()
        extra = []
        for key, value in (("upstream", audit.get("upstream")), ("version", audit.get("version")),
                           ("duration", f"{audit.get('duration_s') or 0:.3f}s"),
                           ("alloc_bytes", audit.get("alloc_bytes")), ("upload_bytes", audit.get("upload_bytes")),
                           ("hash_answered_by_proxy", audit.get("hash_answered_by_proxy")),
                           ("request_checks", "node" if audit.get("request_checks") == "node" else None)):
            if value not in (None, "", 0) and f" {key}=" not in msg:
                extra.append(f"{key}={value}")
        if extra:
            text = " ".join(extra)
            msg = msg.replace(" detail=", f" {text} detail=", 1) if " detail=" in msg else f"{msg} {text}"
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = msg, None
        return super().format(copy)


def setup_logging(fmt: str = "text", level: str = "info", stream=None) -> None:
    """Configure the root logger once (the CLI calls this)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # handshake noise is counted by rpcguard
