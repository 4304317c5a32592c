"""proxy/endpoint.py: the dialer's refusals and the node check (real loopback sockets;
the data path itself is driven by tests/unit/proxy/test_link.py)."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from rpcguard.proxy.endpoint import check_node, dial
from rpcguard.errors import Refusal
from rpcguard.observe.metrics import Metrics
from rpcguard.protocol.settings import Limits
from rpcguard.proxy.route import Route
from tests.support.realpeer import reserve_port
from tests.support.imports import imported


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
