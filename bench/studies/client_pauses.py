#!/usr/bin/env python3
"""How long the real llama.cpp client pauses between its requests (issue 21: the fair slot).

A session is ended for ``limits.idle_while_waiting_s`` only while another one waits for the
node's server, so the default must sit well above the pauses llama.cpp makes on its own in the
middle of its work (model load, prompt, generation). This runs the real client
(llama-cpp-python, ``tests/realpeer/rpc_client_smoke.py`` and ``tests/support/longclient.py``)
straight to the real ``ggml-rpc-server`` through a timestamping TCP relay (no rpcguard) and
prints, per model, the longest silences of the connection split by whose turn it was:

* ``client``: the last bytes went to the client, the client is thinking (its own pause);
* ``server``: the last bytes went to the server (it computes; a request is running).

Between two generations of one ``longclient.py`` run the pause is the test's own (a file it
waits for), so only pauses inside a run are reported. ``--client llama-server`` runs the real
``llama-server`` of the llama.cpp tools build instead (``tests/realpeer/tools.sh``) and sends it
two completions back to back (its pauses then include the HTTP round trips between them, so
they can only be longer than llama.cpp's own).

    .venv/bin/python bench/studies/client_pauses.py [--tokens 64] [--models tiny,bench] [--client llama-server]
"""

from __future__ import annotations

import argparse
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import realpeer  # noqa: E402


class Relay(threading.Thread):
    """client <-> server on loopback, noting (time, direction, bytes) of every read."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(daemon=True)
        self.upstream_port = upstream_port
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.events: list[tuple[float, str, int]] = []  # per accepted connection, in order
        self.stop = False

    def run(self) -> None:
        self.lsock.settimeout(0.2)
        while not self.stop:
            try:
                c, _ = self.lsock.accept()
            except socket.timeout:
                continue
            s = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(c, s), daemon=True).start()

    def _pump(self, c: socket.socket, s: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(c, selectors.EVENT_READ, (s, "to_server"))
        sel.register(s, selectors.EVENT_READ, (c, "to_client"))
        while True:
            for key, _ in sel.select(1.0):
                dst, way = key.data
                data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
                if not data:
                    c.close()
                    s.close()
                    return
                self.events.append((time.monotonic(), way, len(data)))
                dst.sendall(data)


def pauses(events: list[tuple[float, str, int]]) -> dict[str, list[float]]:
    """Silences between consecutive reads, by whose turn it was (see the module docstring)."""
    out: dict[str, list[float]] = {"client": [], "server": []}
    for (t0, way, _), (t1, _, _) in zip(events, events[1:]):
        out["client" if way == "to_client" else "server"].append(t1 - t0)
    return out


def run_llama_server(work: Path, model: Path, port: int, tokens: int) -> bool:
    """The real llama-server through the relay: loaded, then two completions back to back."""
    from tests.support import llamatools as lt

    srv = lt.start_llama_server(lt.tools(), work, model, [f"127.0.0.1:{port}"], [*lt.SERVER], "pauses")
    try:
        for _ in range(2):
            if not srv.complete(lt.PROMPT, tokens, cache_prompt=False):
                return False
    finally:
        srv.stop()
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--models", default="tiny,bench")
    ap.add_argument("--client", choices=("python", "llama-server"), default="python")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pauses-"))
    py = realpeer.realpeer_python()
    presets = {"tiny": [], "bench": ["--preset", "bench"]}
    worst = 0.0
    for name in a.models.split(","):
        model = realpeer.make_model(work / f"{name}.gguf", *presets[name])
        proc, port = realpeer.start_rpc_server(work)
        relay = Relay(port)
        relay.start()
        try:
            t0 = time.monotonic()
            if a.client == "llama-server":
                if not run_llama_server(work, model, relay.port, a.tokens):
                    return 1
            else:
                done = work / "go"
                done.touch()  # the second round starts at once: only llama.cpp's own pauses remain
                cmd = [py, str(ROOT / "tests" / "support" / "longclient.py"), f"127.0.0.1:{relay.port}", "-m",
                       str(model), "-n", str(a.tokens), "--wait", str(done)]
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if "LONGCLIENT_OK" not in run.stdout:
                    print(run.stdout[-2000:], run.stderr[-2000:])
                    return 1
            wall = time.monotonic() - t0
        finally:
            relay.stop = True
            proc.stop()
        p = pauses(relay.events)
        for who in ("client", "server"):
            gaps = sorted(p[who], reverse=True)
            worst = max(worst, gaps[0]) if who == "client" and gaps else worst
            print(f"{name:5s} {who:6s} reads={len(gaps):6d} longest pauses (s): "
                  + ", ".join(f"{g:.3f}" for g in gaps[:5]))
        print(f"{name:5s} whole run {wall:.1f} s, {len(relay.events)} reads, {a.tokens} tokens x 2 rounds ({a.client})")
    print(f"longest pause of the client between its requests: {worst:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
