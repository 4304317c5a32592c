"""Zero false refusals on REAL traffic (issue 3, "What must be shown").

The firewall validates every frame llama.cpp sends; a single false refusal kills the user's
session. So the real llama.cpp client runs several generated models, covering the shapes and
dtypes that change what it sends, directly against the real ggml-rpc-server and then through
``connect`` -> ``serve`` in enforce mode:

  * f32 ``tiny``, f16 ``bench`` (~105 MB), ``q8`` (Q8_0, rows a multiple of 512), ``q4`` (Q4_0),
    ``odd`` (Q8_0 rows of 160/352 elements: the client sends INIT_TENSOR and GET_ALLOC_SIZE for
    quantized tensors whose ne[0] is not a multiple of 512), ``gqa`` (8 heads, 2 KV heads) and
    ``q4k`` (Q4_K/Q5_K/Q6_K mix quantized by the real llama.cpp);
  * prompt processing of a ~220-token prompt (batched graphs) followed by generation;
  * greedy tokens identical to the direct run, ``rpcguard_refusals_total`` and
    ``rpcguard_firewall_violations_total`` 0 on both sides.

And the server's ``-c`` cache: the ``bigtensor`` model (three 23 MB tensors, above the client's
10 MiB hash threshold) loaded twice through the pair: the first load misses and uploads with
cache_flag=1, the second gets SET_TENSOR_HASH hits that serve counts as
``upload_bytes_total{kind="hash_hit"}``; tokens identical.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import realpeer

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 5)
N_TOKENS = 40  # prompt (~225) + 40 crosses the 256-cell KV padding: the decode graph changes once
CLIENT = ["-p", PROMPT, "--n-ctx", "512"]
ENFORCE = ["--mode", "enforce"]
# Generated with tests/realpeer/make_tiny_model.py --preset NAME (tiny and bench come from conftest).
PRESETS = ["tiny", "bench", "q8", "q4", "odd", "gqa", "q4k"]


@pytest.fixture(scope="module")
def fw_models(models, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fw-models")
    out = dict(models)
    for name in PRESETS + ["bigtensor"]:
        if name not in out:
            out[name] = realpeer.make_model(d / f"{name}.gguf", "--preset", name)
    return out


def assert_clean(*guards) -> None:
    """Nothing refused, no firewall rule violated (either mode), on every side."""
    for g in guards:
        refusals = {s.labels.get("reason"): s.value for s in g.samples("rpcguard_refusals_total") if s.value}
        violations = {(s.labels.get("reason"), s.labels.get("mode")): s.value
                      for s in g.samples("rpcguard_firewall_violations_total") if s.value}
        assert not refusals and not violations, (g.role, refusals, violations, g.output()[-3000:])
        assert g.value("rpcguard_sessions_total", result="refused") == 0, g.output()[-3000:]
        assert g.value("rpcguard_sessions_total", result="error") == 0, g.output()[-3000:]


def prompt_tokens(run: realpeer.ClientRun) -> int:
    m = re.search(r"prompt: (\d+) tokens", run.output)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("model", PRESETS)
def test_zero_false_refusals(fw_models, pair, rpc_server, model):
    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", fw_models[model], n=N_TOKENS, extra=CLIENT)
    assert direct.ok, direct.output[-3000:]
    assert prompt_tokens(direct) > 200 and len(direct.tokens) == N_TOKENS

    connect, serve = pair(serve_args=ENFORCE, connect_args=ENFORCE)
    guarded = realpeer.run_client(connect.endpoint, fw_models[model], n=N_TOKENS, extra=CLIENT)
    assert guarded.ok, guarded.output[-3000:] + "\n--- serve:\n" + serve.output()[-3000:] + \
        "\n--- connect:\n" + connect.output()[-3000:]
    assert guarded.tokens == direct.tokens, (guarded.tokens, direct.tokens)
    assert_clean(connect, serve)

    def frames(cmd: str) -> float:
        return serve.value("rpcguard_frames_total", command=cmd, direction="request")

    print(model, "requests seen by serve:", {s.labels["command"]: int(s.value) for s in
                                             serve.samples("rpcguard_frames_total")
                                             if s.labels["direction"] == "request" and s.value})
    # 7.0.0 sends a GRAPH_COMPUTE when the graph changes (the prompt batch, the first decode, the
    # decode after the KV view grows past 256 cells) and GRAPH_RECOMPUTE for the other tokens.
    assert frames("GRAPH_COMPUTE") >= 3, serve.metrics_text()
    assert frames("GRAPH_COMPUTE") + frames("GRAPH_RECOMPUTE") >= N_TOKENS, serve.metrics_text()
    assert connect.value("rpcguard_frames_total", command="GRAPH_COMPUTE", direction="request") \
        == frames("GRAPH_COMPUTE")
    if model in ("odd", "q4k"):
        # quantized rows not a multiple of 512 elements: ggml-rpc.cpp init_tensor / get_alloc_size
        assert frames("INIT_TENSOR") > 0 and frames("GET_ALLOC_SIZE") > 0, serve.metrics_text()
    if model in ("tiny", "bench", "gqa"):
        assert frames("INIT_TENSOR") == 0  # float types never take that path


def test_server_hash_cache_through_the_pair(fw_models, pair, workdir):
    cache = workdir / "llama-cache"
    proc, port = realpeer.start_rpc_server(workdir, cache_dir=cache)
    try:
        connect, serve = pair(serve_args=ENFORCE, connect_args=ENFORCE, upstream_port=port)
        model = fw_models["bigtensor"]

        def hits() -> float:
            return serve.value("rpcguard_upload_bytes_total", kind="hash_hit")

        # serve --upstream: the cache is every client's, so serve answers each SET_TENSOR_HASH "not
        # cached" itself (issue 28) and keeps the uploads' cache_flag off: the real client loads
        # as after any miss, and nothing of it lands in the shared cache. With a cache per identity
        # (a contained serve) the hashes reach the server: test_ops.py::test_audit_record_counts_hash_cache_hits.
        for _ in range(2):
            run = realpeer.run_client(connect.endpoint, model, n=8)
            assert run.ok, run.output[-3000:] + serve.output()[-3000:]
        assert hits() == 0
        asked = serve.value("rpcguard_frames_total", command="SET_TENSOR_HASH", direction="request")
        assert asked >= 6 and serve.value("rpcguard_hash_answered_by_proxy_total") == asked
        assert [p for p in cache.rglob("*") if p.is_file()] == []
        assert_clean(connect, serve)

        direct = realpeer.run_client(f"127.0.0.1:{port}", model, n=8)
        assert direct.ok and direct.tokens == run.tokens, direct.output[-3000:]
        assert proc.alive()
    finally:
        proc.stop()
