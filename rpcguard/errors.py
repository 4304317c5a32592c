"""Typed errors shared by every layer.

Every refusal carries a stable, snake_case ``reason``: it is the ``reason`` label of the
refusal metrics and the ``reason`` field of the log line, so it never changes once released.
``detail`` is free text for people. The class says who is at fault, like h11's
``LocalProtocolError``/``RemoteProtocolError``.
"""

from __future__ import annotations

__all__ = [
    "RpcGuardError",
    "Refusal",
    "ProtocolRefusal",
    "FirewallRefusal",
    "PolicyRefusal",
    "ConfigError",
]


class RpcGuardError(Exception):
    """Base class of every error rpcguard raises on purpose."""


class Refusal(RpcGuardError):
    """A session (or a connection) is refused; ``reason`` is the stable label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class ProtocolRefusal(Refusal):
    """The peer broke a framing or session rule of the ggml-rpc protocol."""


class FirewallRefusal(Refusal):
    """A frame failed a firewall check; ``reason`` names the rule."""


class PolicyRefusal(Refusal):
    """Identity, version or command policy said no."""


class ConfigError(RpcGuardError):
    """Invalid configuration; ``str()`` is one line naming the key path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
