"""server.Runtime.reload in-process: listeners added/removed/replaced, failures change nothing.

Real sockets on loopback, real TLS material; no ggml peer is needed (nothing is relayed here:
tests/integration/test_reload.py runs real sessions across reloads).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest
import yaml

from rpcguard.pki import certs
from rpcguard.config.model import load_config
from rpcguard.observe.metrics import Metrics
from rpcguard.proxy.server import Runtime
from prometheus_client import CollectorRegistry
from tests.support.realpeer import reserve_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    certs.init_ca(d, force=True)
    certs.issue(d, "node1", server=True, dns=["node1"], force=True)
    certs.issue(d, "client1", server=False, force=True)
    return d


def serve_cfg(pki: Path, listeners: list[dict], **extra) -> dict:
    return {"tls": {"cert": str(pki / "node1.pem"), "key": str(pki / "node1.key"), "ca": str(pki / "ca.pem")},
            "metrics": {"listen": ""}, "allow": {"all": True}, **extra, "listeners": listeners}


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def sample(rt: Runtime, name: str, **labels: str) -> float | None:
    return rt.metrics.registry.get_sample_value(name, {"role": rt.cfg.role, **labels})


def listener(name: str, upstream_port: int, **extra: object) -> dict:
    """A serve listener entry on a reserved loopback port (``port_of`` reads the port back)."""
    return {"name": name, "listen": f"127.0.0.1:{reserve_port()}", "upstream": f"127.0.0.1:{upstream_port}", **extra}


def port_of(item: dict) -> int:
    return int(item["listen"].rsplit(":", 1)[1])


def runtime(path: str) -> Runtime:
    return Runtime(load_config(path), metrics=Metrics(CollectorRegistry()), config_path=path)


def test_listeners_added_removed_and_replaced(pki: Path, tmp_path: Path, caplog) -> None:
    a, b, pc = listener("a", 1), listener("b", 2), reserve_port()
    path = write(tmp_path / "s.yaml", serve_cfg(pki, [a, b]))

    async def body() -> None:
        rt = runtime(path)
        await rt.start()
        try:
            old = {lst.route.name: lst for lst in rt.listeners}
            fd_a, fd_b = old["a"].sock.fileno(), old["b"].sock.fileno()
            # a: new upstream on the same address (replaced, socket handed over); b renamed to c
            # (its address is taken over by c); d: a new address
            write(tmp_path / "s.yaml", serve_cfg(pki, [
                {**a, "upstream": "127.0.0.1:3"}, {**b, "name": "c"},
                {"name": "d", "listen": f"127.0.0.1:{pc}", "upstream": "127.0.0.1:4"}]))
            with caplog.at_level(logging.INFO, logger="rpcguard.server"):
                assert await rt.reload("test") is True
            now = {lst.route.name: lst for lst in rt.listeners}
            assert sorted(now) == ["a", "c", "d"]
            assert now["a"].route is not old["a"].route and now["a"].route.upstream_port == 3
            assert now["a"].sock.fileno() == fd_a and now["c"].sock.fileno() == fd_b  # no gap, no rebind
            assert old["a"].sock is None and old["b"].sock is None  # handed over, not closed
            assert rt.retired[-1] is old["b"]  # (retired routes without sessions are let go)
            assert rt.listeners[0].route.slot is not old["a"].route.slot  # another upstream: another slot
            line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config reloaded")][-1]
            assert line == ("config reloaded (test): changed listeners[a].upstream; added listener c; "
                            "added listener d; removed listener b; replaced listener a")
            await asyncio.sleep(0.05)
            for port in (port_of(a), port_of(b), pc):
                assert await asyncio.to_thread(accepts, port), port
            assert sample(rt, "rpcguard_reload_total", result="ok") == 1
        finally:
            await rt.close()

    asyncio.run(body())


def test_a_failed_reload_changes_nothing(pki: Path, tmp_path: Path, caplog) -> None:
    a = listener("a", 1, policy={"max_graph_nodes": 9})
    path = write(tmp_path / "s.yaml", serve_cfg(pki, [a], limits={"hello_timeout_s": 3}))
    busy = socket.create_server(("127.0.0.1", 0))
    busy_port = busy.getsockname()[1]

    async def body() -> None:
        rt = runtime(path)
        await rt.start()
        try:
            route, cfg = rt.listeners[0].route, rt.cfg
            default = route.default
            cases = [
                # a new listener on a port in use: the other changes in the file are not applied either
                (serve_cfg(pki, [{**a, "policy": {}}, {"name": "b", "listen": f"127.0.0.1:{busy_port}",
                                                         "upstream": "127.0.0.1:2"}]), "Address already in use"),
                (serve_cfg(pki, [a], limits={"hello_timeout_s": 0}),
                 "limits.hello_timeout_s: must be a number of seconds > 0, got 0"),
                ({**serve_cfg(pki, [a]), "tls": {**serve_cfg(pki, [a])["tls"], "cert": str(pki / "client1.key")}},
                 "client1.key"),
            ]
            for n, (data, why) in enumerate(cases, 1):
                write(tmp_path / "s.yaml", data)
                with caplog.at_level(logging.ERROR, logger="rpcguard.server"):
                    assert await rt.reload("test") is False
                line = caplog.records[-1].getMessage()
                assert line.startswith("reload (test) failed, nothing changed") and why in line, line
                assert rt.cfg is cfg and [lst.route for lst in rt.listeners] == [route]
                assert route.default is default and route.default.limits.hello_timeout_s == 3
                assert sample(rt, "rpcguard_reload_total", result="error") == n
                assert sample(rt, "rpcguard_reload_last_successful") == 0
            assert rt.retired == []
            # the listener that failed to bind never reached the metrics
            assert sample(rt, "rpcguard_sessions_active", listener="b") is None
            assert sample(rt, "rpcguard_sessions_active", listener="a") == 0
        finally:
            await rt.close()
            busy.close()

    asyncio.run(body())


def test_settings_swap_for_new_sessions_and_live_keys(pki: Path, tmp_path: Path, caplog) -> None:
    a = listener("a", 1)
    path = write(tmp_path / "s.yaml", serve_cfg(pki, [a]))

    async def body() -> None:
        rt = runtime(path)
        await rt.start()
        try:
            route = rt.listeners[0].route
            held = route.default  # what a running link holds
            write(tmp_path / "s.yaml", serve_cfg(
                pki, [a], log={"level": "debug", "format": "json"}, limits={"max_sessions": 3},
                policy={"allow_commands": ["@handshake"]},
                tls={**serve_cfg(pki, [a])["tls"], "reload_interval_s": 0.05},
                profiles={"p": {"limits": {"max_sessions": 1}}}, allow=[{"cn": ["x"], "profile": "p"}]))
            with caplog.at_level(logging.INFO, logger="rpcguard.server"):
                assert await rt.reload("test") is True
            assert rt.listeners[0].route is route  # kept: same route, new settings objects
            assert held.limits.max_sessions == 64 and route.default.limits.max_sessions == 3
            assert route.default.policy.allowed_commands == {"HELLO", "DEVICE_COUNT"}
            assert route.profiles["p"].limits.max_sessions == 1 and route.allow.entries[0].profile == "p"
            assert route.traffic.profile_sessions == {"default": 0, "p": 0}
            assert logging.getLogger().level == logging.DEBUG  # log.level applies live ...
            assert rt.cfg.log.format == "text"  # ... log.format does not
            msgs = [r.getMessage() for r in caplog.records]
            assert ("reload (test): log.format cannot change while running (the log stream is set up once at "
                    "start); keeping text until a restart (file: json)") in msgs
            assert msgs[-1] == (
                "config reloaded (test): changed tls.reload_interval_s, log.level, limits.max_sessions, "
                "listeners[a].policy.allow_commands, listeners[a].allow, listeners[a].profiles.p, profiles.p; "
                "kept until restart: log.format")
            assert sample(rt, "rpcguard_reload_kept_keys") == 1
            # tls.reload_interval_s went from 0 to 0.05: the file watcher runs now
            assert rt.reloader.watcher is not None and not rt.reloader.watcher.done()
            write(tmp_path / "s.yaml", serve_cfg(pki, [a], log={"level": "debug"}))
            deadline = time.monotonic() + 15
            while sample(rt, "rpcguard_reload_total", result="ok") != 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert sample(rt, "rpcguard_reload_total", result="ok") == 2  # by the watcher
            assert sample(rt, "rpcguard_reload_kept_keys") == 0
            while not rt.reloader.watcher.done() and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.02)
            assert rt.reloader.watcher.done()  # interval back to 0: the watcher ended
        finally:
            await rt.close()
            logging.getLogger().setLevel(logging.WARNING)

    asyncio.run(body())


def test_connect_tunnels_reload(pki: Path, tmp_path: Path) -> None:
    p1, p2 = reserve_port(), reserve_port()
    base = {"tls": {"cert": str(pki / "client1.pem"), "key": str(pki / "client1.key"), "ca": str(pki / "ca.pem")},
            "metrics": {"listen": ""}}
    t1 = {"name": "t1", "listen": f"127.0.0.1:{p1}", "server": "127.0.0.1:1", "server_name": "node1"}
    path = write(tmp_path / "c.yaml", {**base, "tunnels": [t1]})

    async def body() -> None:
        rt = runtime(path)
        await rt.start()
        try:
            assert not rt.listeners[0].route.default.policy.clear_new_buffers
            write(tmp_path / "c.yaml", {**base, "policy": {"max_graph_nodes": 5}, "tunnels": [
                {**t1, "server_name": "node2"}, {**t1, "name": "t2", "listen": f"127.0.0.1:{p2}"}]})
            assert await rt.reload("test") is True
            t1r, t2r = (lst.route for lst in rt.listeners)
            assert (t1r.name, t1r.server_name, t2r.name) == ("t1", "node2", "t2")
            assert t2r.default.policy.firewall.max_graph_nodes == 5 and not t2r.default.policy.clear_new_buffers
            await asyncio.sleep(0.05)
            assert await asyncio.to_thread(accepts, p2)
        finally:
            await rt.close()

    asyncio.run(body())


def test_reloads_run_one_at_a_time(pki: Path, tmp_path: Path, caplog) -> None:
    """SIGHUP and the file poll may fire together: the second reload sees the first one's result."""
    a, b = listener("a", 1), listener("b", 2)
    path = write(tmp_path / "s.yaml", serve_cfg(pki, [a, b]))

    async def body() -> None:
        rt = runtime(path)
        await rt.start()
        try:
            write(tmp_path / "s.yaml", serve_cfg(pki, [a]))
            with caplog.at_level(logging.INFO, logger="rpcguard.server"):
                assert await asyncio.gather(rt.reload("one"), rt.reload("two")) == [True, True]
            msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config reloaded")]
            assert msgs == ["config reloaded (one): removed listener b", "config reloaded (two): no change"]
            assert [lst.route.name for lst in rt.listeners] == ["a"]
            await rt.drain(0.1)  # closes too
            assert await rt.reload("three") is False  # no reload once shutting down
        finally:
            await rt.close()

    asyncio.run(body())


