"""proxy/endpoint.py: the write helper, the dialer's refusals and the node check (real loopback sockets;
the data path itself is driven by tests/unit/proxy/test_link.py)."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from rpcguard.proxy.endpoint import JOIN_MAX_BYTES, check_node, dial, write
from rpcguard.errors import Refusal
from rpcguard.observe.metrics import Metrics
from rpcguard.protocol.settings import Limits
from rpcguard.proxy.route import Route
from tests.support.realpeer import reserve_port
from tests.support.imports import imported


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[bytes]]] = []

    def write(self, data) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, chunks) -> None:
        self.calls.append(("writelines", [bytes(c) for c in chunks]))


@pytest.mark.parametrize("chunks, kind, n", [
    ([b"a" * 10], "write", 1),  # one chunk: as it is
    ([b"a" * 10, memoryview(b"b" * 20), bytearray(b"c")], "write", 1),  # small ones: one record
    ([b"a" * JOIN_MAX_BYTES, b"b"], "writelines", 2),  # large: never copied to be joined
])
def test_write_joins_small_chunks_into_one_write_and_leaves_large_ones(chunks, kind, n):
    t = Recorder()
    write(t, list(chunks))  # type: ignore[arg-type]
    assert [c[0] for c in t.calls] == [kind] and len(t.calls[0][1]) == n
    assert b"".join(t.calls[0][1]) == b"".join(bytes(c) for c in chunks)


def closed_port() -> int:
    """A port where nothing listens, held so that nothing else can listen there meanwhile."""
    return reserve_port()


@pytest.mark.parametrize("role, reason", [("serve", "upstream_unavailable"), ("connect", "node_unreachable")])
def test_dial_to_nothing_is_refused_with_the_role_s_reason(role, reason):
    route = Route(role=role, name="t", upstream_host="127.0.0.1", upstream_port=closed_port(),
                  traffic=Metrics().listener(role, "t", upstream="x"), server_name="node1",
                  ssl_context=ssl.create_default_context)

    async def main() -> None:
        with pytest.raises(Refusal) as refused:
            await dial(route, asyncio.Protocol, Limits(connect_timeout_s=2, handshake_timeout_s=2))
        assert refused.value.reason == reason and f"127.0.0.1:{route.upstream_port}" in refused.value.detail

    asyncio.run(main())


def test_check_node_leaves_serve_s_plain_upstream_alone():
    route = Route(role="serve", name="t", upstream_host="127.0.0.1", upstream_port=1,
                  traffic=Metrics().listener("serve", "t", upstream="x"))
    check_node(route, None)  # type: ignore[arg-type]  # serve's upstream has no certificate to check


def test_an_endpoint_needs_only_the_link_port_protocol():
    """endpoint <-> link was an import cycle (behind TYPE_CHECKING): an Endpoint knows its link as
    ``LinkPort`` (a Protocol), and Link satisfies it (mypy checks ``Endpoint(self, ...)`` in link.py)."""
    assert "rpcguard.proxy.link" not in imported("rpcguard/proxy/endpoint.py")
