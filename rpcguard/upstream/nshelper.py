"""Connections into a sandbox's network namespace for an rpcguard that is not root.

How this works: a process may enter another network namespace only with CAP_SYS_ADMIN in its own
user namespace, which an unprivileged rpcguard lacks; but it owns the user namespace bubblewrap
made for the sandbox, and a single-threaded process that enters that user namespace first gets
its capabilities there, then may enter the network namespace. rpcguard's event loop is
multi-threaded, so this helper does it instead, once per server process: started by
process.py as ``python -I -S nshelper.py PID PORT FD`` with one end of a socketpair as FD, it
enters the network namespace of PID (through the user namespace owning it), says ``R``, and for every byte it reads connects
to 127.0.0.1:PORT there and passes the connected socket back (SCM_RIGHTS), or answers ``E``.
It never reads what the server sends. The server cannot reach it: the helper is outside the
sandbox's PID namespace and holds capabilities (in the sandbox's user namespace) the server
does not. Standard library only: it runs without site-packages (-S), so it starts in ~20 ms.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NS_GET_USERNS = 0xB701  # linux/nsfs.h _IO(0xb7, 0x1): an fd of the user namespace owning a namespace


def _enter(pid: int) -> None:
    """Enter the user namespace that owns PID's network namespace, then that network namespace.
    (Not PID's own user namespace: unprivileged, bwrap nests a second one for the sandbox's uid.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        owner = fcntl.ioctl(net, NS_GET_USERNS)
        try:
            for fd, flag, name in ((owner, CLONE_NEWUSER, "user"), (net, CLONE_NEWNET, "net")):
                if libc.setns(fd, flag) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {name} of {pid}: {os.strerror(err)}")
        finally:
            os.close(owner)
    finally:
        os.close(net)


def main(argv: list[str]) -> int:
    pid, port, fd = (int(a) for a in argv[:3])
    chan = socket.socket(fileno=fd)
    try:
        _enter(pid)
    except OSError as exc:
        chan.sendall(b"E" + str(exc).encode()[:200])
        return 1
    chan.sendall(b"R")
    while True:
        if not chan.recv(1):
            return 0
        try:
            sock = socket.create_connection(("127.0.0.1", port), 5)
        except OSError:
            chan.sendall(b"E")
            continue
        socket.send_fds(chan, [b"K"], [sock.fileno()])
        sock.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
