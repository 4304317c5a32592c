"""The catalogue of stable reason strings, for metric labels known before they first occur.

How this works: every refusal carries a ``reason`` (``rpcguard.errors``). Metrics export each
labelled counter at 0 for every reason it can count, so that dashboards and alerts see 0
instead of a missing series (and ``increase()`` sees the first event). Where the code already
holds a table, the reasons come from it (``tls.HANDSHAKE_ERROR_REASONS``,
``protocol.versions.REFUSAL_CODES``); the others are listed here by the layer that raises
them. tests/unit/test_reasons.py parses every module of the package and fails if a reason
literal raised anywhere is missing here, if one listed here is raised nowhere, or if
docs/design.md's list differs, so this table cannot drift from the code.
"""

from __future__ import annotations

from rpcguard.protocol.versions import REFUSAL_CODES
from rpcguard.pki.tls import HANDSHAKE_ERROR_REASONS

__all__ = [
    "TLS_REASONS",
    "IDENTITY_REASONS",
    "SESSION_REASONS",
    "FIREWALL_REASONS",
    "SESSION_ERROR_REASONS",
    "REFUSAL_REASONS",
]

# What classify_handshake_error() can return (its table, then its fallback).
TLS_REASONS: tuple[str, ...] = tuple(dict.fromkeys(
    [r for _, r in HANDSHAKE_ERROR_REASONS] + ["tls_handshake_failed"]))
# After a completed handshake: the certificate is valid but not on the allow-list.
IDENTITY_REASONS: tuple[str, ...] = ("identity_not_allowed",)
# protocol/session.py, proxy/link.py, proxy/route.py; the HELLO-answer codes come from REFUSAL_CODES.
SESSION_REASONS: tuple[str, ...] = tuple(dict.fromkeys((
    "first_frame_not_hello", "hello_repeated", "hello_bad_size", "data_before_hello_reply",
    "version_not_accepted", "command_unknown", "command_not_allowed", "frame_size_invalid",
    "request_too_large", "response_unexpected", "response_size_invalid", "response_value_invalid", "notice_invalid",
    "hello_timeout",
    "idle_timeout", "frame_timeout", "session_lifetime", "node_refused", "node_ended", "idle_while_waiting",
    "hold_while_waiting",
    "too_many_sessions_per_identity", "too_many_sessions_per_source", "too_many_pending_per_identity",
    "too_many_pending_per_source", "too_many_handshakes_per_source",
    *(r for r in REFUSAL_CODES if r not in IDENTITY_REASONS),
)))
# protocol/checks.py, firewall.py, tensor.py, graph.py, oprules/, opcheck.py: the rule names of FirewallRefusal.
FIREWALL_REASONS: tuple[str, ...] = (
    "device_out_of_range", "alloc_size_invalid", "buffer_unknown", "tensor_type_invalid",
    "tensor_shape_invalid", "tensor_nbytes_overflow", "tensor_flags_invalid", "tensor_name_unterminated",
    "tensor_data_without_buffer", "tensor_out_of_buffer", "tensor_null", "range_out_of_tensor",
    "range_out_of_buffer", "copy_out_of_buffer", "graph_size_mismatch", "graph_too_large",
    "graph_node_invalid", "graph_node_duplicate", "graph_node_missing", "graph_src_missing",
    "graph_order_invalid", "graph_op_invalid", "graph_op_denied", "graph_op_params_invalid",
    "graph_shape_invalid", "graph_use_count_invalid", "recompute_after_free", "recompute_without_graph",
    "set_tensor_flag_invalid", "frame_size_invalid", "set_tensor_cache_flag_invalid", "alloc_quota_exceeded",
    # the op table (protocol/oprules/, opcheck.py): default deny, re-derived nodes, layouts, cost
    "op_not_verified", "graph_type_invalid", "graph_src_unexpected", "graph_tensor_unallocated",
    "graph_tensor_wrong_device", "tensor_layout_invalid", "graph_too_costly", "graph_work_too_large",
    "op_needs_containment", "work_buffer_overflow",
    # a node the op's row accepts but the CPU kernel of the session's version would not run (it
    # aborts or addresses past a tensor there; 7.0.0's runs it): protocol/oprules/kerneltypes.py
    "type_not_supported_by_version",
    # the op table's backend layer (protocol/backend.py, oprules/cuda.py): what the node's backend
    # cannot run or addresses past a tensor, and a backend the setting and the server disagree on
    "backend_unsupported_op", "backend_misaligned", "backend_grid_too_large", "backend_index_overflow",
    "backend_reach_out_of_buffer", "backend_unknown", "backend_mismatch",
    # a fused kernel of consecutive CUDA nodes that aborts or writes past a tensor (oprules/cudafusion.py)
    "backend_fusion_unsupported",
    # a CUDA node's estimated pool scratch above policy.max_cuda_scratch_bytes (protocol/cudascratch.py)
    "cuda_scratch_over_budget",
    # ALLOC_BUFFER past the session's device memory share (protocol/memshare.py)
    "device_memory_share_exceeded",
)
# Session ends that are errors, not refusals (sessions_total{result="error"}, never refusals_total).
# upstream_crashed / upstream_hung: the server serve runs died or stopped answering (upstream/pool.py);
# upstream_cache_quota: its session filled the identity's cache directory past cache_bytes (pool.py).
SESSION_ERROR_REASONS: tuple[str, ...] = ("client_closed_mid_frame", "upstream_closed", "internal_error",
                                          "upstream_crashed", "upstream_hung", "upstream_cache_quota")
# Every value refusals_total{reason} can take.
REFUSAL_REASONS: tuple[str, ...] = tuple(dict.fromkeys(
    TLS_REASONS + IDENTITY_REASONS + SESSION_REASONS + FIREWALL_REASONS))
