"""The sandbox of one ggml-rpc-server process: the bubblewrap command line, rlimits, mechanisms.

Stays whole (over 400 lines): the probe of what this host allows and the command line built from
it must agree mechanism by mechanism (bubblewrap, namespaces, seccomp, rlimits, GPU binds).

How this works: ``probe()`` finds out once which mechanisms work on this host (bubblewrap
present and able to make its namespaces, root to drop to a uid of our own and to enter the
server's network namespace, setpriv). ``command()`` wraps the server's argv in::

    bwrap --unshare-{ipc,pid,net,uts,cgroup-try} --die-with-parent --new-session --clearenv
          --ro-bind /usr ... (the system's libraries, read-only)  --proc /proc --dev /dev
          --tmpfs /tmp  --ro-bind FILE FILE (each file named on the command line: the binary,
          and the lib*.so* beside it for its $ORIGIN)  --bind CACHE /cache (per identity)
          --dev-bind /dev/nvidia<minor> of the GPUs -d selects, nvidiactl, nvidia-uvm (gpu.py)
          --seccomp M (the syscall filter of seccomp.py)  --info-fd N   setpriv --reuid UID --regid UID --clear-groups --inh-caps=-all
          --bounding-set=-all --no-new-privs -- SERVER ARGS -H 127.0.0.1 -p PORT

so the server sees only its binary, the system libraries, its own cache and /tmp, runs as an
unprivileged uid with no capabilities in fresh PID/IPC/UTS namespaces (it cannot name, signal
or trace any process outside), and lives in a network namespace holding only its own loopback:
nothing outside can be reached from it, and rpcguard reaches its port by creating each
session's socket inside that namespace (process.py, ``setns`` in a helper thread). ``rlimits()``
are applied to the spawned process and inherited: no core dumps, a bounded data segment, few
open files. ``limits()`` decides what bounds the whole process tree (code running inside may
fork): a control group per process (cgroup.py: ``memory.max`` and ``pids.max`` summed over the
tree) where serve can make one; otherwise RLIMIT_AS per process (times the pids limit for the
tree) and RLIMIT_NPROC, which counts the server's own uid (root: one uid per process). An ASan
build (``__asan_init`` in a binary of the command) reserves terabytes of shadow address space, so
it runs without RLIMIT_DATA/RLIMIT_AS: the cgroup is then its only memory bound. A missing
mechanism is named in ``Mechanisms.missing``; the pool refuses to start (``sandbox: required``)
or starts with a warning and a metric (``best_effort``).
"""

from __future__ import annotations

import glob
import hashlib
import os
import resource
import shutil
import stat
import subprocess
from dataclasses import dataclass, field

from rpcguard.upstream import cgroup, gpu, seccomp

__all__ = ["MECHANISMS", "Mechanisms", "SandboxSettings", "Limits", "probe", "command", "rlimits", "limits",
           "cache_dir", "cache_over_quota", "is_asan", "probe_cgroups", "SANDBOX_PORT", "SANDBOX_MODES"]

# What the sandbox is made of; each one is reported (metric, log) when missing.
MECHANISMS = ("namespaces", "network_namespace", "own_uid", "rlimits", "seccomp", "pids_limit")
SANDBOX_MODES = ("required", "best_effort", "off")
# The port the server listens on inside its own network namespace: every sandbox has its own
# loopback, so all of them can use the same one.
SANDBOX_PORT = 50052
_GPU_NODES = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri", "/dev/kfd")
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
_CACHE_IN_SANDBOX = "/cache"
SECCOMP_FD = "{SECCOMP_FD}"  # in command(): replaced by the descriptor of the filter at each start
_MOUNTED = ("/proc", "/dev", "/tmp")  # made by bwrap before the command's binds (which may lie below /tmp)


