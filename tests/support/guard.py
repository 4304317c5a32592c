"""Run rpcguard itself as a real process (python -m rpcguard) and read its metrics."""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from rpcguard.pki import certs
from rpcguard.cli import READY_MESSAGE
from tests.support.realpeer import PYTHON, Proc, accept_queue, start, wait_port


@dataclass
class Pki:
    """A private CA with a node (server) and a client certificate, minted per test session."""

    dir: Path
    node: str = "node1"
    client: str = "client1"

    def __post_init__(self) -> None:
        certs.init_ca(self.dir, force=True)
        certs.issue(self.dir, self.node, server=True, dns=[self.node], ips=["127.0.0.1"], force=True)
        certs.issue(self.dir, self.client, server=False, force=True)

    def path(self, name: str, ext: str = "pem") -> str:
        return str(self.dir / f"{name}.{ext}")

    def issue(self, name: str, **kw) -> tuple[str, str]:
        files = certs.issue(self.dir, name, force=True, **kw)
        return str(files.cert), str(files.key)

    def serve_args(self) -> list[str]:
        return ["--cert", self.path(self.node), "--key", self.path(self.node, "key"), "--ca", self.path("ca")]

    def connect_args(self, cert: str | None = None, key: str | None = None, ca: str | None = None) -> list[str]:
        return ["--cert", cert or self.path(self.client), "--key", key or self.path(self.client, "key"),
                "--ca", ca or self.path("ca")]


@dataclass
class Guard:
    """A running rpcguard serve/connect process."""

    proc: Proc
    port: int
    metrics_port: int
    role: str
    extra: dict = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as rsp:
            return rsp.read().decode()

    def samples(self, name: str) -> list:
        out = []
        for fam in text_string_to_metric_families(self.metrics_text()):
            out.extend(s for s in fam.samples if s.name == name)
        return out

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(s.value for s in self.samples(name) if all(s.labels.get(k) == v for k, v in labels.items()))

    def wait_value(self, name: str, minimum: float, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            v = self.value(name, **labels)
            if v >= minimum or time.monotonic() > deadline:
                return v
            time.sleep(0.05)

    def wait_quiet(self, timeout: float = 30.0) -> None:
        """Wait until every connection made to the listener so far has been accepted (its accept
        queue is empty) and has ended as a session (``rpcguard_sessions_active`` 0 in two scrapes
        in a row: a link counts as active from the loop step after its accept, and the second
        scrape is answered after that step). A connection from a client that has exited is then
        counted in ``rpcguard_sessions_total``."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while quiet < 2:
            if accept_queue(self.port) == 0 and self.value("rpcguard_sessions_active") == 0:
                quiet += 1
                continue
            quiet = 0
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role}: sessions still running or connections not accepted "
                                     f"after {timeout} s (accept queue {accept_queue(self.port)})")
            time.sleep(0.05)

    def output(self) -> str:
        return self.proc.output()

    def logged(self, text: str, timeout: float = 10.0) -> bool:
        """Whether ``text`` is in the output, waited for: a client can see a refusal or a close
        before the line about it is written (the answer goes out first)."""
        deadline = time.monotonic() + timeout
        while text not in self.proc.output():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, **kw) -> int:
        return self.proc.stop(**kw)


# What rpcguard logs once it has bound a port (proxy/listeners.py): "<role> <name> listening on
# <host>:<port> -> <upstream>" per listener or tunnel, "metrics on http(s)://<host>:<port>/metrics".
LISTENING = re.compile(r"(\S+) listening on (\S+):(\d+) -> ")
METRICS_ON = re.compile(r"metrics on https?://\S+:(\d+)/metrics")


def bound_ports(text: str) -> dict[str, int]:
    """Listener/tunnel name -> the port it bound, from a log (the first line of each name)."""
    out: dict[str, int] = {}
    for m in LISTENING.finditer(text):
        out.setdefault(m.group(1), int(m.group(3)))
    return out


def bound_metrics_port(text: str) -> int | None:
    m = METRICS_ON.search(text)
    return int(m.group(1)) if m else None


def start_guard(role: str, workdir: Path, args: list[str], *, port: int | None = None,
                env: dict | None = None, ready: bool = True) -> Guard:
    """Start ``rpcguard ROLE ARGS --listen 127.0.0.1:PORT --metrics 127.0.0.1:0`` and wait for it.

    Without ``port`` it listens on port 0: the ports it bound are read from its log once it is
    ready, so no other process can take them between choosing and binding."""
    # serve's own options before a ``-- COMMAND`` (the server serve runs), which takes the rest
    args, command = (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
    allow_flags = ("--allow-cn", "--allow-dns", "--allow-uri", "--allow-ip", "--allow-all")
    if role == "serve" and not any(a.split("=", 1)[0] in allow_flags for a in args):
        # serve refuses an empty allow-list; these fixtures admit any certificate of their CA
        # unless a config file given with --config has its own allow-list.
        cfg = args[args.index("--config") + 1] if "--config" in args else None
        if cfg is None or "allow:" not in Path(cfg).read_text():
            args = [*args, "--allow-all"]
    cmd = [PYTHON, "-m", "rpcguard", role, "--listen", f"127.0.0.1:{port or 0}", "--metrics", "127.0.0.1:0",
           *args]
    if role == "connect" and "--no-check" not in args:
        cmd.append("--no-check")
    cmd += command
    proc = start(cmd, workdir / f"rpcguard-{role}-{port or time.monotonic_ns()}.log", f"rpcguard {role}", env)
    if not ready:
        return Guard(proc, port or 0, 0, role)
    wait_for_line(proc, READY_MESSAGE)
    text = proc.output()
    bound = port or next(iter(bound_ports(text).values()))
    wait_port(bound, proc=proc.popen)
    return Guard(proc, bound, bound_metrics_port(text) or 0, role)


def wait_for_line(proc: Proc, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.output()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} did not print {text!r}:\n{proc.output()}")
        time.sleep(0.02)


def start_pair(workdir: Path, pki: Pki, upstream_port: int, guards: list[Guard],
               serve_args=(), connect_args=()) -> tuple[Guard, Guard]:
    """connect -> serve -> 127.0.0.1:upstream_port; both are appended to ``guards`` for cleanup."""
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{upstream_port}", *pki.serve_args(),
                                           *serve_args])
    guards.append(serve)
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args(), *connect_args])
    guards.append(connect)
    return connect, serve