def test_a_downgrade_is_loud_at_start_and_at_every_reload_that_keeps_it(pki: Path, tmp_path: Path, caplog) -> None:
    """monitor mode on one listener: a WARNING at start and after each reload that keeps it, the
    gauges, and what the listener says in the TLS handshake (its context's ALPN), per listener."""
    import ssl

    from rpcguard.pki import tls

    a, b = listener("a", 1, policy={"mode": "monitor"}), listener("b", 2)
    path = write(tmp_path / "s.yaml", serve_cfg(pki, [a, b]))

    def says(rt: Runtime, name: str) -> str | None:
        """The ALPN protocol a connect negotiates with listener ``name`` (memory-BIO handshake)."""
        route = next(lst.route for lst in rt.listeners if lst.route.name == name)
        s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        server = route.ssl_context().wrap_bio(s_in, s_out, server_side=True)
        client_ctx = tls.client_context(pki / "client1.pem", pki / "client1.key", pki / "ca.pem", server_name="node1")
        client = client_ctx.wrap_bio(c_in, c_out, server_hostname="node1")
        for _ in range(10):
            for side in (client, server):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
                s_in.write(c_out.read())
                c_in.write(s_out.read())
        return client.selected_alpn_protocol()

    async def body() -> None:
        with caplog.at_level(logging.WARNING, logger="rpcguard"):
            rt = runtime(path)
        try:
            warned = [r.getMessage() for r in caplog.records if "NOT ENFORCING" in r.getMessage()]
            assert len(warned) == 1 and warned[0].startswith("serve listener a: NOT ENFORCING"), warned
            assert sample(rt, "rpcguard_listener_enforcing", listener="a") == 0
            assert sample(rt, "rpcguard_listener_enforcing", listener="b") == 1
            assert (says(rt, "a"), says(rt, "b")) == ("rpcguard/1+monitor+notice", "rpcguard/1+enforce+notice")
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rpcguard"):
                assert await rt.reload("test") is True  # nothing changed: still said
            assert [r.getMessage() for r in caplog.records if "NOT ENFORCING" in r.getMessage()] == warned
            write(tmp_path / "s.yaml", serve_cfg(pki, [{**a, "policy": {"mode": "enforce"}}, b]))
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="rpcguard"):
                assert await rt.reload("test") is True
            assert not [r for r in caplog.records if "NOT ENFORCING" in r.getMessage()]
            assert sample(rt, "rpcguard_listener_enforcing", listener="a") == 1
            assert says(rt, "a") == "rpcguard/1+enforce+notice"
        finally:
            await rt.close()

    asyncio.run(body())

