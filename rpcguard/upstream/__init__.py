"""serve runs the node's ggml-rpc-server itself (issue 18): supervised, sandboxed, one per session.

``sandbox`` builds the command line (bubblewrap namespaces, its own uid, rlimits) and says which
mechanisms work on this host; ``process`` starts one server, waits until it listens, reads its
stderr into the log, opens connections to it (inside its network namespace) and tells how it
ended; ``pool`` is the listener's upstream provider: a fresh process per session (``isolation``),
a pre-started spare, crash accounting and quarantine. docs/containment.md says why.
"""

from rpcguard.upstream.pool import ISOLATIONS, UpstreamPool, UpstreamSettings

__all__ = ["ISOLATIONS", "UpstreamPool", "UpstreamSettings"]
