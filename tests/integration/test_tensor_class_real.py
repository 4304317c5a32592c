"""The typed RpcTensor on REAL traffic: a recorded llama.cpp session gives the same verdicts and
the same verdict caches whether every rpc_tensor is decoded into the typed class (tensor.py) or
into the computed-field namedtuple it replaced (tests/support/tensorref.py).

The real llama.cpp client runs the tiny model against the real ggml-rpc-server through a
``CaptureRelay`` (both directions). Every recorded connection is then fed, chunk by chunk in the
recorded order, into a fresh sans-IO ``Session`` (enforce mode, the default firewall) twice:
once as shipped, once with ``decode_tensor`` swapped for the old decoder in every module that
decodes. Each chunk's outcome (bytes forwarded each way, or the refusal), the violations, the
frame counters and the four verdict caches (tensor, layout, node, head) must be equal, and the
session must have decoded tensors and validated GRAPH_COMPUTE frames for the comparison to mean
anything. About 10 s.
"""

from __future__ import annotations

import pytest

from rpcguard.errors import Refusal
from rpcguard.protocol import checks as checks_mod
from rpcguard.protocol import compiled
from rpcguard.protocol import graph as graph_mod
from rpcguard.protocol import commands as commands_mod
from rpcguard.protocol import tensor as tensor_mod
from rpcguard.protocol.session import Session
from rpcguard.protocol.settings import SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.versions import COMMAND_IDS
from tests.support.corereplay import run_pytest_pure
from tests.support.capture import C2S, Conn, hello_version, record_real_session
from tests.support.tensorref import decode_computed

pytestmark = pytest.mark.integration

DECODING_MODULES = (tensor_mod, graph_mod, checks_mod, commands_mod)  # every module that calls decode_tensor
GRAPH_COMPUTE = COMMAND_IDS["GRAPH_COMPUTE"]



def _replay(conn: Conn) -> tuple[object, ...]:
    """Feed one recorded connection into a fresh Session; everything a verdict could change."""
    # Facts an earlier connection would have taught serve: no injected DEVICE_COUNT /
    # GET_DEVICE_MEMORY (the recording holds no answer to them); no BUFFER_CLEAR for the same reason.
    facts = UpstreamFacts(version=hello_version(conn), device_count=1, memory={0: (1 << 62, 1 << 62)})
    s = Session(SessionPolicy(clear_new_buffers=False), facts)
    outcomes: list[object] = []
    sizes: list[tuple[int, ...]] = []  # the caches' sizes after every chunk
    fullest: tuple[object, ...] = ()  # their contents when the tensor cache was fullest
    st = s.state
    for way, data in conn.chunks:
        try:
            (s.client_data if way == C2S else s.server_data)(memoryview(data))
        except Refusal as exc:
            outcomes.append((exc.reason, exc.detail))
            break
        outcomes.append((sum(map(len, s.to_server)), sum(map(len, s.to_client))))
        s.to_server.clear()
        s.to_client.clear()
        sizes.append((len(st.tensor_cache), len(st.node_cache), sum(map(len, st.layout_cache.values())),
                      len(st.head_cache)))
        if not fullest or len(st.tensor_cache) > len(fullest[0]):  # type: ignore[arg-type]
            fullest = (dict(st.tensor_cache), sorted(st.node_cache),
                       {d: sorted(c) for d, c in st.layout_cache.items()}, sorted(st.head_cache))
    return (outcomes, [(v.reason, v.command) for v in s.violations], list(s.stats.req_frames), fullest, sizes,
            sorted((h, b.base, b.size) for h, b in st.buffers.items()))


def test_recorded_session_same_verdicts_and_caches(tmp_path, rpc_server, monkeypatch):
    if compiled():  # the decoder swap cannot reach compiled modules: this test on the pure core
        print(run_pytest_pure(f"{__file__}::test_recorded_session_same_verdicts_and_caches")[-400:])
        return
    conns = record_real_session(rpc_server, tmp_path)

    results = {}
    for name, decoder in (("typed", decode_tensor), ("computed", decode_computed)):
        decoded: list[type] = []

        def counted(buf, offset=0, decoder=decoder, decoded=decoded):
            t = decoder(buf, offset)
            decoded.append(type(t))
            return t

        for mod in DECODING_MODULES:
            monkeypatch.setattr(mod, "decode_tensor", counted)
        try:
            results[name] = [_replay(c) for c in conns]
        finally:
            monkeypatch.undo()
        assert decoded and set(decoded) == {type(decoder(bytes(296)))}, name  # the swap took effect
        results[name + " decodes"] = len(decoded)

    assert results["typed"] == results["computed"]
    assert results["typed decodes"] == results["computed decodes"] > 0
    session = max(results["typed"], key=lambda r: r[2][GRAPH_COMPUTE])
    outcomes, violations, frames, fullest = session[:4]
    tensor_cache, node_cache = fullest[0], fullest[1]  # type: ignore[index]
    assert frames[GRAPH_COMPUTE] >= 1 and tensor_cache and node_cache  # graphs were validated and cached
    assert not violations and all(isinstance(o[0], int) for o in outcomes)  # real traffic: nothing refused
    print(f"{len(conns)} connections, {len(outcomes)} chunks in the model session, {frames[GRAPH_COMPUTE]} graphs, "
          f"{results['typed decodes']} tensors decoded per class, up to {len(tensor_cache)} cached tensors and "
          f"{len(node_cache)} cached nodes: same verdicts and caches")
