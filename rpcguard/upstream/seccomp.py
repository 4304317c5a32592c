"""The syscall filter of a sandboxed ggml-rpc-server: what the kernel refuses it, built with libseccomp.

How this works: the namespaces take the network, the file system and the other processes away
from the server (sandbox.py); this filter shrinks what is left of the kernel to reach, should code
run inside it after an exploit. ``program()`` asks libseccomp (libseccomp2, through ctypes: the
library every container runtime uses for this) for a classic BPF program that allows every
syscall but those of ``DENIED``, which fail with EPERM: kernel modules and kexec, new namespaces
(``unshare``, ``setns``, ``clone`` with a namespace flag; ``clone3`` fails with ENOSYS, so the C
library falls back to ``clone``, whose flags a filter can see), tracing and other processes'
memory, eBPF, perf, userfaultfd, io_uring, the kernel keyring, mounts, swap, clocks, reboot. A
syscall of another architecture (32-bit calls on x86-64) kills the process: libseccomp's default
for a foreign architecture. The server needs none of them (CPU and CUDA backends: sockets, files,
mmap, ioctl, futex, threads). bwrap loads the program (``--seccomp FD``) right before it runs the
server, so it covers setpriv and the server, not the sandbox's set-up. Docker's default profile
denies the same families; the list here is ours.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

__all__ = ["DENIED", "program", "unavailable"]

# Syscalls the server never makes, refused with EPERM (a name this architecture does not have is
# skipped).
DENIED: tuple[str, ...] = (
    # kernel code and kernels
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    # namespaces and mounts (its sandbox is made for it; it makes none of its own)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick",
    # other processes, tracing, the kernel's less-travelled attack surface
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "fanotify_init", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at",
    # the machine's state
    "reboot", "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "syslog", "acct", "quotactl", "iopl", "ioperm", "vhangup", "uselib", "nfsservctl",
)
# clone(2)'s namespace flags (linux/sched.h): a clone asking for any of them fails with EPERM.
CLONE_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

_ACT_ALLOW = 0x7FFF0000  # seccomp.h SCMP_ACT_ALLOW


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp: (arg & datum_a) == datum_b with op SCMP_CMP_MASKED_EQ."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


_CMP_MASKED_EQ = 7  # enum scmp_compare


@functools.cache
def _build() -> tuple[bytes, str]:
    """(the BPF program, "") or (b"", why it cannot be built here)."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        return b"", f"libseccomp is not installed (Debian: apt-get install libseccomp2): {exc}"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        return b"", "seccomp_init failed"
    try:
        def rule(action: int, syscall: str, *cmps: _ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(syscall.encode())
            if nr < 0:  # not a syscall of this architecture
                return
            array = (_ArgCmp * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add {syscall}: {os.strerror(-rc)}")

        for syscall in DENIED:
            rule(_act_errno(errno.EPERM), syscall)
        for flag in CLONE_NS_FLAGS:
            rule(_act_errno(errno.EPERM), "clone", _ArgCmp(0, _CMP_MASKED_EQ, flag, flag))
        rule(_act_errno(errno.ENOSYS), "clone3")  # its flags live in memory: no filter can read them
        fd = os.memfd_create("rpcguard-seccomp", 0)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                return b"", f"seccomp_export_bpf: {os.strerror(-rc)}"
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
            return b"".join(chunks), ""
        finally:
            os.close(fd)
    except OSError as exc:
        return b"", str(exc)
    finally:
        lib.seccomp_release(ctx)


def program() -> bytes:
    """The filter as a BPF program (struct sock_filter[]), for bwrap's ``--seccomp FD``."""
    return _build()[0]


def unavailable() -> str:
    """Why the filter cannot be built on this host, or "" when it can."""
    return _build()[1]
