"""Record real llama.cpp sessions per model and variant and list their ggml ops (opsurvey.py).

How this works: for each ``--preset PRESET[@DTYPE][:variant,...]`` the model is generated with
``tests/realpeer/make_tiny_model.py``; for each variant a fresh real ``ggml-rpc-server`` (two for
``split2``) runs behind a ``CaptureRelay`` (client->server only) and the real client (``llama_client.py``) runs one
session through the relay(s) with the variant's arguments. Every recorded GRAPH_COMPUTE is
decoded and folded into one ``Survey`` per model; the output is a markdown file with the union
over the models and one table per model (the tables of /work/notes/ops_seen.md):

    python -m tests.support.opsurvey_run OUT.md --preset gqa:long,fa --preset qwen2moe@q8_0:long
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.support import llamarun, realpeer
from tests.support.capture import C2S, CaptureRelay
from tests.support.opsurvey import Survey, render, render_summary, survey_stream

__all__ = ["PROMPT_LONG", "LONG", "VARIANTS", "record", "main"]

PROMPT_LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # ~270 tokens
# label -> client args (tests/support/llama_client.py). LONG: a prompt of > 256 tokens in
# ubatches of 128, so the KV view grows from 256 to 512 cells during the prompt, then 40 tokens.
LONG = ["-p", PROMPT_LONG, "--n-batch", "128", "-n", "40"]
VARIANTS = {
    "long": LONG,
    "fa": [*LONG, "--flash-attn"],
    "q8k": [*LONG, "--type-k", "q8_0"],  # a quantized V cache needs flash attention
    "fa+q8kv": [*LONG, "--flash-attn", "--type-k", "q8_0", "--type-v", "q8_0"],
    "embed": ["-p", PROMPT_LONG, "--embed", "--pooling", "1"],  # mean
    "embed-cls": ["-p", PROMPT_LONG, "--embed", "--pooling", "2"],
    "embed-last": ["-p", PROMPT_LONG, "--embed", "--pooling", "3"],
    "split2": [*LONG],  # two RPC servers
    "hybrid": [*LONG, "--n-gpu-layers", "2"],  # the output and the last layer remote
}


def record(workdir, model, args: list[str], n_servers: int = 1) -> tuple[Survey, str]:
    """One real client run through a CaptureRelay per real server; its survey and output."""
    procs, relays = [], []
    try:
        for _ in range(n_servers):
            proc, port = realpeer.start_rpc_server(workdir)
            procs.append(proc)
            relays.append(CaptureRelay(port, (C2S,)))
        run = llamarun.run_llama([r.endpoint for r in relays], model, args)
        if not run.ok:
            raise RuntimeError(f"client failed ({run.rc}):\n{run.output[-3000:]}")
    finally:
        for p in procs:
            p.stop()
        for r in relays:
            r.close()
    s = Survey()
    for r in relays:
        for conn in r.conns:
            survey_stream(conn.stream(C2S), out=s)
    return s, run.output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="record real llama.cpp graphs per model and list their ggml ops")
    ap.add_argument("output", help="markdown file to write")
    ap.add_argument("--preset", action="append", required=True,
                    help="PRESET[@DTYPE][:variant,variant...] of make_tiny_model.py (variants: %s)"
                         % ",".join(VARIANTS))
    a = ap.parse_args(argv)
    sections, surveys = [], {}
    with tempfile.TemporaryDirectory(prefix="opsurvey-") as tmp:
        work = Path(tmp)
        for spec in a.preset:
            preset, _, vs = spec.partition(":")
            variants = tuple(vs.split(",")) if vs else ("long", "fa+q8kv")
            name, _, dtype = preset.partition("@")
            model = realpeer.make_model(work / f"{preset}.gguf", "--preset", name,
                                        *(["--dtype", dtype] if dtype else []))
            total = Survey()
            for v in variants:
                s, out = record(work, model, VARIANTS[v], 2 if v == "split2" else 1)
                total.merge(s, v)
                print(f"{preset} {v}: {s.graphs} graphs, {len(s.ops)} ops", flush=True)
            surveys[preset] = total
            sections.append(render(preset, total, "variants: " + ", ".join(
                f"`{v}` ({' '.join(x for x in VARIANTS[v] if x != PROMPT_LONG)})" for v in variants), variants))
    Path(a.output).write_text("## Union over the models\n\n" + render_summary(surveys)
                              + "\n## Per model\n\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
