"""scripts/gpu-check.sh and gpu_check.py, the parts that need no server: usage, a bad argument,
the server wrapper (the GPU visible again for the server only, memcheck around it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_usage_and_a_bad_argument():
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--dry-run" in out.stdout and "CMAKE_CUDA_ARCHITECTURES=90-real" in out.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu-check.sh: unknown argument --bogus"


def test_the_gpu_mode_needs_a_gpu(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OUT": str(tmp_path / "out"),
           "GPU_CHECK_WORK": str(tmp_path / "w"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env)
    if subprocess.run(["bash", "-c", "nvidia-smi -L"], capture_output=True, env=env).returncode == 0:
        return  # a GPU machine: this mode is the real run
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2 and lines[-1] == ("gpu-check.sh: no GPU (nvcc and nvidia-smi -L): this mode runs on the GPU "
                                               "machine (--dry-run here)")


def test_server_wrapper(tmp_path):
    gc = _driver()
    plain = Path(gc.server_wrapper(tmp_path, "/opt/bin/ggml-rpc-server", None, tmp_path / "x"))
    assert plain.read_text() == '#!/bin/sh\nunset CUDA_VISIBLE_DEVICES\nexec "/opt/bin/ggml-rpc-server" "$@"\n'
    san = Path(gc.server_wrapper(tmp_path, "/opt/bin/ggml-rpc-server", "/usr/bin/compute-sanitizer", tmp_path / "m"))
    text = san.read_text()
    assert "--tool memcheck" in text and f"--log-file \"{tmp_path}/m.%p\"" in text and san.stat().st_mode & 0o100
    out = subprocess.run([str(plain), "--x"], capture_output=True, text=True,
                         env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0  # /opt/bin/ggml-rpc-server does not exist here: exec fails, loudly


def test_memcheck_verdicts():
    gc = _driver()
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    assert gc.memcheck_verdict(clean, 1) == (True, "clean (1 summaries)")
    stopped = "========= COMPUTE-SANITIZER\n========= Error: process didn't terminate successfully\n"
    assert gc.memcheck_verdict(stopped, 1)[0]  # the pair stopped the server: not a finding
    bad = ("========= COMPUTE-SANITIZER\n========= Invalid __global__ write of size 2 bytes\n"
           "=========     at k_f16_copy+0x90 in fattn-common.cuh:80\n========= ERROR SUMMARY: 1 error\n")
    ok, words = gc.memcheck_verdict(bad, 1)
    assert not ok and "Invalid __global__ write" in words
    refused = "========= COMPUTE-SANITIZER\n========= Error: Device not supported\n"
    assert gc.memcheck_verdict(refused, 1) == (True, "compute-sanitizer REFUSED THE DEVICE (the cases ran without memcheck)")
    assert gc.memcheck_verdict("", 0) == (False, "NOT CHECKED: no memcheck log")
