"""rpcguard/upstream/: the config form, the sandbox's command line, the pool's choices (no real server)."""

from __future__ import annotations

import asyncio
import os
import resource
import sys

import pytest

from rpcguard.cli import main
from rpcguard.config.flags import build_config
from rpcguard.errors import ConfigError
from rpcguard.upstream import sandbox
from rpcguard.config.upstream import parse_upstream
from rpcguard.upstream.pool import PROBE_COMMANDS, UpstreamPool, UpstreamSettings
from rpcguard.upstream.process import ServerProcess, exit_cause, listening

TRUE = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"


# ----------------------------------------------------------------------------- config
def test_the_mapping_form_is_read_with_its_defaults():
    s = parse_upstream({"exec": ["true", "-c"]}, "listeners[0].upstream")
    assert s.exec[0] == os.path.realpath(TRUE) and s.exec[1:] == ("-c",)
    assert (s.isolation, s.spare, s.sandbox.mode) == ("session", True, "required")
    assert s.uses_cache


@pytest.mark.parametrize("data, message", [
    ({"exec": ["true", "-H", "0.0.0.0"]}, "listeners[0].upstream.exec: sets -H"),
    ({"exec": ["true", "--host=10.0.0.1"]}, "listeners[0].upstream.exec: sets --host"),
    ({"exec": ["true", "-p", "50052"]}, "listeners[0].upstream.exec: sets -p"),
    ({"exec": []}, "listeners[0].upstream.exec: must name the server's command"),
    ({"exec": ["/nonexistent/ggml-rpc-server"]}, "listeners[0].upstream.exec: /nonexistent/ggml-rpc-server: no such"),
    ({"exec": ["true"], "isolation": "tenant"}, "listeners[0].upstream.isolation: must be one of session"),
    ({"exec": ["true"], "sandbox": {"mode": "maybe"}}, "listeners[0].upstream.sandbox.mode: must be one of"),
    ({"exec": ["true"], "sandbox": {"uid_base": 0}}, "listeners[0].upstream.sandbox.uid_base: must be a uid"),
    ({"exec": ["true"], "sandbox": {"cache_root": "rel/dir"}}, "listeners[0].upstream.sandbox.cache_root: must be"),
    ({"exec": ["true"], "quarantine": {"crashes": -1}}, "listeners[0].upstream.quarantine.crashes: must be"),
    ({"exec": ["true"], "restart": 1}, "listeners[0].upstream.restart: unknown key"),
])
def test_bad_upstream_mappings_name_their_key(data, message):
    with pytest.raises(ConfigError) as e:
        parse_upstream(data, "listeners[0].upstream")
    assert str(e.value).startswith(message), str(e.value)


def test_yaml_off_is_the_off_mode():
    assert parse_upstream({"exec": ["true"], "sandbox": {"mode": False}}, "u").sandbox.mode == "off"


def test_the_command_after_double_dash_configures_the_listener(tmp_path):
    cfg = build_config("serve", overrides=dict(cert=__file__, key=__file__, ca=__file__, listen="127.0.0.1:0",
                                                upstream_exec=["true", "-t", "2"], allow_all=True))
    item = cfg.listeners[0]
    assert item.managed is not None and item.managed.exec[1:] == ("-t", "2")
    with pytest.raises(ConfigError, match="--upstream: and a server command"):
        build_config("serve", overrides=dict(cert=__file__, key=__file__, ca=__file__, listen="127.0.0.1:0",
                                             upstream="127.0.0.1:1", upstream_exec=["true"], allow_all=True))


