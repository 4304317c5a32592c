"""GET_DEVICE_SUPPORTS_OP (7.0.1) answered from the device's backend layer.

How this works: the command table's answer column (commands.supports_op_local) first asks the
firewall whether a node of the op could pass at all (``forwards_op``: a verified row, not denied,
not contained-only on an uncontained server by the CPU's list). ``layer_supports`` then asks the
backend layer of the device the query names (protocol/backend.py ``backend_layer``): on a CUDA
device an op contained only on CUDA (oprules/cuda.py ``CONTENT_INDEXED``: GET_ROWS, SET_ROWS,
ADD_ID, MUL_MAT_ID, SSM_SCAN) on an uncontained server, and a node the CUDA layer refuses
(``cuda.check_node``: no kernel, supports_op rows, kernel asserts, alignment, grid axes, 32-bit
indices), are "not supported", so that llama.cpp's scheduler places the node on another backend
instead of sending a graph the firewall then refuses. A device whose layer cannot be resolved
(``backend_mismatch`` / ``backend_unknown``) supports nothing: its graphs are refused anyway.
The CPU layer adds nothing: a CPU device's queries are answered as before (forwarded).
The reach rows (FLASH_ATTN_EXT's copies behind dst, MMQ's padded row) need buffers a query does
not carry; the graph check holds them. Sans-IO.
"""

from __future__ import annotations

import struct
from typing import Final

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.backend import backend_layer
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.oprules import cuda
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.tensor import RpcTensor, decode_tensor
from rpcguard.protocol.versions import TENSOR_BYTES

__all__ = ["layer_supports", "layer_refusal"]

_U32: Final = struct.Struct("<I")
_SRC_AT: Final = 4 + TENSOR_BYTES  # u32 device, rpc_tensor op, rpc_tensor srcs[10]


def layer_refusal(policy: FirewallPolicy, state: SessionState, head: memoryview | bytes) -> str:
    """Why the query's device layer refuses its node ("" when it does not); ``head`` is the
    request payload, already accepted by ``RequestChecks.device_supports_op``."""
    if "graph_ops" in policy.disabled_checks:
        return ""
    device = _U32.unpack_from(head)[0]
    try:
        layer = backend_layer(policy.backend, state, device)
    except FirewallRefusal as refusal:
        return refusal.reason
    if layer != "cuda":
        return ""
    spec = state.spec
    if spec is None:
        return ""
    rules = op_rules(spec.version, frozenset(policy.denied_ops))
    node = decode_tensor(head, 4)
    if rules is None or node.op >= rules.count:
        return ""  # forwards_op decided these
    name = rules.name(node.op)
    allowed = policy.allow_unverified_ops
    if node.op in rules.contained_only_cuda and not policy.contained and name not in allowed and "*" not in allowed:
        return "op_needs_containment"
    srcs: list[RpcTensor | None] = []
    for off in range(_SRC_AT, len(head), TENSOR_BYTES):
        src = decode_tensor(head, off)
        srcs.append(src if src.id else None)
    try:
        cuda.check_node(name, node, srcs)
    except FirewallRefusal as refusal:
        return refusal.reason
    except (ArithmeticError, LookupError, ValueError, TypeError, AttributeError):
        return "backend_unsupported_op"  # a query the rows cannot read: fail closed
    return ""


def layer_supports(policy: FirewallPolicy, state: SessionState, head: memoryview | bytes) -> bool:
    """Whether the query may go to the server (True) or the proxy answers "not supported"."""
    return not layer_refusal(policy, state, head)
