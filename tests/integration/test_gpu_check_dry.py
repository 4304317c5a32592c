"""The GPU proof's cheap parts, dry-run against the real CPU ggml-rpc-server of b11434
(scripts/gpu_check.py --steps backend,cases,scratch,share): the server is seen as cpu (banner and
GET_ALIGNMENT), and every gap-study case goes through connect -> serve (policy.backend: cpu) ->
the server and is answered, the server alive: the CPU layer refuses none of them; the scratch
cases run and are forwarded (no pool budget on the CPU), and a session is told its memory share
and refused past it. The same steps
with --expect cuda on a GPU machine are scripts/gpu-check.sh's (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import backendops, gpucases

ROOT = Path(__file__).resolve().parents[2]


def _binaries() -> tuple[str, str, str]:
    """(server, test-backend-ops, shim): $RPCGUARD_GPU_CHECK_BIN (a CPU build of the carried tree,
    scripts/gpu-check.sh --dry-run makes one) or tests/realpeer/tools.sh's build (MissingPeer
    names the install step when neither is there)."""
    d = os.environ.get("RPCGUARD_GPU_CHECK_BIN")
    if d:
        return f"{d}/ggml-rpc-server", f"{d}/test-backend-ops", f"{d}/rpc_device_shim.so"
    t = backendops.load_tools("bin")
    return t.rpc_server, t.test_backend_ops, t.shim


def test_dry_run_backend_and_gap_cases(tmp_path):
    server, tbo, shim = _binaries()
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--server", server,
                        "--test-backend-ops", tbo, "--shim", shim, "--expect", "cpu", "--steps", "backend,cases,scratch,share",
                        "--out", str(out), "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    seen = json.loads((out / "backend.json").read_text())
    assert seen == {"alignment": 32, "detected": "cpu", "banner": {"0": "cpu"}}  # JSON keys are strings
    cases = [json.loads(line) for line in (out / "cases.json").read_text().splitlines()]
    assert [c["case"] for c in cases] == [c.name for c in gpucases.CASES], cases  # every case ran
    assert all(c["got"] == "forwarded" and c["server_alive"] for c in cases), cases
    # scratch: every case run direct (its estimate reported), forwarded through the pair on the CPU
    scratch = [json.loads(line) for line in (out / "scratch.json").read_text().splitlines()]
    assert [r["got"] for r in scratch if r.get("through") == "pair"] == ["forwarded"] * 5, scratch
    # share: the session is told its 1 GiB share, not the host's memory, and is refused past it
    share = json.loads((out / "share.json").read_text())
    assert share["told"] == [1 << 30, 1 << 30] and share["server"][1] > 1 << 30, share
    assert share["over_share"] == "device_memory_share_exceeded" and share["ok"], share
