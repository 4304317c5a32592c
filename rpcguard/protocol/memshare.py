"""The device memory one session may use (issue 31 item 1, device side): its share.

How this works: ``policy.device_memory_share_bytes`` (per listener or profile; 0: off) is the
bytes of each device's memory one session may hold in buffers. Two things follow from it:

* what the client is told: the server's GET_DEVICE_MEMORY answer ``(free, total)`` reaches the
  client as ``(min(free, share - held), min(total, share))``, ``held`` being what the session
  already holds on that device, so that llama.cpp fits its layers to the share (it sizes the
  offload from the free memory the device reports, llama-model.cpp / ggml-backend's
  ``ggml_backend_dev_memory``) instead of to the whole GPU; the session's own facts keep the
  server's numbers (the quota of ``RequestChecks.quota`` is unchanged);
* what the session may allocate: an ALLOC_BUFFER that would put the session's bytes on a device
  (``SessionState.alloc_by_device``: charged when forwarded, corrected by the answer, released by
  FREE_BUFFER) past the share is refused ``device_memory_share_exceeded`` before the server sees
  it. Another session's share is its own: each session counts its own buffers.

With the CUDA scratch budget (protocol/cudascratch.py) the operator sizes a GPU node as
``sessions x share + scratch budget + the backend's own (CUDA context, cuBLAS)`` <= device
memory (docs/gpu.md). Sans-IO.
"""

from __future__ import annotations

import struct
from typing import Final

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState

__all__ = ["answer", "check_alloc"]

_U64x2: Final = struct.Struct("<QQ")


def answer(policy: FirewallPolicy, state: SessionState, device: int, free: int, total: int) -> bytes | None:
    """The GET_DEVICE_MEMORY response frame the client gets instead of the server's, or None
    (no share: the server's answer as it is)."""
    share = policy.device_memory_share_bytes
    if not share:
        return None
    held = state.alloc_by_device.get(device, 0)
    return encode.response(_U64x2.pack(min(free, max(0, share - held)), min(total, share)))


def check_alloc(policy: FirewallPolicy, state: SessionState, device: int, size: int) -> None:
    """Refuse an ALLOC_BUFFER of ``size`` on ``device`` past the session's share."""
    share = policy.device_memory_share_bytes
    if not share:
        return
    held = state.alloc_by_device.get(device, 0)
    if held + size > share:
        raise FirewallRefusal(
            "device_memory_share_exceeded",
            f"device {device}: this session holds {held} bytes + {size} asked > its share "
            f"policy.device_memory_share_bytes {share}")
