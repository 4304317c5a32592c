"""The 34 exploit corpus cases sent straight to the UNPROTECTED sanitizer server (documentation).

    python -m tests.fuzz.corpus_asan [--json FILE]

How this works: for every case of tests/corpus/exploits.py that applies to 7.0.0 (dangerous ones
included: this server runs on loopback under ASan, which is the point), a fresh ASan+UBSan
ggml-rpc-server gets HELLO, the corpus preamble and the case's frames without any proxy
(tests/integration/test_corpus_real.py's ``attack``). One line per case: what the sanitizer
said (or the server's own refusal), for docs/sanitizer.md. Not a test: it never fails.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.corpus import CASES  # noqa: E402
from tests.fuzz.sanserver import SanServer  # noqa: E402
from tests.integration.test_corpus_real import VERSION, attack  # noqa: E402

__all__ = ["main"]

# the server's start-up banner and connection lines: not what it said about the case
BANNER = ("client connection", "Client connection", "Starting RPC server", "endpoint", "local cache", "Devices:",
          "CPU:", "transport")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write one record per case here")
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="corpus-asan-") as tmp:
        server = SanServer(Path(tmp))
        server.start()
        try:
            for case in [c for c in CASES if c.applies(VERSION)]:
                if not server.alive():
                    server.restart()
                server.mark()
                try:
                    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                        got = attack(s, case)
                    ending = got.ending
                except (OSError, EOFError, AssertionError) as exc:
                    ending = f"error: {exc}"[:80]
                v = server.verdict()
                own = next((l.strip() for l in server.since_mark().splitlines()
                            if l.strip() and not any(x in l for x in BANNER)), "(nothing logged)")
                what = v.summary if v.finding else f"no report, server alive; {own.split('vendor/llama.cpp/')[-1][:120]}"
                rows.append({"case": case.id, "dangerous": case.dangerous, "verdict": v.kind, "summary": what,
                             "ending": ending})
                print(f"{case.id:42s} {'D' if case.dangerous else ' '} {v.kind:10s} {what}", flush=True)
                if v.finding or ending == "timeout":
                    server.restart()
        finally:
            server.stop()
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"{len(rows)} cases: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
