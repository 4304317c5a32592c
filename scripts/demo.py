"""A guarded real llama.cpp session on loopback, end to end (run by scripts/demo.sh).

1. a private CA and certificates in certs/demo/ (``rpcguard certs``),
2. a small generated GGUF model,
3. the real ggml-rpc-server on 127.0.0.1, ``rpcguard serve`` in front of it (mTLS),
   ``rpcguard connect`` next to the client,
4. the real llama.cpp client (llama-cpp-python) loading the model through the tunnel and
   generating tokens, then the same client directly against the server to compare tokens,
5. a per-command summary read from rpcguard's own /metrics endpoints.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
REALPEER = ROOT / "tests" / "realpeer"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listen(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"demo: a process exited early (code {proc.returncode}); see the logs in {LOGS}")
        with open("/proc/net/tcp") as f:
            if any(line.split()[1] == want and line.split()[3] == "0A" for line in list(f)[1:]):
                return
        time.sleep(0.05)
    sys.exit(f"demo: nothing listening on port {port} after {timeout} s")


def metrics(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
        text = rsp.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def client(peer_py: str, endpoint: str, model: Path, n: int) -> tuple[list[int], str]:
    p = subprocess.run([peer_py, str(REALPEER / "rpc_client_smoke.py"), endpoint, "-m", str(model), "-n", str(n),
                        "--no-precheck"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    out = p.stdout + p.stderr
    m = re.search(r"token ids: \[([0-9, ]*)\]", out)
    if p.returncode != 0 or not m:
        sys.exit(f"demo: the llama.cpp client failed (exit {p.returncode}):\n{out[-3000:]}")
    return [int(x) for x in m.group(1).split(",") if x.strip()], out


def summary(m: dict[str, list], role: str) -> list[str]:
    rows: dict[str, dict[str, float]] = {}
    for s in m.get("rpcguard_frames_total", []):
        rows.setdefault(s.labels["command"], {})[f"{s.labels['direction']}_frames"] = s.value
    for s in m.get("rpcguard_bytes_total", []):
        rows.setdefault(s.labels["command"], {})[f"{s.labels['direction']}_bytes"] = s.value
    lat: dict[str, tuple[float, float]] = {}
    for s in m.get("rpcguard_command_duration_seconds_sum", []):
        lat.setdefault(s.labels["command"], (0.0, 0.0))
        lat[s.labels["command"]] = (s.value, lat[s.labels["command"]][1])
    for s in m.get("rpcguard_command_duration_seconds_count", []):
        total = lat.get(s.labels["command"], (0.0, 0.0))[0]
        lat[s.labels["command"]] = (total, s.value)
    lines = [f"  {role:<8} {'command':<22} {'req frames':>10} {'req bytes':>12} {'rsp frames':>10} "
             f"{'rsp bytes':>12} {'mean rtt':>9}"]
    for cmd, r in sorted(rows.items(), key=lambda kv: -kv[1].get("request_bytes", 0)):
        total, count = lat.get(cmd, (0.0, 0.0))
        rtt = f"{1e6 * total / count:7.0f}us" if count else "        -"
        lines.append(f"  {'':<8} {cmd:<22} {r.get('request_frames', 0):>10.0f} {r.get('request_bytes', 0):>12.0f} "
                     f"{r.get('response_frames', 0):>10.0f} {r.get('response_bytes', 0):>12.0f} {rtt:>9}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="store_true", help="use the ~105 MB model")
    ap.add_argument("-n", type=int, default=16, help="tokens to generate")
    a = ap.parse_args()
    peer_py = os.environ.get("REALPEER_PYTHON")
    if not peer_py:
        sys.exit("demo: REALPEER_PYTHON is not set; run scripts/demo.sh")
    certs, cache = ROOT / "certs" / "demo", ROOT / ".cache"
    cache.mkdir(exist_ok=True)
    global LOGS
    LOGS = cache / "demo-logs"
    LOGS.mkdir(exist_ok=True)
    rg = [PY, "-m", "rpcguard"]

    print("1. certificates (private CA, node and client)", flush=True)
    # A new CA on every run, so the node and client certificates are issued anew too (--force):
    # the demo can be run again.
    subprocess.run(rg + ["certs", "init-ca", str(certs), "--force"], check=True)
    subprocess.run(rg + ["certs", "issue", str(certs), "node1", "--server", "--dns", "node1", "--ip", "127.0.0.1",
                         "--force"], check=True)
    subprocess.run(rg + ["certs", "issue", str(certs), "client1", "--client", "--force"], check=True)
    preset = "bench" if a.bench else "tiny"
    model = cache / f"demo-{preset}.gguf"
    if not model.exists():
        print(f"2. generating the {preset} model", flush=True)
        subprocess.run([peer_py, str(REALPEER / "make_tiny_model.py"), str(model), "--preset", preset], check=True)
    else:
        print(f"2. model {model} ({model.stat().st_size / 1e6:.1f} MB)", flush=True)

    ports = {k: free_port() for k in ("server", "serve", "connect", "m_serve", "m_connect")}
    procs: list[subprocess.Popen] = []

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(LOGS / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1"))
        procs.append(p)
        return p

    try:
        print(f"3. real ggml-rpc-server :{ports['server']}  <- rpcguard serve :{ports['serve']} (mTLS)"
              f"  <- rpcguard connect :{ports['connect']}", flush=True)
        server = spawn("ggml-rpc-server", [peer_py, str(REALPEER / "rpc_server.py"), f"127.0.0.1:{ports['server']}"])
        wait_listen(ports["server"], server)
        serve = spawn("serve", rg + ["serve", "--listen", f"127.0.0.1:{ports['serve']}",
                                     "--upstream", f"127.0.0.1:{ports['server']}",
                                     "--cert", str(certs / "node1.pem"), "--key", str(certs / "node1.key"),
                                     "--ca", str(certs / "ca.pem"), "--allow-cn", "client1",
                                     "--metrics", f"127.0.0.1:{ports['m_serve']}"])
        wait_listen(ports["serve"], serve)
        connect = spawn("connect", rg + ["connect", "--listen", f"127.0.0.1:{ports['connect']}",
                                         "--server", f"127.0.0.1:{ports['serve']}", "--server-name", "node1",
                                         "--cert", str(certs / "client1.pem"), "--key", str(certs / "client1.key"),
                                         "--ca", str(certs / "ca.pem"), "--metrics", f"127.0.0.1:{ports['m_connect']}"])
        wait_listen(ports["connect"], connect)

        print(f"4. llama.cpp --rpc 127.0.0.1:{ports['connect']}  (through rpcguard)", flush=True)
        t0 = time.monotonic()
        guarded, out = client(peer_py, f"127.0.0.1:{ports['connect']}", model, a.n)
        print("   " + "\n   ".join(l for l in out.splitlines() if l.startswith(("load:", "generated", "token ids"))))
        print(f"   ({time.monotonic() - t0:.1f} s)")
        print(f"   llama.cpp --rpc 127.0.0.1:{ports['server']}  (direct, to compare)", flush=True)
        direct, _ = client(peer_py, f"127.0.0.1:{ports['server']}", model, a.n)
        same = guarded == direct
        print(f"   tokens identical to the direct run: {'yes' if same else 'NO'}")

        print("5. what rpcguard saw (from its /metrics)")
        for role, port in (("serve", ports["m_serve"]), ("connect", ports["m_connect"])):
            m = metrics(port)
            for line in summary(m, role):
                print(line)
            refused = {s.labels["reason"]: s.value for s in m.get("rpcguard_refusals_total", []) if s.value}
            sessions = {s.labels["result"]: s.value for s in m.get("rpcguard_sessions_total", [])}
            print(f"  {role:<8} sessions {sessions}, refusals {refused or 'none'}")
        print(f"   logs: {LOGS}")
        if not same:
            print("DEMO_FAILED: tokens differ")
            return 1
        print("DEMO_OK: a real llama.cpp session ran through mutual TLS with every frame checked")
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


LOGS = Path(".")

if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:  # the step printed its own error above
        sys.exit(f"demo: step failed (exit {exc.returncode}): {' '.join(map(str, exc.cmd))}")
