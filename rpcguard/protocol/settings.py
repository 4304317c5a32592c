"""What one session is held to: the runtime settings types, in one place.

How this works: these frozen dataclasses are what the hot path and the link lifecycle consult.
``FirewallPolicy`` (which firewall checks run and their caps) sits inside ``SessionPolicy``
(versions, commands, frame caps, mode); ``Limits`` holds the timeouts and session caps of a
listener or tunnel; a ``Profile`` bundles a policy and limits under a name (the listener's
default, or the profile an allow-list entry names). Sans-IO: nothing here reads files or
sockets. Each default is written once, here: ``rpcguard.config.model`` parses YAML straight into these
types by replacing fields of a default instance (``dataclasses.replace``), never by repeating a
default. ``default_policy(role)`` is the one place a role changes a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rpcguard.protocol.cudascratch import MAX_CUDA_SCRATCH_BYTES
from rpcguard.protocol.graph import MAX_GRAPH_COMPUTE_S, MAX_GRAPH_CPU_S, MAX_WORK_BYTES, NODE_GFLOPS, SERVER_THREADS
from rpcguard.protocol.side import SIDES
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, Version

__all__ = ["CHECK_NAMES", "MODES", "VALIDATE_REQUESTS", "UPSTREAM_BUSY", "DEFAULT_PROFILE", "FirewallPolicy",
           "SessionPolicy", "Limits", "Profile", "default_policy"]

#: the allowed values of the choice settings (config/sections.py reads them; the fields hold the defaults)
MODES: tuple[str, ...] = ("enforce", "monitor")  # SessionPolicy.mode
VALIDATE_REQUESTS: tuple[str, ...] = ("auto", "always")  # SessionPolicy.validate_requests
UPSTREAM_BUSY: tuple[str, ...] = ("queue", "refuse")  # Limits.upstream_busy

#: Name of a listener's (or tunnel's) own settings, the profile of identities no entry assigns one.
DEFAULT_PROFILE = "default"

CHECK_NAMES: tuple[str, ...] = (
    "tensor", "buffer_bounds", "graph_structure", "graph_ops", "op_params", "recompute_after_free",
    "device_index",
)  # fmt: skip


@dataclass(frozen=True)
class FirewallPolicy:
    """Which firewall checks run and the caps they use."""

    disabled_checks: frozenset[str] = frozenset()
    # Caps on one GRAPH_COMPUTE: real decode graphs have a few thousand nodes; the server
    # allocates per node and per tensor before validating anything.
    max_graph_nodes: int = 262144
    max_graph_tensors: int = 1048576
    max_alloc_bytes: int = 0  # 0: no cap beyond the server's GET_MAX_SIZE
    # Bytes one session may hold allocated on all devices together; 0: per device, the device
    # memory total the server reports (GET_DEVICE_MEMORY).
    max_session_alloc_bytes: int = 0
    # Opt-in deny list (ggml op names) on top of the custom ops, e.g. GATED_DELTA_NET and
    # SSM_SCAN whose out-of-bounds bugs depend on tensor contents (#25704 / #25765).
    denied_ops: frozenset[str] = frozenset()
    # Default deny: a graph node whose op has no verified rule (oprules/) is refused unless
    # the site names the op here ("*": every op); each use is counted (SessionState.unverified_uses).
    allow_unverified_ops: frozenset[str] = frozenset()
    max_graph_cpu_s: float = MAX_GRAPH_CPU_S  # graph_too_costly past this much validation CPU
    # The compute budget (protocol/cost.py): graph_too_costly when a graph's estimated compute on
    # the node (its flop at node_gflops) exceeds this; 0 turns it off.
    max_graph_compute_s: float = MAX_GRAPH_COMPUTE_S
    node_gflops: float = NODE_GFLOPS
    # graph_work_too_large when the CPU planner's work buffer for one node would exceed this,
    # with per-thread scratch counted for server_threads threads.
    max_work_bytes: int = MAX_WORK_BYTES
    server_threads: int = SERVER_THREADS
    # Set by serve when its upstream is a fresh sandboxed process per session (rpcguard/upstream),
    # never by the config: content-indexed ops without a check (oprules.needs_containment) may
    # then reach it.
    contained: bool = False
    # The upstream's ggml backend (protocol/backend.py, issue 29): "auto" detects it per session
    # and device from the server's answers; "cpu" / "cuda" names it, and an answer that says
    # otherwise refuses the session's graphs (backend_mismatch). Selects the op table's backend
    # layer (oprules/cuda.py on CUDA).
    backend: str = "auto"
    # cuda_scratch_over_budget when a node on a CUDA device would take more than this from
    # ggml-cuda's memory pool (protocol/cudascratch.py); 0 turns it off.
    max_cuda_scratch_bytes: int = MAX_CUDA_SCRATCH_BYTES
    # The device memory one session may hold in buffers, per device (protocol/memshare.py): its
    # GET_DEVICE_MEMORY answers say at most this, and ALLOC_BUFFER past it is refused
    # device_memory_share_exceeded; 0: off (the quota alone: max_session_alloc_bytes).
    device_memory_share_bytes: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.disabled_checks) - set(CHECK_NAMES)
        if unknown:
            raise ValueError(f"unknown firewall checks {sorted(unknown)}; known: {', '.join(CHECK_NAMES)}")


@dataclass(frozen=True)
class SessionPolicy:
    """What a session enforces; built from the config by ``rpcguard.config.model``."""

    accepted_versions: frozenset[Version] = frozenset(KNOWN_VERSIONS)
    allowed_commands: frozenset[str] = frozenset(COMMAND_NAMES)
    # A SET_TENSOR chunk is streamed, so this cap bounds time and server memory (the server
    # resizes a vector to `len` before reading it), not proxy memory.
    max_request_bytes: int = 4 << 30
    # GRAPH_COMPUTE is validated whole in memory before forwarding: bound what one frame may cost.
    max_graph_bytes: int = 64 << 20
    mode: str = "enforce"  # or "monitor": firewall violations are counted and forwarded
    firewall: FirewallPolicy = field(default_factory=FirewallPolicy)
    # Tenant isolation: zero every new buffer (BUFFER_CLEAR injected after ALLOC_BUFFER) so that a
    # session never reads what an earlier session left in freed device memory.
    clear_new_buffers: bool = True
    # connect: "auto" leaves the request firewall to a node that is rpcguard (ALPN, pki/tls.py), which
    # validates every request itself; framing, sizes, the allow-list, the response checks and the
    # counters still run here; in monitor mode connect validates anyway, to report what it would
    # refuse. "always": validate here as well. serve always validates.
    validate_requests: str = "always"


@dataclass(frozen=True)
class Limits:
    """Timeouts (seconds, 0 = off) and caps applied to every link of a route."""

    handshake_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 0.0  # llama-server keeps its model connection idle for hours
    # A request frame in progress must keep up with min_data_rate_bps after frame_timeout_s: a
    # frame of N bytes arrives within frame_timeout_s + N / min_data_rate_bps of its first byte
    # (Apache's mod_reqtimeout MinRate), however its bytes are spread (slowloris, trickle).
    frame_timeout_s: float = 60.0
    # 16 KiB/s (128 kbit/s): a 100 MB model load at this pace takes 1.7 h, so a link too slow
    # for it is too slow to load a model at all; time the proxy holds the client back (flow
    # control toward a slow upstream) never counts (docs/resilience.md).
    min_data_rate_bps: int = 16384
    max_session_s: float = 0.0
    max_sessions: int = 64
    # serve: one certificate or one host cannot take the listener, before HELLO or after
    # (admitted sessions, refused ones excluded; 0 = off).
    max_sessions_per_identity: int = 16
    max_sessions_per_source: int = 32
    max_pending_per_identity: int = 4  # admitted, no HELLO yet: llama.cpp says HELLO at once
    max_pending_per_source: int = 8
    # serve: TLS handshakes in progress from one source address (each holds a socket and ~60 KiB
    # for up to handshake_timeout_s): one host cannot take the process's file descriptors.
    max_handshakes_per_source: int = 64
    # serve: a session holding the upstream with no request running for this long is ended when
    # another session waits for the upstream (alone it idles as long as it likes); 0 = off. The
    # operator's preemption of idle holders: llama-server holds its buffers between requests and
    # aborts when they are gone (issue 31); only a single server (--upstream, isolation shared)
    # makes sessions wait, so a contained serve never ends one for this.
    idle_while_waiting_s: float = 20.0
    # serve: once another session waits for the upstream, the session holding it has this long
    # more: every second counts, or, with idle_while_waiting_s 0 (idle holders not preempted),
    # only the ticks it was busy (sending however slowly, reading, owed an answer); or the
    # estimated compute of the graphs it sends meanwhile (GRAPH_RECOMPUTE charged as its stored
    # graph), whichever is larger. A waiting session is served within about this + 2 s + the
    # drain, below queue_timeout_s (docs/resilience.md, "The fair slot"). 0 = off.
    hold_while_waiting_s: float = 20.0
    # serve running a server process per session (upstream.exec, isolation session or identity):
    # how many sessions the listener serves at once, each its own process (others queue as for a
    # single server); 0: max_sessions. A single server (--upstream, isolation shared) serves one.
    max_upstream_sessions: int = 0
    upstream_busy: str = "queue"  # or "refuse"
    queue_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0  # process-wide: how long SIGTERM waits for running sessions
    # The watchdog: a response the server has owed this long (a GET_TENSOR behind a GRAPH_COMPUTE
    # that does not finish) ends the session upstream_hung; a server serve runs is killed. 3600 s:
    # what a session may queue unanswered is at most max_graph_compute_s (900 s) of estimated
    # compute, which the measured prices under-estimate by at most 3x on one loaded CPU thread
    # (2700 s; docs/performance.md "Compute prices per op"); the slowest real graph measured
    # (a 512-token batch, docs/performance.md) takes seconds. 0 = off.
    max_graph_s: float = 3600.0


@dataclass(frozen=True)
class Profile:
    """The policy and limits one session is held to, under a name for logs and labels."""

    name: str = DEFAULT_PROFILE
    policy: SessionPolicy = field(default_factory=SessionPolicy)
    limits: Limits = field(default_factory=Limits)


def default_policy(role: str) -> SessionPolicy:
    """The policy a listener (serve) or tunnel (connect) starts from before its config applies.

    connect does not zero new buffers: serve does it for the node's tenants, and doing it on
    both sides would clear every buffer twice (docs/firewall.md, "Tenant isolation"). For the
    same reason it leaves request validation to a node that is rpcguard (``validate_requests``).
    """
    if SIDES[role].upstream_is_guard:
        return SessionPolicy(clear_new_buffers=False, validate_requests="auto")
    return SessionPolicy()
