"""The compiled protocol core and the pure-Python core on REAL traffic: identical outcomes.

The real llama.cpp client runs the tiny model (3 tokens) against the real ggml-rpc-server
through a recording relay (tests/support/capture.py). Every recorded connection is replayed,
chunk by chunk in the recorded order, into a fresh ``Session`` by the compiled core (this
process) and by the pure core (a child interpreter importing the .py sources,
tests/support/corereplay.py), in enforce and in monitor mode, whole chunks and cut into small
pieces. Per piece the digests of the bytes forwarded each way and the events, then the counters,
buffers and the verdict caches must be equal, and the model session must have validated
GRAPH_COMPUTE frames and filled the caches for the comparison to mean anything.
"""

from __future__ import annotations

import os

import pytest

import rpcguard.protocol
from rpcguard.protocol.versions import COMMAND_IDS
from tests.support.capture import hello_version, record_real_session
from tests.support.corereplay import PureWorker, run_case

pytestmark = pytest.mark.integration

GRAPH_COMPUTE = COMMAND_IDS["GRAPH_COMPUTE"]



def test_recorded_session_same_outcome_compiled_and_pure(tmp_path, rpc_server):
    if os.environ.get("RPCGUARD_PURE_PYTHON", "") in ("", "0"):  # CI builds compiled: compare two cores
        assert rpcguard.protocol.compiled(), "the protocol core is not compiled (see pip install -v)"
    conns = record_real_session(rpc_server, tmp_path)
    pure = PureWorker()
    try:
        assert pure.core == "PURE"
        results = []
        for conn in conns:
            chunks = list(conn.chunks)
            for mode, split in (("enforce", ()), ("monitor", ()), ("enforce", (1, 13, 4096))):
                case = ("chunks", (hello_version(conn), chunks, mode, split))
                mine = run_case(case)
                assert mine == pure.run(case), (mode, split)
                results.append(mine)
    finally:
        pure.close()
    model_session = max(results, key=lambda r: r["counters"]["req_frames"][GRAPH_COMPUTE])
    assert model_session["counters"]["req_frames"][GRAPH_COMPUTE] >= 1
    tensors, nodes, layouts, heads = model_session["fullest_caches"]
    assert tensors and nodes and heads  # the verdict caches were filled (and compared)
    assert all(c[0] != "refused" for c in model_session["chunks"])  # real traffic: nothing refused
    print(f"{len(conns)} connections; compiled={rpcguard.protocol.compiled()}; model session: "
          f"{len(model_session['chunks'])} pieces, {model_session['counters']['req_frames'][GRAPH_COMPUTE]} graphs, "
          f"up to {len(tensors)} cached tensors, {len(nodes)} cached nodes: same outcome in both cores")
