"""The sandbox's limits (issue 28 item 5), without a real server: sizes in config, which rlimits
and which cgroup limits a process gets, ASan detection, the output limiter, the cache quota while
a session runs. The in-sandbox proof is tests/integration/test_sandbox_limits_real.py."""

from __future__ import annotations

import logging
import os
import re
import resource
from pathlib import Path

import pytest
import yaml

from rpcguard.config.model import parse_config
from rpcguard.config.upstream import parse_upstream
from rpcguard.errors import ConfigError
from rpcguard.upstream import cgroup, sandbox
from rpcguard.upstream.output import OutputLimiter
from rpcguard.upstream.process import STDERR_LINE_BYTES, ServerProcess

ROOT = Path(__file__).resolve().parents[3]
TRUE = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"


# ----------------------------------------------------------------------------- sizes in config
def _containment_yaml() -> dict:
    text = (ROOT / "docs" / "containment.md").read_text()
    block = re.search(r"```yaml\n(listeners:.*?)```", text, re.S)
    assert block, "docs/containment.md has no yaml example"
    data = yaml.safe_load(block.group(1))
    data["listeners"][0]["upstream"]["exec"] = [TRUE]  # the documented binary need not exist here
    return data


def test_the_documented_100_gib_cache_quota_passes_check_config(tmp_path, capsys):
    """docs/containment.md's example (cache_bytes: 107374182400) through ``rpcguard check-config``
    (it was a config error: sizes were 31-bit counts)."""
    from rpcguard.cli import main
    from tests.support.guard import Pki

    pki = Pki(tmp_path / "pki")
    data = _containment_yaml()
    assert data["listeners"][0]["upstream"]["sandbox"]["cache_bytes"] == 100 << 30
    data["listeners"][0]["listen"] = "127.0.0.1:0"
    data["tls"] = {"cert": pki.path(pki.node), "key": pki.path(pki.node, "key"), "ca": pki.path("ca")}
    data["allow"] = {"cn": ["client1"]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    rc = main(["check-config", str(path)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert parse_config(yaml.safe_load(path.read_text()), "serve").listeners[0].managed.sandbox.cache_bytes == 100 << 30


@pytest.mark.parametrize("key", ["cache_bytes", "data_bytes", "memory_bytes", "tmp_bytes", "log_bytes"])
@pytest.mark.parametrize("value, want", [(2 ** 31, 2 ** 31), (107374182400, 107374182400), ("100GiB", 100 << 30),
                                         ("1.5TiB", 3 << 39), ((1 << 63) - 1, (1 << 63) - 1)])
def test_sizes_of_any_magnitude_are_accepted(key, value, want):
    s = parse_upstream({"exec": [TRUE], "sandbox": {key: value}}, "u")
    assert getattr(s.sandbox, key) == want


@pytest.mark.parametrize("value, message", [(1 << 63, "at most 2^63 - 1"), (-1, ">= 0"), ("lots", "a size in bytes"),
                                            (True, "a size in bytes")])
def test_bad_sizes_name_their_key(value, message):
    with pytest.raises(ConfigError) as e:
        parse_upstream({"exec": [TRUE], "sandbox": {"cache_bytes": value}}, "listeners[0].upstream")
    assert str(e.value).startswith("listeners[0].upstream.sandbox.cache_bytes: ") and message in str(e.value)


# ----------------------------------------------------------------------------- rlimits and cgroups
def _mech(version: int = 0, root: bool = True) -> sandbox.Mechanisms:
    m = sandbox.Mechanisms(bwrap="/usr/bin/bwrap", setpriv="/usr/bin/setpriv", root=root)
    if not root:
        m.missing["own_uid"] = "not root"
    m.cgroups = cgroup.Cgroups(version=version, parents={"memory": "/m", "pids": "/p"} if version else {},
                               why="" if version else "no cgroup here")
    return m


def test_a_cgroup_bounds_the_tree_and_no_per_process_address_space_limit_is_set():
    box = sandbox.SandboxSettings(data_bytes=256 << 20, pids=50)
    lim = sandbox.limits(box, _mech(version=2), [TRUE])
    assert (lim.memory_bytes, lim.pids) == (256 << 20, 50)  # data_bytes bounds the tree when memory_bytes is 0
    rl = dict(lim.rlimits)
    assert resource.RLIMIT_AS not in rl and rl[resource.RLIMIT_DATA] == 256 << 20 and rl[resource.RLIMIT_NPROC] == 50
    assert "cgroup v2" in lim.memory_by and "whole process tree" in lim.pids_by
    assert lim.gauges == (("memory", "cgroup_v2", 256 << 20), ("tasks", "cgroup_v2", 50))


def test_without_a_cgroup_rlimit_as_and_nproc_bound_each_process_and_the_log_says_so():
    lim = sandbox.limits(sandbox.SandboxSettings(memory_bytes=1 << 30, pids=40), _mech(), [TRUE])
    rl = dict(lim.rlimits)
    assert rl[resource.RLIMIT_AS] == 1 << 30 and rl[resource.RLIMIT_NPROC] == 40
    assert (lim.memory_bytes, lim.pids) == (0, 0)
    assert lim.memory_by.startswith("RLIMIT_AS 1073741824 bytes per process (no cgroup: no cgroup here)")
    assert lim.pids_by.startswith("RLIMIT_NPROC 40")
    assert lim.gauges == (("memory", "rlimit_as", 1 << 30), ("tasks", "rlimit_nproc", 40))


def test_not_root_without_a_cgroup_has_no_pids_limit():
    lim = sandbox.limits(sandbox.SandboxSettings(pids=40), _mech(root=False), [TRUE])
    assert resource.RLIMIT_NPROC not in dict(lim.rlimits)  # it would count rpcguard's own processes
    assert lim.pids_by.startswith("none")


def test_an_asan_build_runs_without_data_and_address_space_limits(tmp_path):
    asan = tmp_path / "asan-server"
    asan.write_bytes(b"\x7fELF" + b"\0" * 100 + b"__asan_init\0" + b"\0" * 100)
    plain = tmp_path / "server"
    plain.write_bytes(b"\x7fELF" + b"\0" * 200)
    (tmp_path / "empty").write_bytes(b"")
    model = tmp_path / "model.gguf"  # not a program: never read through
    model.write_bytes(b"GGUF" + b"__asan_init")
    for f in (asan, plain, tmp_path / "empty", model):
        f.chmod(0o755)
    assert not sandbox.is_asan([str(model)])
    assert sandbox.is_asan([str(asan), "-c"]) and not sandbox.is_asan([str(plain), str(tmp_path / "empty")])
    box = sandbox.SandboxSettings(data_bytes=256 << 20)
    rl = dict(sandbox.limits(box, _mech(), [str(tmp_path / "empty"), str(asan)]).rlimits)  # a wrapper, then ASan
    assert resource.RLIMIT_DATA not in rl and resource.RLIMIT_AS not in rl
    with_cg = sandbox.limits(box, _mech(version=1), [str(asan)])
    assert with_cg.asan and with_cg.memory_bytes == 256 << 20 and "ASan" in with_cg.describe()


def test_the_sandbox_tmp_is_a_sized_tmpfs_where_bwrap_can():
    m = _mech()
    m.tmpfs_size = True
    argv = sandbox.command([TRUE], port=1, mech=m, settings=sandbox.SandboxSettings(tmp_bytes=1 << 20), cache=None,
                           uid=61000, info_fd="9")
    i = argv.index("--tmpfs")
    assert argv[i - 2:i + 2] == ["--size", str(1 << 20), "--tmpfs", "/tmp"]
    m.tmpfs_size = False  # bwrap < 0.7 knows no --size
    assert "--size" not in sandbox.command([TRUE], port=1, mech=m, settings=sandbox.SandboxSettings(), cache=None,
                                           uid=61000, info_fd="9")


def test_a_group_gets_its_limits_and_goes_when_empty(tmp_path):
    parent = tmp_path / "v2"
    parent.mkdir()
    cg = cgroup.Cgroups(version=2, parents={"memory": str(parent), "pids": str(parent)})
    g = cg.make("7", 256 << 20, 50)
    d = Path(g.dirs[0])
    assert d.name == f"rpcguard-{os.getpid()}-7"
    assert (d / "memory.max").read_text() == str(256 << 20) and (d / "pids.max").read_text() == "50"
    assert g.procs_files == [str(d / "cgroup.procs")]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    (d / "pids.events").write_text("max 31\n")
    assert g.events() == {"oom_kill": 2, "pids_max": 31}
    for f in d.iterdir():  # (a real cgroup's files go with its rmdir)
        f.unlink()
    assert g.remove() and not d.exists()


def test_groups_of_a_serve_that_is_gone_are_swept(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for name in (f"rpcguard-{dead}-3", f"rpcguard-{os.getpid()}-4", "rpcguard-serve", "other"):
        (tmp_path / name).mkdir()
    cg = cgroup.Cgroups(version=2, parents={"memory": str(tmp_path), "pids": str(tmp_path)})
    assert cg.sweep() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"rpcguard-{os.getpid()}-4", "rpcguard-serve",
                                                                 "other"])


# ----------------------------------------------------------------------------- output
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_limiter_lets_a_burst_through_then_the_rate():
    clock = Clock()
    lim = OutputLimiter(10, 5, 1 << 20, clock)
    assert [lim.admit(10) for _ in range(7)] == [True] * 5 + [False] * 2
    clock.t += 0.5  # 5 more lines' worth
    assert [lim.admit(10) for _ in range(6)] == [True] * 5 + [False]
    assert lim.drops() == (3, 30) and lim.drops() == (0, 0)
    assert (lim.dropped_lines_all, lim.dropped_bytes_all) == (3, 30)


def test_the_limiter_stops_at_its_total():
    clock = Clock()
    lim = OutputLimiter(1000, 1000, 100, clock)
    assert [lim.admit(40) for _ in range(3)] == [True, True, False]
    clock.t += 10
    assert not lim.admit(1) and lim.capped and lim.logged_bytes == 80


def _proc(**kw) -> ServerProcess:
    return ServerProcess([TRUE], port=1, listener="l0", number=1, wrapped=False, limits=[], netns=False,
                         output=OutputLimiter(clock=Clock(), **kw))


def test_a_flood_of_output_is_counted_not_logged(caplog):
    p = _proc(lines_per_s=20, burst=50, total_bytes=1 << 20)
    data = b"".join(b"FLOOD %d\n" % i for i in range(100_000))
    caplog.set_level(logging.INFO, "rpcguard.upstream")
    rest = b""
    for i in range(0, len(data), 65536):  # as the pipe hands it out: lines split across chunks
        rest = p._take_output(rest + data[i:i + 65536])
    assert rest == b""
    logged = [r.getMessage() for r in caplog.records if "FLOOD" in r.getMessage()]
    assert len(logged) == 50 and logged[0].endswith(": FLOOD 0") and logged[-1].endswith(": FLOOD 49")
    assert p.output.dropped_lines_all == 100_000 - 50
    assert p.output.dropped_bytes_all == len(data) - sum(len(b"FLOOD %d\n" % i) for i in range(50))
    assert p.last_stderr == "FLOOD 99999"
    p._report_drops(final=True)
    summary = [r.getMessage() for r in caplog.records if "dropped in all" in r.getMessage()]
    assert len(summary) == 1 and f"{100_000 - 50} lines" in summary[0]


def test_a_line_longer_than_the_cut_is_taken_in_pieces(caplog):
    p = _proc(lines_per_s=1000, burst=1000, total_bytes=1 << 20)
    caplog.set_level(logging.INFO, "rpcguard.upstream")
    rest = p._take_output(b"x" * (3 * STDERR_LINE_BYTES))
    assert rest == b""
    assert [len(r.getMessage().rsplit(": ", 1)[1]) for r in caplog.records] == [STDERR_LINE_BYTES]


# ----------------------------------------------------------------------------- the cache while a session runs
def _file(path: Path, size: int, mtime: float) -> None:
    path.write_bytes(b"c" * size)
    os.utime(path, (mtime, mtime))


def _blocks(path: Path) -> int:
    return os.lstat(path).st_blocks * 512


def test_earlier_sessions_files_go_first_and_the_sessions_own_are_left_over(tmp_path):
    _file(tmp_path / "old1", 64 << 10, 1000)
    _file(tmp_path / "old2", 64 << 10, 2000)
    _file(tmp_path / "new1", 64 << 10, 5000)
    _file(tmp_path / "new2", 64 << 10, 6000)
    each = _blocks(tmp_path / "old1")
    used, freed = sandbox.cache_over_quota(str(tmp_path), 3 * each, since=3000)
    assert (used, freed) == (3 * each, each) and not (tmp_path / "old1").exists() and (tmp_path / "old2").exists()
    used, freed = sandbox.cache_over_quota(str(tmp_path), each, since=3000)
    assert (used, freed) == (2 * each, each)  # the running session's own files: over, the caller ends it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new1", "new2"]
    assert sandbox.cache_over_quota(str(tmp_path), 0, since=3000) == (0, 0)  # 0: no quota


def test_cgroup_v2_serve_moves_into_a_leaf_and_enables_the_controllers_for_its_servers(tmp_path):
    """The v2 path on a fake hierarchy (this VM has memory and pids on v1): serve's own cgroup
    holds serve, so serve moves into rpcguard-serve before enabling memory and pids below it."""
    svc = tmp_path / "system.slice" / "rpcguard-serve.service"
    svc.mkdir(parents=True)
    (svc / "cgroup.controllers").write_text("cpu io memory pids\n")
    (svc / "cgroup.subtree_control").write_text("\n")
    (svc / "cgroup.procs").write_text(f"{os.getpid()}\n")
    found = cgroup._probe_v2(str(tmp_path), "/system.slice/rpcguard-serve.service")
    assert found.version == 2 and found.parents == {"memory": str(svc), "pids": str(svc)}
    assert (svc / "rpcguard-serve" / "cgroup.procs").read_text() == str(os.getpid())
    assert (svc / "cgroup.subtree_control").read_text() == "+memory +pids"
    (svc / "cgroup.controllers").write_text("cpu memory\n")  # pids not delegated
    lacking = cgroup._probe_v2(str(tmp_path), "/system.slice/rpcguard-serve.service")
    assert not lacking.available and "controller(s) pids not delegated" in lacking.why
