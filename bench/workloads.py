"""The benchmark workloads and their models: what bench/run.py measures, in one table.

How this works: ``WORKLOADS`` maps a workload name to its definition: the kind of client (the
real llama.cpp client, or a synthetic bench/protoclient.py session), the figure it yields and
whether higher is better, the repetitions (default and ``--quick``), the model it loads, the
issue 4 ratio target, and which phase's proxy CPU is divided by which unit of work
(bench/cpuacct.py). Models are generated once by the real peer's ``make_tiny_model.py`` (seed 0,
so greedy tokens are reproducible) into the bench cache, with the bytes llama.cpp offloads
cached beside each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tests.support import realpeer

__all__ = ["CACHE", "MODELS", "Workload", "WORKLOADS", "DEFAULT_WORKLOADS", "model_path", "offloaded_bytes"]

CACHE = Path(os.environ.get("RPCGUARD_BENCH_CACHE") or Path.home() / ".cache" / "rpcguard-bench")

# name -> make_tiny_model.py arguments (weights from --seed 0, so files are reproducible)
MODELS = {
    "tiny": [],  # 0.6 MB f32
    "bench": ["--preset", "bench"],  # ~105 MB f16, largest tensor 5.8 MB
    "load400": ["--preset", "bench", "--n-layer", "16"],  # ~413 MB f16, same tensor sizes as bench
    # ~440 MB f16 with three 134 MB FFN tensors: one SET_TENSOR frame of 134 MB each
    "bigtensor": ["--preset", "bigtensor", "--n-embd", "2048", "--n-ff", "32768", "--n-layer", "1"],
}


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    kind: str  # "client" (real llama.cpp), "bulk", "ping" or "burst" (bench/protoclient.py)
    unit: str
    higher_better: bool
    reps: int
    quick_reps: int
    model: str = ""
    n_tokens: int = 0
    target: float | None = None  # minimum rpcguard/direct ratio (issue 4)
    cpu_phase: str = "all"  # the phase whose proxy CPU is reported (bench/cpuacct.py): load, gen, all
    cpu_unit: str = "repetition"  # the unit of work CPU is divided by


WORKLOADS = {w.name: w for w in (
    Workload("load", "model load, ~413 MB f16 (offloaded MB / Llama() seconds)", "client", "MB/s", True,
             7, 2, "load400", 4, 0.6, "load", "MB"),
    Workload("gen100", "generation, ~105 MB model, 64 tokens (tok/s after the first)", "client", "tok/s", True,
             7, 2, "bench", 64, 0.97, "gen", "token"),
    Workload("gentiny", "generation, tiny 0.6 MB model, 128 tokens (tok/s after the first)", "client", "tok/s",
             True, 15, 3, "tiny", 128, 0.75, "gen", "token"),
    Workload("bulk", "synthetic SET_TENSOR upload, 512 MiB in 8 MiB frames", "bulk", "MB/s", True, 5, 2,
             cpu_unit="MB"),
    Workload("ping", "synthetic GET_ALIGNMENT round trip, 2000 pings (median of the run)", "ping", "us", False,
             5, 2, cpu_unit="round trip"),
    Workload("burst", "synthetic decode-step shape: 5 small SET_TENSOR + GET_TENSOR round trip, 1000 steps",
             "burst", "us", False, 5, 2, cpu_unit="step"),
    Workload("rss", "rpcguard peak RSS vs tensor size (fresh pair per case)", "rss", "MB", False, 1, 1),
)}
DEFAULT_WORKLOADS = ("load", "gen100", "gentiny", "bulk", "ping", "burst", "rss")


def model_path(name: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return realpeer.make_model(CACHE / f"{name}.gguf", *MODELS[name])


def offloaded_bytes(path: Path) -> int:
    """Bytes llama.cpp uploads over RPC (all tensors but token_embd), cached beside the model."""
    side = path.with_suffix(".bytes")
    if side.exists() and side.stat().st_mtime >= path.stat().st_mtime:
        return int(side.read_text())
    n = realpeer.gguf_tensor_bytes(path)
    side.write_text(str(n))
    return n
