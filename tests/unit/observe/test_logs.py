"""Text log lines carry their time zone; JSON lines are UTC."""

from __future__ import annotations

import io
import json
import logging
import re

from rpcguard.observe.logs import setup_logging


def _line(fmt: str) -> str:
    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(fmt, "info", stream=out)
        logging.getLogger("rpcguard.test").info("hello %s", "there")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    return out.getvalue()


def test_text_lines_say_their_utc_offset(monkeypatch):
    for tz, offset in (("UTC", "+0000"), ("Asia/Kolkata", "+0530")):
        monkeypatch.setenv("TZ", tz)
        import time

        time.tzset()
        line = _line("text")
        assert re.match(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{3}} {re.escape(offset)} INFO    rpcguard\.test: "
                        r"hello there\n\Z", line), line
    monkeypatch.delenv("TZ")
    time.tzset()


def test_json_lines_are_utc():
    rec = json.loads(_line("json"))
    assert rec["ts"].endswith("Z") and rec["msg"] == "hello there"
