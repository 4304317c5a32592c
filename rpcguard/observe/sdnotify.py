"""systemd readiness notifications (``sd_notify``) without a dependency.

How this works: systemd passes ``NOTIFY_SOCKET`` to a ``Type=notify`` / ``notify-reload`` service:
the path of a unix datagram socket, or an abstract-namespace name written with a leading ``@``
(sent as a leading NUL byte). Each notification is one datagram of ``KEY=VALUE`` lines
(sd_notify(3)): ``READY=1`` once every listener is bound and the material loaded,
``RELOADING=1`` + ``MONOTONIC_USEC=`` when a reload starts and ``READY=1`` + ``STATUS=`` when it
is over (``Type=notify-reload`` makes ``systemctl reload`` wait for that), ``STOPPING=1`` on
drain, and ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` when the unit sets ``WatchdogSec=``.
Without ``NOTIFY_SOCKET`` every call is a no-op, so the same code runs outside systemd. A send
that fails (systemd gone, socket full) is ignored: notifications are advisory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Mapping

__all__ = ["Notifier", "monotonic_usec"]

_USEC_PER_S = 1_000_000


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: the clock systemd compares ``MONOTONIC_USEC`` with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends sd_notify datagrams to ``NOTIFY_SOCKET``; a no-op when it is unset."""

    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        self.address: str | bytes | None = None
        if address:
            # "@name" is the abstract namespace: the kernel wants a leading NUL instead.
            self.address = b"\0" + address[1:].encode() if address.startswith("@") else address
        self.watchdog_s = watchdog_usec / _USEC_PER_S
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """From ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` (honouring ``WATCHDOG_PID``)."""
        if env is None:
            env = os.environ
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog = int(usec) if usec.isdigit() and (not pid or pid == str(os.getpid())) else 0
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` fields; True if it was handed to the socket."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode() + b"\n", self.address)
            return True
        except OSError:
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> bool:
        return self.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", "STATUS=reloading")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    async def watchdog(self) -> None:
        """Ping ``WATCHDOG=1`` every half watchdog period for as long as the event loop runs."""
        if not self.enabled or self.watchdog_s <= 0:
            return
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s / 2)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
