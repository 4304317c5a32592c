"""The ASan+UBSan ggml-rpc-server (built by tests/realpeer/sanitizer.sh) as the fuzz oracle.

How this works: ``SanServer`` runs the sanitizer binary on a fixed loopback port with its output
in a log file, and remembers where the log ended before each session. After a session,
``verdict()`` reads what the server wrote since then: a sanitizer report ("ERROR:
AddressSanitizer", "runtime error:", ...), a ggml abort (GGML_ASSERT / GGML_ABORT) or a dead
process is a *finding*; ``restart()`` brings a fresh server up on the same port so the
``rpcguard serve`` in front of it keeps its configuration.

Runtime options: ASan ``detect_leaks=0`` (leaks at kill are noise) and ``abort_on_error=1``;
``allocator_may_return_null=1`` with ``max_allocation_size_mb`` so a huge ALLOC_BUFFER fails as
it does with glibc instead of being reported; ``hard_rss_limit_mb`` so a runaway never takes
the shared machine down (reported as its own kind). UBSan ``halt_on_error=1`` (the build also
has -fno-sanitize-recover=undefined) and ``print_stacktrace=1``.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rpcguard.protocol.versions import KNOWN_VERSIONS
from rpcguard.proxy.readiness import hello_probe
from tests.support.realpeer import REALPEER_HOME, _read_env, reserve_port, wait_port

__all__ = ["SanServer", "Verdict", "asan_binary", "MissingSanitizerBuild", "SANITIZER_ENV", "classify_log"]

SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1:"
                    "max_allocation_size_mb=2048:hard_rss_limit_mb=3072:symbolize=1:print_summary=1",
    "UBSAN_OPTIONS": "halt_on_error=1:abort_on_error=1:print_stacktrace=1:symbolize=1",
    "GGML_NO_BACKTRACE": "1",  # ggml would otherwise attach gdb on an abort
}
# what a report looks like in the server's output, most specific first
MARKERS = (
    ("asan", re.compile(r"ERROR: AddressSanitizer: ([\w-]+)(.*)")),
    ("rss_limit", re.compile(r"AddressSanitizer: hard rss limit exhausted.*")),
    ("ubsan", re.compile(r"(\S+:\d+:\d+): runtime error: (.*)")),
    ("ubsan", re.compile(r"ERROR: UndefinedBehaviorSanitizer: (.*)")),
    ("ggml_abort", re.compile(r"^\S+\.(?:c|cpp|h):\d+: .*$", re.M)),  # ggml_abort(): "file:line: msg"
    # the plain server under valgrind memcheck (a stand-in where no ASan build is at hand: a wrapper
    # as $REALPEER_ASAN_SERVER_BIN running `valgrind --exit-on-first-error=yes ... ggml-rpc-server`)
    ("valgrind", re.compile(r"==\d+== (Invalid (?:read|write) of size \d+)\s+==\d+==\s+at 0x[0-9A-F]+: (\S+)")),
)


class MissingSanitizerBuild(RuntimeError):
    pass


def asan_binary() -> str:
    """The sanitizer server: $REALPEER_ASAN_SERVER_BIN or $REALPEER_HOME/asan.env (sanitizer.sh)."""
    path = os.environ.get("REALPEER_ASAN_SERVER_BIN") or _read_env(REALPEER_HOME / "asan.env").get(
        "REALPEER_ASAN_SERVER_BIN")
    if not path or not os.access(path, os.X_OK):
        raise MissingSanitizerBuild("sanitizer ggml-rpc-server not built: run `bash tests/realpeer/sanitizer.sh`")
    return path


@dataclass
class Verdict:
    kind: str  # "clean", "asan", "ubsan", "ggml_abort", "crash", "rss_limit"
    summary: str  # one line: what the server said
    returncode: int | None
    log: str  # the server's output since the session started (trimmed)

    @property
    def finding(self) -> bool:
        return self.kind != "clean"


def classify_log(text: str) -> tuple[str, str] | None:
    """(kind, one-line summary) of the first sanitizer report or ggml abort in ``text``."""
    for kind, rx in MARKERS:
        m = rx.search(text)
        if m:
            line = m.group(0).strip()
            if kind == "asan":  # the bug type, and the first stack frame in llama.cpp's sources
                line = "AddressSanitizer: " + m.group(1)
                frames = re.findall(r"#\d+ 0x[0-9a-f]+ in (\S+) (\S+)", text[m.end():])
                ours = [f for f in frames if "llama.cpp/" in f[1]] or frames
                if ours:
                    line += f" at {ours[0][0]} {ours[0][1].split('vendor/llama.cpp/')[-1]}"
            if kind == "valgrind":
                line = f"valgrind: {m.group(1)} at {m.group(2)}"
            return kind, line.split("vendor/llama.cpp/")[-1][:300]
    return None


class SanServer:
    """One sanitizer ggml-rpc-server process on a fixed port, restartable."""

    def __init__(self, workdir: Path, *, port: int | None = None, threads: int = 1) -> None:
        self.binary = asan_binary()
        self.workdir = workdir
        self.port = port or reserve_port()  # held for every restart: see realpeer
        self.threads = threads
        self.starts = 0
        self.popen: subprocess.Popen | None = None
        self.log_path = workdir / f"asan-rpc-server-{self.port}.log"
        self._mark = 0

    def start(self) -> None:
        self.starts += 1
        self.log_path = self.workdir / f"asan-rpc-server-{self.port}-{self.starts}.log"
        fh = open(self.log_path, "wb")
        env = dict(os.environ, **SANITIZER_ENV)
        self.popen = subprocess.Popen(
            [self.binary, "-H", "127.0.0.1", "-p", str(self.port), "-t", str(self.threads)],
            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        fh.close()
        wait_port(self.port, timeout=60, proc=self.popen)
        self._mark = self.log_path.stat().st_size

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def answers_hello(self, timeout: float = 30.0) -> bool:
        """Whether the server answers a HELLO on a new connection: it serves one connection at a
        time, so an answer means it served the previous one to its end and survived it (a
        positive signal, where a wait for a crash that does not come reads a late one as alive)."""
        ok, _ = asyncio.run(hello_probe("127.0.0.1", self.port, frozenset(KNOWN_VERSIONS), timeout))
        return ok and self.alive()

    def mark(self) -> None:
        """Remember where the log ends: ``verdict`` looks only at what comes after."""
        self._mark = self.log_path.stat().st_size

    def since_mark(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._mark)
            return f.read().decode(errors="replace")

    def verdict(self) -> Verdict:
        """What happened to the server since ``mark()``; waits for a reporting server to die."""
        text = self.since_mark()
        found = classify_log(text)
        if found is not None or not self.alive():
            deadline = time.monotonic() + 15  # ASan symbolizes before it aborts
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            text = self.since_mark()  # (complete once the server has exited)
            found = classify_log(text)
        rc = None if self.alive() else self.popen.returncode  # type: ignore[union-attr]
        if found is not None:  # keep the report from its first line (READ/WRITE of size, the stack)
            start = min((i for i in (text.find("ERROR: AddressSanitizer"), text.find("runtime error:"),
                                     text.find("GGML_ASSERT")) if i >= 0), default=0)
            start = text.rfind("\n", 0, start) + 1
            return Verdict(found[0], found[1], rc, text[start : start + 6000])
        if rc is not None:
            return Verdict("crash", f"server exited with {rc} and no report", rc, text[-6000:])
        return Verdict("clean", "", None, "")

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()