@dataclass(frozen=True)
class SandboxSettings:
    """``upstream.sandbox`` of a listener."""

    mode: str = "required"  # required | best_effort | off
    uid_base: int = 61000  # the servers' uids: uid_base .. uid_base + uid_count - 1, one per process
    uid_count: int = 1000
    cache_root: str = "/var/cache/rpcguard/upstream"  # one 0700 directory per identity below it
    data_bytes: int = 0  # RLIMIT_DATA; 0: the host's memory (MemTotal)
    nofile: int = 256  # RLIMIT_NOFILE: the server needs a handful (one client, its cache files)
    # An identity's cache directory holds at most this much (disk blocks) when its server starts:
    # the oldest files go first (prune_cache); no file of the server may grow past it
    # (RLIMIT_FSIZE). 0: no quota. During one session the directory grows by at most what that
    # session uploads with the cache flag.
    cache_bytes: int = 100 << 30
    ro_paths: tuple[str, ...] = ()  # more read-only paths the command needs (a wrapper's data)
    # The whole process tree's memory (a cgroup's memory.max; without one, RLIMIT_AS per process).
    # 0: data_bytes, or the host's memory when that is 0 too.
    memory_bytes: int = 0
    # Tasks (processes and threads) of the tree: pids.max, and RLIMIT_NPROC of the server's own
    # uid. 0: 64 + 4 per CPU (the server runs one thread per CPU and a few of its own).
    pids: int = 0
    tmp_bytes: int = 64 << 20  # the sandbox's /tmp (a tmpfs: memory); bwrap >= 0.7 (--size)
    # The server's output copied into serve's log: at most this many lines per second (a burst
    # of log_burst lines) and log_bytes in all per process; the rest is counted and dropped, and
    # one line says how much was.
    log_lines_per_s: int = 20
    log_burst: int = 200
    log_bytes: int = 1 << 20


@dataclass
class Mechanisms:
    """What works on this host; ``missing`` names what does not, with why."""

    bwrap: str | None = None
    setpriv: str | None = None
    root: bool = False
    missing: dict[str, str] = field(default_factory=dict)
    cgroups: cgroup.Cgroups = field(default_factory=lambda: cgroup.Cgroups(why="not probed"))
    cgroups_probed: bool = False
    tmpfs_size: bool = False  # bwrap knows --size (0.7.0 and later)

    @property
    def namespaces(self) -> bool:
        return "namespaces" not in self.missing


