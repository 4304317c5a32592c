"""Find and run the REAL llama.cpp peers built by tests/realpeer/setup.sh.

Integration tests never skip when the peers are missing: they fail with the command that
builds them. ``REALPEER_PYTHON`` (a Python with llama-cpp-python built with RPC) comes from
the environment or from ``$REALPEER_HOME/env.sh`` written by setup.sh. ``REALPEER_VERSIONS``
maps other protocol versions to their own Pythons for the version matrix
(``tests/realpeer/matrix.sh`` writes ``$REALPEER_HOME/matrix.env``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REALPEER_DIR = HERE.parent / "realpeer"
REALPEER_HOME = Path(os.environ.get("REALPEER_HOME") or
                     Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rpcguard-realpeer")


class MissingPeer(RuntimeError):
    pass


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


def realpeer_python(version: str | None = None) -> str:
    """The Python with the real llama.cpp (default pin, or a matrix version like '5.0.0')."""
    if version is None:
        py = os.environ.get("REALPEER_PYTHON") or _read_env(REALPEER_HOME / "env.sh").get("REALPEER_PYTHON")
        what = "bash tests/realpeer/setup.sh"
    else:
        key = "REALPEER_PYTHON_" + version.replace(".", "_")
        py = os.environ.get(key) or _read_env(REALPEER_HOME / "matrix.env").get(key)
        what = f"bash tests/realpeer/matrix.sh {version}"
    if not py or not os.path.exists(py):
        raise MissingPeer(f"real llama.cpp peer{' ' + version if version else ''} not built: run `{what}`")
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    """Wait for a LISTEN socket on 127.0.0.1:port without connecting (the real server is single-client)."""
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as f:
            if any(l.split()[1] == want and l.split()[3] == "0A" for l in list(f)[1:]):
                return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Proc:
    """A background process whose output goes to a log file."""

    popen: subprocess.Popen
    log: Path
    name: str

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def start(cmd: list[str], log: Path, name: str, env: dict | None = None) -> Proc:
    fh = open(log, "wb")
    full_env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1", **(env or {}))
    popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    fh.close()
    return Proc(popen, log, name)


def start_rpc_server(workdir: Path, *, version: str | None = None, binary: bool = True,
                     cache_dir: Path | None = None, port: int | None = None) -> tuple[Proc, int]:
    """Start the real ggml-rpc-server (binary when built, else the ctypes runner) on loopback."""
    py = realpeer_python(version)
    port = port or free_port()
    log = workdir / f"rpc-server-{port}.log"
    server_bin = Path(subprocess.check_output(
        [py, "-c", "import importlib.util,os;s=importlib.util.find_spec('llama_cpp');"
                   "print(os.path.join(list(s.submodule_search_locations)[0],'lib','ggml-rpc-server'))"],
        text=True).strip())
    if binary and server_bin.exists():
        cmd = ["stdbuf", "-oL", str(server_bin), "-H", "127.0.0.1", "-p", str(port)]
        if cache_dir is not None:
            cmd.append("-c")
        env = {"LLAMA_CACHE": str(cache_dir)} if cache_dir is not None else None
    else:
        cmd = [py, str(REALPEER_DIR / "rpc_server.py"), f"127.0.0.1:{port}"]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        env = None
    proc = start(cmd, log, f"ggml-rpc-server:{port}", env)
    wait_port(port, proc=proc.popen)
    return proc, port


@dataclass
class ClientRun:
    rc: int
    output: str
    tokens: list[int] | None
    load_s: float | None
    gen_tps: float | None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and "RPC_CLIENT_OK" in self.output


def run_client(endpoint: str, model: Path, *, n: int = 12, version: str | None = None,
               timeout: float = 300, extra: list[str] | None = None) -> ClientRun:
    """Run the real llama.cpp client (llama-cpp-python) against ``endpoint`` and parse its result."""
    py = realpeer_python(version)
    cmd = [py, str(REALPEER_DIR / "rpc_client_smoke.py"), endpoint, "-m", str(model), "-n", str(n),
           "--no-precheck"] + (extra or [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    out = p.stdout + p.stderr
    m = re.search(r"token ids: \[([0-9, ]*)\]", out)
    tokens = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
    lm = re.search(r"load: ([0-9.]+) s", out)
    gm = re.search(r"\(([0-9.]+|inf) tok/s after the first\)", out)
    return ClientRun(p.returncode, out, tokens, float(lm.group(1)) if lm else None,
                     float(gm.group(1)) if gm else None)


def make_model(path: Path, *args: str, version: str | None = None) -> Path:
    if not path.exists():
        subprocess.run([realpeer_python(version), str(REALPEER_DIR / "make_tiny_model.py"), str(path), *args],
                       check=True, capture_output=True)
    return path


def gguf_tensor_bytes(path: Path, *, skip_prefixes: tuple[str, ...] = ("token_embd",)) -> int:
    """Bytes of the model's tensors that llama.cpp offloads (token_embd stays on the CPU)."""
    code = ("import gguf,sys;r=gguf.GGUFReader(sys.argv[1]);"
            "print(sum(int(t.n_bytes) for t in r.tensors if not t.name.startswith(tuple(sys.argv[2:]))))")
    return int(subprocess.check_output([realpeer_python(), "-c", code, str(path), *skip_prefixes], text=True))


PYTHON = sys.executable
