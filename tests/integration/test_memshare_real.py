"""The device memory share per session (protocol/memshare.py, issue 31 item 1) against the REAL
ggml-rpc-server: a contained serve (one server process per session, so two sessions run at once)
with ``policy.device_memory_share_bytes`` smaller than the node's memory. Each session is told
its share in GET_DEVICE_MEMORY where the server says the host's memory, an ALLOC_BUFFER past the
share is refused ``device_memory_share_exceeded`` before the server sees it, and the other
session, holding buffers of its own, keeps allocating and answering."""

from __future__ import annotations

import struct

from rpcguard.protocol import encode
from tests.integration.test_containment_real import server_binary, write_config
from tests.support.guard import start_guard
from tests.support.rawclient import RawClient, mtls_socket

MIB = 1 << 20
SHARE = 64 * MIB


def memory(c: RawClient) -> tuple[int, int]:
    free, total = struct.unpack("<QQ", c.call("GET_DEVICE_MEMORY", struct.pack("<I", 0)))
    return free, total


def test_a_share_smaller_than_the_node_is_what_each_session_gets(pki, workdir, rpc_server):
    direct = RawClient.session(rpc_server)
    real_free, real_total = memory(direct)
    direct.close()
    assert real_free > SHARE and real_total > SHARE  # the node has more than the share

    cfg = write_config(workdir, "share.yaml", f"      exec: [{server_binary()}]\n      isolation: session\n",
                       f"policy:\n  device_memory_share_bytes: {SHARE}\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    try:
        a = RawClient.session(mtls_socket(pki, serve.port))
        b = RawClient.session(mtls_socket(pki, serve.port))  # at the same time: its own server process
        assert memory(a) == (SHARE, SHARE) and memory(b) == (SHARE, SHARE)
        a.alloc(48 * MIB)
        b.alloc(48 * MIB)
        assert memory(a) == (16 * MIB, SHARE)
        assert a.closed_after(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, 32 * MIB)))
        a.close()
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="device_memory_share_exceeded") == 1
        # b is unaffected: it allocates the rest of its own share and answers
        b.alloc(16 * MIB)
        assert memory(b) == (0, SHARE)
        b.close()
        assert serve.value("rpcguard_refusals_total", reason="device_memory_share_exceeded") == 1
        # four ALLOC_BUFFERs came in (a's refused one counted too), and no other refusal
        assert serve.value("rpcguard_frames_total", command="ALLOC_BUFFER", direction="request") == 4
        assert serve.value("rpcguard_refusals_total") == 1
    finally:
        serve.stop()


def test_llama_cpp_fits_its_layers_to_the_share(pki, workdir, models, rpc_server):
    """The real llama-bench (b11434, ``--fit`` on by default: -ngl unset) sizes its offload from
    the RPC device's free memory: told a 48 MiB share of a ~100 MB model, it offloads what fits
    and runs, every session holding at most the share; told to offload everything (-ngl 99), its
    allocation past the share is refused."""
    import os
    import re
    import subprocess

    from tests.support import llamatools
    from tests.support.guard import start_pair

    bench = llamatools.tools().bench
    share = 48 * MIB
    cfg = workdir / "share-pair.yaml"
    cfg.write_text(f"policy:\n  device_memory_share_bytes: {share}\n")
    guards: list = []
    try:
        connect, serve = start_pair(workdir, pki, rpc_server, guards, serve_args=["--config", str(cfg)])
        env = dict(os.environ, LD_LIBRARY_PATH=str(bench.parent))
        base = [str(bench), "-m", str(models["bench"]), "--rpc", connect.endpoint, "-p", "16", "-n", "4", "-r", "1"]
        fit = subprocess.run([*base, "-fitt", "4"], capture_output=True, text=True, timeout=300, env=env)
        assert fit.returncode == 0 and re.search(r"\|\s+tg4\s+\|\s+[\d.]+", fit.stdout), fit.stdout + fit.stderr[-3000:]
        held = [int(x) for x in re.findall(r"alloc_bytes=(\d+)", serve.output())]
        assert held and 0 < max(held) <= share, held  # some layers offloaded, never more than the share
        assert serve.value("rpcguard_refusals_total") == 0
        full = subprocess.run([*base, "-ngl", "99"], capture_output=True, text=True, timeout=300, env=env)
        assert full.returncode != 0
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="device_memory_share_exceeded") == 1
    finally:
        for g in guards:
            g.stop()
