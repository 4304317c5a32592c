"""Run the real llama.cpp client of ``tests/support/llama_client.py`` and parse its result.

How this works: the client runs as a subprocess of the real peer's Python (a refused or dropped
RPC connection aborts it, spec caveat 3), with one or more RPC endpoints and the context knobs
the multi-architecture tests vary; its output gives the greedy token ids or the pooled embedding.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support import realpeer

__all__ = ["LlamaRun", "run_llama", "CLIENT"]

CLIENT = Path(__file__).resolve().parent / "llama_client.py"


@dataclass
class LlamaRun:
    rc: int
    output: str
    tokens: list[int] | None
    embedding: list[float] | None
    prompt_tokens: int
    seconds: float | None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and "LLAMA_CLIENT_OK" in self.output

    @property
    def result(self) -> list | None:
        """What must be identical between a direct and a guarded run."""
        return self.embedding if self.embedding is not None else self.tokens


def run_llama(endpoints: list[str], model: Path, args: list[str] = (), *, timeout: float = 300) -> LlamaRun:
    """The real client against ``endpoints`` (one RPC device each) with ``args`` (see llama_client.py)."""
    cmd = [realpeer.realpeer_python(), str(CLIENT), *endpoints, "-m", str(model), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    out = p.stdout + p.stderr
    m = re.search(r"token ids: \[([0-9, ]*)\]", out)
    tokens = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
    e = re.search(r"embedding: \[([^\]]*)\]", out)
    embedding = [float(x) for x in e.group(1).split(",") if x.strip()] if e else None
    pt = re.search(r"prompt: (\d+) tokens", out)
    rs = re.search(r"run: ([0-9.]+) s", out)
    return LlamaRun(p.returncode, out, tokens, embedding, int(pt.group(1)) if pt else 0,
                    float(rs.group(1)) if rs else None)
