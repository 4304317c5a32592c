"""Per-session traffic counters: plain Python ints in preallocated lists.

How this works: the proxy handles every frame of every session on one asyncio thread, so
the hot path needs no locks. A session owns one :class:`SessionStats`; counting a frame is
two list-element increments indexed by the command id
(``stats.req_frames[cmd] += 1; stats.req_bytes[cmd] += n``), done directly by the protocol
session. Latency is kept as per-command, *non-cumulative* bucket counts; the exporter in
``rpcguard.observe.metrics`` makes them cumulative at scrape time. When a session ends its counters
are folded into a per-listener totals object with :meth:`SessionStats.add_into`.

Sans-IO: no asyncio, socket, ssl or prometheus imports here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from typing import Final

from rpcguard.protocol.versions import COMMAND_NAMES

__all__ = [
    "N_COMMANDS",
    "LATENCY_BUCKETS_S",
    "LATENCY_BUCKETS_NS",
    "N_LATENCY_BUCKETS",
    "DEFAULT_COMMAND_NAMES",
    "command_name",
    "SessionStats",
]

# Command ids are one byte on the wire but the protocol defines fewer than 20; 32 slots
# leave room for new versions while keeping each per-session list tiny. The session must
# refuse (and not count) ids >= N_COMMANDS: indexing past the end raises IndexError.
N_COMMANDS: Final = 32

# Upper bounds (inclusive, Prometheus "le") of the command latency histogram, in seconds.
# From 100 µs (GET_ALIGNMENT on loopback) to 10 s (a large GRAPH_COMPUTE); +Inf is implied.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# The same bounds in integer nanoseconds, so observe_latency() bisects ints, no float math.
LATENCY_BUCKETS_NS: tuple[int, ...] = tuple(round(b * 1_000_000_000) for b in LATENCY_BUCKETS_S)
# Number of per-command bucket slots: one per bound plus the +Inf slot (last index).
N_LATENCY_BUCKETS: Final = len(LATENCY_BUCKETS_S) + 1

# Command names (the wire ids of protocol/versions.py), used for metric labels and the
# audit log. Ids missing here are named "CMD_<n>" (see command_name()).
DEFAULT_COMMAND_NAMES: Mapping[int, str] = dict(enumerate(COMMAND_NAMES))


def command_name(names: Mapping[int, str], cmd: int) -> str:
    """Return the label value for command id ``cmd``: its name, or ``CMD_<n>`` if unknown."""
    name = names.get(cmd)
    return name if name is not None else f"CMD_{cmd}"


class SessionStats:
    """Counters of one session (or, as a totals object, of many finished sessions).

    Lists are indexed by command id, ``0 <= cmd < N_COMMANDS``. The protocol session
    increments ``req_frames``/``req_bytes``/``rsp_frames``/``rsp_bytes`` (wire bytes incl.
    headers) and the scalar counters directly; latencies go through :meth:`observe_latency`.
    Not thread-safe by design: only the event-loop thread touches it.
    """

    __slots__ = (
        "req_frames", "req_bytes", "rsp_frames", "rsp_bytes",
        "lat_buckets", "lat_sum_ns", "lat_count",
        "alloc_bytes", "upload_bytes_set", "upload_bytes_hash_hit",
        "rdma_caps_zeroed_req", "rdma_caps_zeroed_rsp", "hash_answered_by_proxy",
    )

    def __init__(self) -> None:
        self.req_frames: list[int] = [0] * N_COMMANDS
        self.req_bytes: list[int] = [0] * N_COMMANDS
        self.rsp_frames: list[int] = [0] * N_COMMANDS
        self.rsp_bytes: list[int] = [0] * N_COMMANDS
        # [cmd][bucket]: count of observations whose bucket is exactly that one (not cumulative);
        # index N_LATENCY_BUCKETS - 1 is +Inf.
        self.lat_buckets: list[list[int]] = [[0] * N_LATENCY_BUCKETS for _ in range(N_COMMANDS)]
        self.lat_sum_ns: list[int] = [0] * N_COMMANDS
        self.lat_count: list[int] = [0] * N_COMMANDS
        self.alloc_bytes = 0  # ALLOC_BUFFER sizes granted by the upstream
        self.upload_bytes_set = 0  # SET_TENSOR payload bytes
        self.upload_bytes_hash_hit = 0  # bytes the upstream had cached (SET_TENSOR_HASH hit)
        self.rdma_caps_zeroed_req = 0  # RDMA capability fields zeroed in requests
        self.rdma_caps_zeroed_rsp = 0  # ... and in responses
        self.hash_answered_by_proxy = 0  # SET_TENSOR_HASH answered "not cached" by the proxy (shared cache)

    def observe_latency(self, cmd: int, ns: int) -> None:
        """Record one request-to-response-header latency of ``ns`` nanoseconds for ``cmd``.

        A value equal to a bound lands in that bound's bucket (Prometheus ``le``).
        """
        self.lat_buckets[cmd][bisect_left(LATENCY_BUCKETS_NS, ns)] += 1
        self.lat_sum_ns[cmd] += ns
        self.lat_count[cmd] += 1

    def add_into(self, other: SessionStats) -> None:
        """Add every counter of this object into ``other`` (e.g. fold a session into totals)."""
        for name in ("req_frames", "req_bytes", "rsp_frames", "rsp_bytes", "lat_sum_ns", "lat_count"):
            mine: list[int] = getattr(self, name)
            theirs: list[int] = getattr(other, name)
            for i, v in enumerate(mine):
                if v:
                    theirs[i] += v
        for cmd, count in enumerate(self.lat_count):
            if count:
                dst = other.lat_buckets[cmd]
                for i, v in enumerate(self.lat_buckets[cmd]):
                    if v:
                        dst[i] += v
        other.alloc_bytes += self.alloc_bytes
        other.upload_bytes_set += self.upload_bytes_set
        other.upload_bytes_hash_hit += self.upload_bytes_hash_hit
        other.rdma_caps_zeroed_req += self.rdma_caps_zeroed_req
        other.rdma_caps_zeroed_rsp += self.rdma_caps_zeroed_rsp
        other.hash_answered_by_proxy += self.hash_answered_by_proxy

    def per_command(self, names: Mapping[int, str] = DEFAULT_COMMAND_NAMES) -> dict[str, dict[str, int]]:
        """Frame and byte counts by command name, for the audit log.

        Only commands with at least one non-zero counter appear, in command-id order::

            {"SET_TENSOR": {"req_frames": 3, "req_bytes": 4096, "rsp_frames": 0, "rsp_bytes": 0}}
        """
        out: dict[str, dict[str, int]] = {}
        for cmd in range(N_COMMANDS):
            qf, qb, sf, sb = self.req_frames[cmd], self.req_bytes[cmd], self.rsp_frames[cmd], self.rsp_bytes[cmd]
            if qf or qb or sf or sb:
                out[command_name(names, cmd)] = {
                    "req_frames": qf, "req_bytes": qb, "rsp_frames": sf, "rsp_bytes": sb,
                }
        return out

    def __repr__(self) -> str:
        return f"SessionStats({self.per_command()!r})"