def probe() -> Mechanisms:
    """Which sandbox mechanisms work here (runs bwrap once, ~10 ms)."""
    m = Mechanisms(bwrap=shutil.which("bwrap"), setpriv=shutil.which("setpriv"), root=os.geteuid() == 0)
    if m.bwrap is None:
        m.missing["namespaces"] = "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
    else:
        userns = [] if m.root else ["--unshare-user"]
        try:
            done = subprocess.run([m.bwrap, *userns, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                                   "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true"],
                                  capture_output=True, timeout=10)
            if done.returncode != 0:
                why = done.stderr.decode(errors="replace").strip().splitlines()
                m.missing["namespaces"] = f"bwrap cannot create namespaces here: {why[-1] if why else done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            m.missing["namespaces"] = f"bwrap failed: {exc}"
        try:
            m.tmpfs_size = "--size" in subprocess.run([m.bwrap, "--help"], capture_output=True, text=True,
                                                      timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    if "namespaces" in m.missing:
        m.missing["network_namespace"] = "needs the namespaces"
        m.missing["seccomp"] = "loaded by bwrap: needs the namespaces"
    elif seccomp.unavailable():
        m.missing["seccomp"] = seccomp.unavailable()
    # (not root: rpcguard cannot enter the server's network namespace itself, CAP_SYS_ADMIN in its
    # own user namespace; nshelper.py enters the sandbox's user namespace first, which it owns)
    if not m.root or m.setpriv is None:
        m.missing["own_uid"] = ("rpcguard is not root: the server runs as rpcguard's own uid" if not m.root
                                else "setpriv (util-linux) is not installed")
    return m


def probe_cgroups(m: Mechanisms) -> None:
    """Where serve can make its servers' cgroups (cgroup.probe; on cgroup v2 it may move serve into
    a leaf of its own cgroup: done by serve at start, never by check-config). Once per Mechanisms."""
    if m.cgroups_probed:
        return
    m.cgroups_probed = True
    m.cgroups = cgroup.probe()
    if not m.cgroups.available and "own_uid" in m.missing:
        m.missing["pids_limit"] = (f"no cgroup ({m.cgroups.why}), and RLIMIT_NPROC would count rpcguard's own "
                                   f"processes (the server has no uid of its own)")


def cache_dir(settings: SandboxSettings, identity: str) -> str:
    """The identity's own cache directory (a digest of the identity: no path tricks in names)."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:24] if identity else "anonymous"
    return os.path.join(settings.cache_root, digest)


def _system_binds() -> list[str]:
    out: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives"):
        if os.path.exists(path):
            out += ["--ro-bind", path, path]
    return out


def _command_binds(argv: list[str], extra: tuple[str, ...]) -> list[str]:
    """Each file the command line names, and the shared libraries beside it (lib*.so*: a binary
    with RUNPATH $ORIGIN loads them from there), read-only at their paths; nothing else of their
    directories (a config or a key next to the binary stays out)."""
    files: list[str] = []
    for arg in argv:
        if os.path.isabs(arg) and os.path.isfile(arg):
            real = os.path.realpath(arg)
            d = os.path.dirname(real)
            if any(d == p or d.startswith(p + "/") for p in _SYSTEM_DIRS):
                continue
            files.append(real)
            try:
                files += sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("lib") and ".so" in n)
            except OSError:
                pass
    out: list[str] = []
    made: set[str] = set(_MOUNTED)
    for path in [*dict.fromkeys(files), *extra]:
        # bwrap would copy the mode of the host's parents (/root is 0700): the server's uid
        # could not reach its own binary. Its parents are made 0755 (empty but for the binds).
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            if parent not in made and parent not in _SYSTEM_DIRS:
                made.add(parent)
                out += ["--perms", "0755", "--dir", parent]
        out += ["--ro-bind", path, path]
    return out


def command(argv: list[str], *, port: int, mech: Mechanisms, settings: SandboxSettings, cache: str | None,
            uid: int, info_fd: str) -> list[str]:
    """The full command line: the server's ``argv`` (argv[0] resolved) with ``-H 127.0.0.1 -p PORT``,
    inside the sandbox when the namespaces work (else as is, with its rlimits)."""
    server = [*argv, "-H", "127.0.0.1", "-p", str(port)]
    if settings.mode == "off" or not mech.namespaces:
        return server
    assert mech.bwrap is not None
    cmd = [mech.bwrap]
    if not mech.root:
        cmd += ["--unshare-user", "--cap-drop", "ALL"]
    cmd += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "GGML_NO_BACKTRACE", "1"]
    cmd += _system_binds() + ["--proc", "/proc", "--dev", "/dev"]
    if mech.tmpfs_size and settings.tmp_bytes:  # a tmpfs is memory: without a size, half the host's
        cmd += ["--size", str(settings.tmp_bytes)]
    cmd += ["--tmpfs", "/tmp"]
    cmd += _command_binds(argv, settings.ro_paths)
    # the GPUs -d selects, the driver's control nodes and libraries, nothing else (gpu.py, issue 29;
    # raises gpu.GpuUnavailable naming what is missing)
    cmd += list(gpu.gpu_binds(argv).args)
    if cache is not None:
        cmd += ["--bind", cache, _CACHE_IN_SANDBOX, "--setenv", "LLAMA_CACHE", _CACHE_IN_SANDBOX]
    if "seccomp" not in mech.missing:  # the syscall filter (seccomp.py), on a file descriptor process.py fills
        cmd += ["--seccomp", SECCOMP_FD]
    cmd += ["--info-fd", info_fd, "--"]
    if mech.root and mech.setpriv is not None:
        cmd += [mech.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]
    return cmd + server


def host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_pids() -> int:
    """``pids: 0``: 64 + 4 per CPU (the server's threads: one per CPU for the CPU backend, a few for
    itself and a GPU runtime)."""
    return 64 + 4 * (os.cpu_count() or 1)


def tree_memory_bytes(settings: SandboxSettings) -> int:
    """The process tree's memory bound: memory_bytes, else data_bytes, else the host's memory."""
    return settings.memory_bytes or settings.data_bytes or host_memory_bytes()


def rlimits(settings: SandboxSettings, *, cgroup: bool = False, own_uid: bool = False, asan: bool = False,
            gpu: bool = False) -> list[tuple[int, int]]:
    """(resource, limit) pairs for the server: no core dumps (they would hold tenant data), a
    bounded data segment (not for ASan: its shadow is a data mapping of terabytes), few open files,
    and where no cgroup bounds the tree: RLIMIT_AS per process (not for ASan, nor a GPU runtime,
    which reserves more address space than the host has memory) and RLIMIT_NPROC (only when the
    server has a uid of its own: the limit counts every process of its uid)."""
    out = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, settings.nofile)]
    data = settings.data_bytes or host_memory_bytes()
    if data and not asan:
        out.append((resource.RLIMIT_DATA, data))
    if settings.cache_bytes:  # no cache file larger than the identity's whole quota
        out.append((resource.RLIMIT_FSIZE, settings.cache_bytes))
    if own_uid:
        out.append((resource.RLIMIT_NPROC, settings.pids or default_pids()))
    if not cgroup and not asan and not gpu:
        out.append((resource.RLIMIT_AS, tree_memory_bytes(settings)))
    return out


@dataclass(frozen=True)
class Limits:
    """What bounds one listener's server processes, and by which mechanism (the start-up log)."""

    rlimits: list[tuple[int, int]]
    memory_bytes: int  # the cgroup's memory.max (0: no cgroup)
    pids: int  # the cgroup's pids.max (0: no cgroup)
    memory_by: str
    pids_by: str
    asan: bool
    # (mechanism, value) for rpcguard_upstream_limit: cgroup_v2 | cgroup_v1 | rlimit_as | rlimit_data |
    # rlimit_nproc | none
    gauges: tuple[tuple[str, str, int], ...] = ()

    def describe(self) -> str:
        return f"memory: {self.memory_by}; tasks: {self.pids_by}" + \
            ("; an ASan build: no RLIMIT_DATA/RLIMIT_AS" if self.asan else "")


def is_asan(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether a file the command names is built with AddressSanitizer (its ``__asan_init``)."""
    import mmap

    for arg in argv:
        if os.path.isabs(arg) and os.path.isfile(arg) and os.access(arg, os.X_OK):
            try:
                with open(arg, "rb") as f:
                    if f.read(4) != b"\x7fELF":  # only programs (not a model a wrapper names)
                        continue
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                        if m.find(b"__asan_init") >= 0:
                            return True
            except (OSError, ValueError):
                continue
    return False


def limits(settings: SandboxSettings, mech: Mechanisms, argv: list[str] | tuple[str, ...]) -> Limits:
    """The limits of a listener's processes (see the module docstring)."""
    confined = settings.mode != "off" and mech.namespaces
    by_cgroup = confined and mech.cgroups.available
    own_uid = confined and "own_uid" not in mech.missing
    asan = is_asan(argv)
    gpu = any(glob.glob(p) for p in _GPU_NODES)
    pids = settings.pids or default_pids()
    tree = tree_memory_bytes(settings)
    rl = rlimits(settings, cgroup=by_cgroup, own_uid=own_uid, asan=asan, gpu=gpu)
    have = dict(rl)
    if by_cgroup:
        memory_by = f"cgroup v{mech.cgroups.version} limit {tree} bytes for the whole process tree"
        pids_by = f"cgroup v{mech.cgroups.version} pids.max {pids} for the whole process tree"
    else:
        why = mech.cgroups.why if confined else "sandbox off"
        if resource.RLIMIT_AS in have:
            memory_by = f"RLIMIT_AS {tree} bytes per process (no cgroup: {why})"
        elif resource.RLIMIT_DATA in have:
            memory_by = f"RLIMIT_DATA {have[resource.RLIMIT_DATA]} bytes per process only (no cgroup: {why})"
        else:
            memory_by = f"none (no cgroup: {why})"
        pids_by = f"RLIMIT_NPROC {pids} for the server's uid" if own_uid else f"none (no cgroup: {why})"
    cg = f"cgroup_v{mech.cgroups.version}"
    mem_gauge = (cg, tree) if by_cgroup else ("rlimit_as", tree) if resource.RLIMIT_AS in have else \
        ("rlimit_data", have[resource.RLIMIT_DATA]) if resource.RLIMIT_DATA in have else ("none", 0)
    pids_gauge = (cg, pids) if by_cgroup else ("rlimit_nproc", pids) if own_uid else ("none", 0)
    return Limits(rl, tree if by_cgroup else 0, pids if by_cgroup else 0, memory_by, pids_by, asan,
                  (("memory", *mem_gauge), ("tasks", *pids_gauge)))


def cache_over_quota(directory: str, limit: int, since: float) -> tuple[int, int]:
    """While a session runs: (bytes the identity's cache directory uses, bytes removed). Over
    ``limit``, files older than ``since`` (the process's start: earlier sessions' files) go first,
    oldest first; what is left over the limit is the running session's own (the caller ends it)."""
    if limit <= 0:
        return 0, 0
    files = _cache_files(directory)
    used = sum(size for _m, size, _p in files)
    freed = 0
    for mtime, size, path in sorted(files):
        if used - freed <= limit or mtime >= since:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        freed += size
    return used - freed, freed


def _cache_files(directory: str) -> list[tuple[float, int, str]]:
    """(mtime, allocated bytes, path) of each regular file below ``directory`` (links not followed)."""
    files: list[tuple[float, int, str]] = []
    for root, _dirs, names in os.walk(directory, followlinks=False):
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files.append((st.st_mtime, st.st_blocks * 512, path))
    return files


def prune_cache(directory: str, limit: int) -> tuple[int, int]:
    """Delete the oldest files (by modification time) of an identity's cache directory until it
    uses at most ``limit`` bytes of disk; returns (files removed, bytes freed). Only regular files
    count and go (their allocated blocks: a sparse file counts what it holds); links are neither
    followed nor removed. ``limit`` 0: nothing is removed."""
    if limit <= 0:
        return 0, 0
    files = _cache_files(directory)
    used = sum(size for _m, size, _p in files)
    removed = freed = 0
    for _mtime, size, path in sorted(files):
        if used - freed <= limit:
            break
        try:
            os.unlink(path)
        except OSError:
            continue
        removed += 1
        freed += size
    return removed, freed
