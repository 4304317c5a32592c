"""Who validates requests on a connect -> serve pair (SessionPolicy.validate_requests), with the
REAL ggml-rpc-server behind serve.

A serve listener says in the TLS handshake (ALPN ``rpcguard/1+enforce`` or ``+monitor``) whether
it enforces every request check. By default (``auto``) connect leaves the request firewall to a
node that said it enforces: the attack below is refused by serve and connect forwards it; with
``always``, or toward a node in monitor mode (which would forward it), connect refuses it before
it leaves the client machine. Either way the real server stays up for the next session.
"""

from __future__ import annotations

import struct

import pytest

from rpcguard.protocol import encode
from tests.support.rawclient import RawClient
from tests.support.waiting import wait_until


@pytest.mark.parametrize("setting,serve_mode,refuser,forwarder", [
    (None, "enforce", "serve", "connect"), ("always", "enforce", "connect", "serve"),
    (None, "monitor", "connect", "serve"),  # the node says it does not enforce: connect checks
])
def test_a_request_is_refused_by_the_node_or_by_connect_when_told_always(pair, workdir, setting, serve_mode, refuser,
                                                                          forwarder):
    connect_args = []
    if setting:
        cfg = workdir / f"connect-{setting}.yaml"
        cfg.write_text(f"policy:\n  validate_requests: {setting}\n")
        connect_args = ["--config", str(cfg)]
    connect, serve = pair(connect_args=connect_args, serve_args=["--mode", serve_mode])
    guards = {"connect": connect, "serve": serve}
    c = RawClient.session(connect.port)
    t = c.alloc(1 << 20)
    # 64 bytes written 1 MiB past the start of a 1 MiB tensor that fills its buffer.
    attack = encode.request("SET_TENSOR", encode.pack_tensor(t) + bytes(1) + struct.pack("<Q", 1 << 20) + bytes(64))
    assert c.closed_after(attack + encode.request("GET_ALIGNMENT", struct.pack("<I", 0)))
    wait_until(lambda: guards[refuser].value("rpcguard_refusals_total", reason="range_out_of_buffer") == 1,
               what=f"{refuser} refusing the attack")
    assert guards[forwarder].value("rpcguard_refusals_total", reason="range_out_of_buffer") == 0
    c.close()
    # connect's session-end line says who ran the request firewall (the audit record's request_checks).
    ends = wait_until(lambda: [l for l in connect.output().splitlines() if "session end" in l and "alloc_bytes=" in l],
                      what="connect's session end")
    assert ("request_checks=node" in ends[-1]) == (refuser == "serve"), ends[-1]
    # ... and so do both ends' metrics: serve always checks; connect only when told ``always``.
    connect_by = "node" if refuser == "serve" else "proxy"
    assert connect.value("rpcguard_request_checks_sessions_total", checked_by=connect_by) == 1
    assert connect.value("rpcguard_request_checks_sessions_total") == 1
    assert serve.value("rpcguard_request_checks_sessions_total", checked_by="proxy") == 1
    assert serve.value("rpcguard_request_checks_sessions_total", checked_by="node") == 0
    assert serve.value("rpcguard_listener_enforcing") == (serve_mode == "enforce")
    assert serve.value("rpcguard_listener_switched_off", what="monitor_mode") == (serve_mode == "monitor")
    assert ("NOT ENFORCING" in serve.output()) == (serve_mode == "monitor")  # a WARNING at start
    # The real server is unharmed: the next session works.
    again = RawClient.session(connect.port)
    assert again.alloc(4096).buffer
    again.close()
