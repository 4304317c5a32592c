"""The tunnel with the REAL ggml-rpc-server and the REAL llama.cpp client (issue 2).

connect -> serve -> ggml-rpc-server, enforce mode: greedy tokens identical to a direct
connection, every frame counted, SET_TENSOR bytes close to the model's tensor bytes.
"""

import pytest

from tests.support import realpeer


@pytest.mark.parametrize("model", ["tiny", "bench"])
def test_tokens_identical_to_direct(models, pair, rpc_server, model):
    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", models[model], n=16)
    assert direct.ok, direct.output[-2000:]
    connect, serve = pair()
    guarded = realpeer.run_client(connect.endpoint, models[model], n=16)
    assert guarded.ok, guarded.output[-2000:] + serve.output()[-2000:]
    assert guarded.tokens == direct.tokens and len(direct.tokens) == 16
    for guard in (connect, serve):
        assert guard.value("rpcguard_refusals_total") == 0, guard.output()
        assert guard.wait_value("rpcguard_sessions_total", 7, result="ok") >= 7  # llama.cpp's serial connections
        assert guard.wait_value("rpcguard_frames_total", 1, command="GRAPH_COMPUTE", direction="request") >= 1
    assert serve.value("rpcguard_upstream_protocol_info", version="7.0.0") == 1
    # SET_TENSOR carries the offloaded weights (token_embd stays on the CPU): within a few percent.
    weights = realpeer.gguf_tensor_bytes(models[model])
    sent = serve.value("rpcguard_bytes_total", command="SET_TENSOR", direction="request")
    assert 0.97 * weights <= sent <= 1.10 * weights + 200_000, (sent, weights)
    assert serve.value("rpcguard_upload_bytes_total", kind="set_tensor") > 0.97 * weights


def test_latency_histogram_and_build_info(models, pair):
    connect, serve = pair()
    assert realpeer.run_client(connect.endpoint, models["tiny"], n=4).ok
    assert serve.value("rpcguard_command_duration_seconds_count", command="GET_ALIGNMENT") >= 1
    assert serve.value("rpcguard_command_duration_seconds_count", command="HELLO") >= 7
    assert serve.value("rpcguard_build_info") == 1
    assert connect.value("rpcguard_sessions_active") == 0


def test_clear_new_buffers_keeps_tokens_identical(models, pair, rpc_server, workdir):
    """Tenant isolation (policy.clear_new_buffers) zeroes every new buffer without changing results."""
    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", models["tiny"], n=12)
    cfg = workdir / "serve.yaml"
    cfg.write_text("policy:\n  clear_new_buffers: true\n")
    connect, serve = pair(serve_args=["--config", str(cfg)])
    guarded = realpeer.run_client(connect.endpoint, models["tiny"], n=12)
    assert guarded.ok and guarded.tokens == direct.tokens
    allocs = serve.value("rpcguard_frames_total", command="ALLOC_BUFFER", direction="request")
    clears_seen_by_client_side = connect.value("rpcguard_frames_total", command="BUFFER_CLEAR", direction="request")
    clears_sent_upstream = serve.value("rpcguard_frames_total", command="BUFFER_CLEAR", direction="request")
    assert allocs >= 1 and clears_sent_upstream == clears_seen_by_client_side + allocs
