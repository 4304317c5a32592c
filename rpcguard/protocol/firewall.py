"""The frame firewall: per-command validation of request payloads (spec §6.2).

How this works: the session has already matched the frame to a ``CommandRule`` of the
negotiated version and checked its length class; it hands the firewall the validated head of
the payload (the whole payload for fixed-size commands and GRAPH_COMPUTE; for SET_TENSOR only
rpc_tensor [+ cache_flag] + offset, with ``body_len`` data bytes still to come). The check
column of the command table (``commands.ROWS``) holds the ``RequestChecks`` method
(protocol/checks.py) that checks each command, its ``cacheable`` column whether an accepted
head may be remembered; commands without a check (HELLO, DEVICE_COUNT) need nothing.
``Firewall`` is those checks plus this dispatch: one index into ``commands.CHECKS`` per frame
(like h11's ``READERS``), the head's size checked again, and the cache of accepted heads.
Every check raises ``FirewallRefusal(reason, detail)`` and never anything else; the check
groups a policy can switch off are listed in protocol/checks.py.
"""

from __future__ import annotations

from typing import Final

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.checks import HASH_THRESHOLD_BYTES, RequestChecks
from rpcguard.protocol.commands import CACHEABLE, CHECKS
from rpcguard.protocol.settings import CHECK_NAMES, FirewallPolicy
from rpcguard.protocol.versions import TENSOR_BYTES, WHOLE, CommandRule

__all__ = ["FirewallPolicy", "Firewall", "CHECK_NAMES", "HASH_THRESHOLD_BYTES", "HEAD_CACHE_MAX"]

_SET_TENSOR_CACHE_HEAD: Final = TENSOR_BYTES + 9  # 7.0.0 SET_TENSOR head: rpc_tensor, cache_flag, offset
_FLAG_AT: Final = TENSOR_BYTES  # >= 7.0.0 SET_TENSOR: u8 cache_flag right after the rpc_tensor
HEAD_CACHE_MAX: Final = 4096  # entries of ~300 bytes: bounded memory per session


class Firewall(RequestChecks):
    """Per-session request validation; ``check_request`` raises ``FirewallRefusal``."""

    def check_request(self, rule: CommandRule, payload: memoryview, body_len: int) -> None:
        """Validate one request (see the module docstring for what ``payload`` holds)."""
        cmd = rule.cmd
        check = CHECKS[cmd]
        if check is None:
            return
        # The session guarantees these sizes; re-checked so that no payload can make a check
        # fail with anything but a FirewallRefusal. GRAPH_COMPUTE sizes are the graph's own rule.
        if rule.layout != WHOLE and len(payload) != rule.request:
            raise FirewallRefusal(
                "frame_size_invalid", f"{rule.name} head {len(payload)} bytes, expected {rule.request}"
            )
        if CACHEABLE[cmd] and not (rule.request == _SET_TENSOR_CACHE_HEAD and payload[_FLAG_AT]):
            # During generation the client sends the same few tensor heads (inputs, positions,
            # logits) every token: a head accepted once stays valid until the buffer map changes.
            # The key holds everything else the verdict depends on: a GET_TENSOR head and a
            # SET_TENSOR_HASH head have the same size but not the same ranges to check.
            key = (cmd, bytes(payload), body_len)
            cache = self.state.head_cache
            if key in cache:
                return
            check(self, rule, payload, body_len)
            if len(cache) >= HEAD_CACHE_MAX:
                cache.clear()
            cache.add(key)
            return
        check(self, rule, payload, body_len)
