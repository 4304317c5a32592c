"""The sandbox of one ggml-rpc-server process: the bubblewrap command line, rlimits, mechanisms.

How this works: ``probe()`` finds out once which mechanisms work on this host (bubblewrap
present and able to make its namespaces, root to drop to a uid of our own and to enter the
server's network namespace, setpriv). ``command()`` wraps the server's argv in::

    bwrap --unshare-{ipc,pid,net,uts,cgroup-try} --die-with-parent --new-session --clearenv
          --ro-bind /usr ... (the system's libraries, read-only)  --proc /proc --dev /dev
          --tmpfs /tmp  --ro-bind FILE FILE (each file named on the command line: the binary,
          and the lib*.so* beside it for its $ORIGIN)  --bind CACHE /cache (per identity)
          --dev-bind-try /dev/nvidia* /dev/dri /dev/kfd (GPU nodes, when present)
          --seccomp M (the syscall filter of seccomp.py)  --info-fd N   setpriv --reuid UID --regid UID --clear-groups --inh-caps=-all
          --bounding-set=-all --no-new-privs -- SERVER ARGS -H 127.0.0.1 -p PORT

so the server sees only its binary, the system libraries, its own cache and /tmp, runs as an
unprivileged uid with no capabilities in fresh PID/IPC/UTS namespaces (it cannot name, signal
or trace any process outside), and lives in a network namespace holding only its own loopback:
nothing outside can be reached from it, and rpcguard reaches its port by creating each
session's socket inside that namespace (process.py, ``setns`` in a helper thread). ``rlimits()``
are applied to the spawned process and inherited: no core dumps, a bounded data segment, few
open files. A missing mechanism is named in ``Mechanisms.missing``; the pool refuses to start
(``sandbox: required``) or starts with a warning and a metric (``best_effort``).
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

from rpcguard.upstream import seccomp

__all__ = ["MECHANISMS", "Mechanisms", "SandboxSettings", "probe", "command", "rlimits", "cache_dir",
           "SANDBOX_PORT", "SANDBOX_MODES"]

# What the sandbox is made of; each one is reported (metric, log) when missing.
MECHANISMS = ("namespaces", "network_namespace", "own_uid", "rlimits", "seccomp")
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


@dataclass
class Mechanisms:
    """What works on this host; ``missing`` names what does not, with why."""

    bwrap: str | None = None
    setpriv: str | None = None
    root: bool = False
    missing: dict[str, str] = field(default_factory=dict)

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
    cmd += _system_binds() + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    cmd += _command_binds(argv, settings.ro_paths)
    for pattern in _GPU_NODES:
        for node in sorted(glob.glob(pattern)):
            cmd += ["--dev-bind-try", node, node]
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


def rlimits(settings: SandboxSettings) -> list[tuple[int, int]]:
    """(resource, limit) pairs for the server: no core dumps (they would hold tenant data), a
    bounded data segment, few open files."""
    out = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, settings.nofile)]
    data = settings.data_bytes or host_memory_bytes()
    if data:
        out.append((resource.RLIMIT_DATA, data))
    if settings.cache_bytes:  # no cache file larger than the identity's whole quota
        out.append((resource.RLIMIT_FSIZE, settings.cache_bytes))
    return out


def prune_cache(directory: str, limit: int) -> tuple[int, int]:
    """Delete the oldest files (by modification time) of an identity's cache directory until it
    uses at most ``limit`` bytes of disk; returns (files removed, bytes freed). Only regular files
    count and go (their allocated blocks: a sparse file counts what it holds); links are neither
    followed nor removed. ``limit`` 0: nothing is removed."""
    if limit <= 0:
        return 0, 0
    files: list[tuple[float, int, str]] = []
    used = 0
    for root, _dirs, names in os.walk(directory, followlinks=False):
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                size = st.st_blocks * 512
                files.append((st.st_mtime, size, path))
                used += size
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