def test_a_command_that_sets_the_host_exits_2_with_one_line(capsys, tmp_path):
    rc = main(["serve", "--cert", __file__, "--key", __file__, "--ca", __file__, "--listen", "127.0.0.1:0",
               "--allow-all", "--", "true", "-H", "0.0.0.0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "serve -- COMMAND: sets -H" in err[0], err


# ----------------------------------------------------------------------------- sandbox
def _mech(**kw) -> sandbox.Mechanisms:
    return sandbox.Mechanisms(bwrap="/usr/bin/bwrap", setpriv="/usr/bin/setpriv", root=True, **kw)


def test_the_sandbox_command_line(tmp_path):
    binary = tmp_path / "bin" / "ggml-rpc-server"
    binary.parent.mkdir()
    binary.write_text("")
    (binary.parent / "libggml.so.0").write_text("")
    (binary.parent / "node.key").write_text("secret")  # beside the binary: must stay out
    cache = str(tmp_path / "cache")
    argv = sandbox.command([str(binary), "-c"], port=50052, mech=_mech(), settings=sandbox.SandboxSettings(),
                           cache=cache, uid=61007, info_fd="9")
    text = " ".join(argv)
    assert argv[0] == "/usr/bin/bwrap" and "--unshare-net" in argv and "--unshare-pid" in argv
    assert f"--ro-bind {binary} {binary}" in text and f"{binary.parent}/libggml.so.0" in text
    assert "node.key" not in text  # only the binary and the libraries beside it are bound
    assert f"--bind {cache} /cache" in text and "--setenv LLAMA_CACHE /cache" in text
    assert "--reuid=61007" in text and "--bounding-set=-all" in text and "--no-new-privs" in text
    assert argv[-4:] == ["-H", "127.0.0.1", "-p", "50052"]
    # the binds below /tmp come after the private /tmp (which would hide them)
    assert argv.index("--tmpfs") < argv.index(str(binary))


def test_the_syscall_filter_is_built_and_handed_to_bwrap():
    from rpcguard.upstream import seccomp
    assert seccomp.unavailable() == "", seccomp.unavailable()  # libseccomp2: a base package of Debian
    prog = seccomp.program()
    assert prog and len(prog) % 8 == 0  # struct sock_filter[]: one rule per denied syscall and more
    assert len(prog) // 8 > len(seccomp.DENIED)
    argv = sandbox.command([TRUE], port=50052, mech=_mech(), settings=sandbox.SandboxSettings(), cache=None,
                           uid=61000, info_fd="9")
    assert argv[argv.index("--seccomp") + 1] == sandbox.SECCOMP_FD and argv.index("--seccomp") < argv.index("--")
    without = sandbox.command([TRUE], port=50052, mech=_mech(missing={"seccomp": "no libseccomp"}),
                              settings=sandbox.SandboxSettings(), cache=None, uid=61000, info_fd="9")
    assert "--seccomp" not in without


def test_without_namespaces_the_command_runs_bare_and_says_so():
    m = _mech(missing={"namespaces": "bwrap is not installed"})
    argv = sandbox.command([TRUE], port=4000, mech=m, settings=sandbox.SandboxSettings(), cache=None, uid=61000,
                           info_fd="9")
    assert argv == [TRUE, "-H", "127.0.0.1", "-p", "4000"]


def test_not_root_uses_a_user_namespace_and_drops_capabilities():
    m = sandbox.Mechanisms(bwrap="/usr/bin/bwrap", setpriv="/usr/bin/setpriv", root=False)
    argv = sandbox.command([TRUE], port=50052, mech=m, settings=sandbox.SandboxSettings(), cache=None, uid=61000,
                           info_fd="9")
    assert "--unshare-user" in argv and "--cap-drop" in argv and "/usr/bin/setpriv" not in argv


def test_rlimits_forbid_core_dumps_and_bound_files():
    limits = dict(sandbox.rlimits(sandbox.SandboxSettings(data_bytes=1 << 30, nofile=64)))
    assert limits[resource.RLIMIT_CORE] == 0 and limits[resource.RLIMIT_NOFILE] == 64
    assert limits[resource.RLIMIT_DATA] == 1 << 30


def test_rlimits_bound_each_file_by_the_cache_quota():
    assert dict(sandbox.rlimits(sandbox.SandboxSettings(cache_bytes=1 << 20)))[resource.RLIMIT_FSIZE] == 1 << 20
    assert resource.RLIMIT_FSIZE not in dict(sandbox.rlimits(sandbox.SandboxSettings(cache_bytes=0)))
    assert sandbox.SandboxSettings().cache_bytes == 100 << 30  # a quota unless one says 0


def _blocks(path) -> int:
    return os.lstat(path).st_blocks * 512


def test_a_cache_over_its_quota_loses_its_oldest_files_first(tmp_path):
    files = []
    for i in range(6):  # 64 KiB each, written (so allocated), i seconds old order: 0 is the oldest
        f = tmp_path / ("sub" if i % 2 else "") / f"t{i}"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(os.urandom(64 << 10))
        os.utime(f, (1000 + i, 1000 + i))
        files.append(f)
    total = sum(_blocks(f) for f in files)
    keep = sum(_blocks(f) for f in files[3:])
    removed, freed = sandbox.prune_cache(str(tmp_path), keep)
    assert (removed, freed) == (3, total - keep)
    assert [f.exists() for f in files] == [False, False, False, True, True, True]
    assert sandbox.prune_cache(str(tmp_path), keep) == (0, 0)  # at the quota: nothing more goes
    assert sandbox.prune_cache(str(tmp_path), 0) == (0, 0)  # 0: no quota


def test_pruning_never_follows_or_removes_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "secret"
    victim.write_bytes(os.urandom(64 << 10))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "link").symlink_to(victim)
    (cache / "dirlink").symlink_to(outside, target_is_directory=True)
    (cache / "own").write_bytes(os.urandom(64 << 10))
    assert sandbox.prune_cache(str(cache), 1) == (1, _blocks(victim))  # only its own file counted and gone
    assert victim.exists() and (cache / "link").is_symlink() and (cache / "dirlink").is_symlink()


def test_a_server_starts_with_its_identitys_cache_pruned_to_the_quota(tmp_path, caplog):
    """The pool's start of a server for an identity (a stand-in server, no sandbox) prunes that
    identity's directory first, and only that one."""
    code = ("import socket,sys,time;a=sys.argv;s=socket.socket();s.bind(('127.0.0.1',int(a[a.index('-p')+1])));"
            "s.listen();time.sleep(60)")
    box = sandbox.SandboxSettings(mode="off", cache_root=str(tmp_path), cache_bytes=128 << 10)
    pool = UpstreamPool("l0", UpstreamSettings(exec=(sys.executable, "-c", code, "-c"), spare=False, sandbox=box),
                        sandbox.Mechanisms(bwrap=None, setpriv=None, root=False, missing={"namespaces": "off"}))
    mine, other = sandbox.cache_dir(box, "CN=a"), sandbox.cache_dir(box, "CN=b")
    for d in (mine, other):
        os.makedirs(d)
        for i in range(4):
            with open(os.path.join(d, f"t{i}"), "wb") as f:
                f.write(os.urandom(64 << 10))
            os.utime(os.path.join(d, f"t{i}"), (1000 + i, 1000 + i))

    async def run() -> None:
        proc = await pool._spawn("CN=a")
        proc.kill()
        await proc.exited  # type: ignore[misc]

    with caplog.at_level("INFO", logger="rpcguard.upstream"):
        asyncio.run(run())
    assert sorted(os.listdir(mine)) == ["t2", "t3"] and len(os.listdir(other)) == 4
    assert any("over cache_bytes=131072: 2 oldest files removed" in r.getMessage() for r in caplog.records)


def test_cache_bytes_is_read_from_the_sandbox_mapping():
    s = parse_upstream({"exec": [TRUE, "-c"], "sandbox": {"cache_bytes": 1 << 30}}, "listeners[0].upstream")
    assert s.sandbox.cache_bytes == 1 << 30


def test_cache_directories_are_per_identity_and_name_no_path():
    s = sandbox.SandboxSettings(cache_root="/c")
    a, b = sandbox.cache_dir(s, "CN=a"), sandbox.cache_dir(s, "CN=../../etc")
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == "/c"


def test_exit_causes():
    assert exit_cause(-9, False) == "signal SIGKILL"
    assert exit_cause(134, True) == "signal SIGABRT"  # bwrap: 128 + N
    assert exit_cause(134, False) == "exit 134"
    assert exit_cause(1, True) == "exit 1"


# ----------------------------------------------------------------------------- process and pool
def test_a_process_is_ready_once_it_listens_and_its_output_is_logged(caplog):
    """A stand-in server (python listening on the port it is given) through ServerProcess."""
    code = ("import socket,sys,time;a=sys.argv;s=socket.socket();s.bind(('127.0.0.1',int(a[a.index('-p')+1])));"
            "s.listen();print('hello from the server',flush=True);time.sleep(60)")

    async def run() -> tuple[bool, str, float]:
        port = sandbox_free_port()
        proc = ServerProcess([sys.executable, "-c", code, "-H", "127.0.0.1", "-p", str(port)], port=port,
                             listener="l0", number=1, wrapped=False, limits=[], netns=False)
        await proc.start(10)
        ok = listening(proc.pid, port)
        sock = await proc.connect(5)
        sock.close()
        deadline = asyncio.get_running_loop().time() + 30  # the server's line read and logged
        while not any("hello from the server" in r.getMessage() for r in caplog.records):
            assert asyncio.get_running_loop().time() < deadline, "the server's output was not logged"
            await asyncio.sleep(0.01)
        proc.kill()
        status = await proc.exited  # type: ignore[misc]
        return ok, exit_cause(status, False), proc.ready_s

    with caplog.at_level("INFO", logger="rpcguard.upstream"):
        ok, cause, ready_s = asyncio.run(run())
    assert ok and cause == "signal SIGKILL" and ready_s > 0
    assert any("listener=l0 process=1" in r.getMessage() and "hello from the server" in r.getMessage()
               for r in caplog.records)


def sandbox_free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """What the pool reads of a ServerProcess."""

    def __init__(self, identity=None):
        self.alive, self.killed, self.clean, self.identity = True, False, True, identity
        self.session, self.session_identity, self.sessions = 0, "", 0

    def kill(self):
        self.killed, self.alive = True, False


def _pool(**kw) -> UpstreamPool:
    return UpstreamPool("l0", UpstreamSettings(exec=(TRUE,), spare=False, **kw), _mech())


@pytest.mark.parametrize("commands, kept", [
    ({"HELLO": {}, "DEVICE_COUNT": {}, "GET_DEVICE_MEMORY": {}}, True),  # a probe: no tenant data
    ({"HELLO": {}, "ALLOC_BUFFER": {}}, False),
])
def test_only_probe_sessions_leave_their_process_for_the_next_session(commands, kept):
    assert (set(commands) <= PROBE_COMMANDS) == kept
    pool = _pool()
    proc = _Proc()
    pool.by_link[1] = proc  # type: ignore[assignment]
    pool.ended(1, {"identity": "CN=a", "result": "ok", "commands": commands})
    assert (pool.kept is proc) == kept and proc.killed != kept


def test_identity_isolation_keeps_the_process_whatever_the_session_did():
    pool = _pool(isolation="identity")
    proc = _Proc()
    pool.by_link[1] = proc  # type: ignore[assignment]
    pool.ended(1, {"identity": "CN=a", "result": "ok", "commands": {"ALLOC_BUFFER": {}}})
    assert pool.kept is proc and not proc.killed


def test_quarantine_after_n_crashes_of_one_identity_only():
    pool = _pool(quarantine_crashes=2, quarantine_window_s=60, quarantine_s=30)
    for link in (1, 2):
        pool.by_link[link] = _Proc()  # type: ignore[assignment]
        assert pool.quarantined("CN=a") is None
        pool.ended(link, {"identity": "CN=a", "result": "error", "reason": "upstream_crashed"})
    refusal = pool.quarantined("CN=a")
    assert refusal is not None and refusal.reason == "identity_quarantined"
    assert pool.quarantined("CN=b") is None and pool.crashes == 2 and pool.quarantines == 1


def test_a_required_sandbox_that_is_missing_stops_the_start():
    from rpcguard.upstream.pool import SandboxUnavailable
    pool = UpstreamPool("l0", UpstreamSettings(exec=(TRUE,)), _mech(missing={"namespaces": "no bwrap"}))
    with pytest.raises(SandboxUnavailable, match="namespaces: no bwrap"):
        asyncio.run(pool.start())


def test_contained_means_a_process_per_session_in_the_full_sandbox():
    full, nothing = _mech(), _mech(missing={"own_uid": "not root"})
    assert UpstreamPool("l", UpstreamSettings(exec=(TRUE,)), full).contained
    assert not UpstreamPool("l", UpstreamSettings(exec=(TRUE,), isolation="identity"), full).contained
    assert not UpstreamPool("l", UpstreamSettings(exec=(TRUE,)), nothing).contained
    off = UpstreamSettings(exec=(TRUE,), sandbox=sandbox.SandboxSettings(mode="off"))
    assert not UpstreamPool("l", off, full).contained


def test_check_config_describes_the_command_it_runs(tmp_path, capsys):
    from rpcguard.config.model import config_summary as describe
    cfg = build_config("serve", overrides=dict(cert=__file__, key=__file__, ca=__file__, listen="127.0.0.1:0",
                                                upstream_exec=["true"], allow_all=True))
    line = describe(cfg)[0]
    assert f"-> exec {os.path.realpath(TRUE)} (isolation=session sandbox=required)" in line, line
