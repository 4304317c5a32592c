"""Op rules: what ggml's own op constructors could have built, one row per op (default deny).

How this works: ggml's CPU (and CUDA) kernels trust the invariants that the op constructors in
ggml.c establish (shapes, strides, types, source counts, parameter ranges), and ggml-rpc
deserialises a graph without running any constructor. So every GRAPH_COMPUTE node is checked
against the row of its op in ``RULES``: the row's ``derive`` function takes the node's sources
and op_params, applies the constructor's own assertions (plus what the CPU kernel assumes beyond
them: type combinations it dispatches, contiguity it asserts) and returns what the constructor
would have produced; the node must equal it:

* ``New(type, ne)``: a fresh tensor (``ggml_new_tensor``): contiguous strides, no view source.
* ``View(src, ne, nb, offs)``: a view (VIEW/RESHAPE/PERMUTE/TRANSPOSE, CPY, SET_ROWS, inplace
  variants): type of ``src``, the given strides, ``view_src`` the root of ``src``, ``view_offs``
  the root offset plus ``offs`` (ggml_new_tensor_impl collapses view chains to their root).

An op without a row is refused as ``op_not_verified``. Sources past a row's ``srcs`` must be
absent, op_params past its ``params`` must be zero (the constructor leaves them zero). Each row
cites the constructor it mirrors as ``ggml.c:LINE`` of the pinned sdist (llama-cpp-python 0.3.36,
``vendor/llama.cpp/ggml/src/ggml.c``) and the kernel it checked (``ggml-cpu/ops.cpp``,
``binary-ops.cpp``, ``unary-ops.cpp``). Rows hold for every version with a verified op table
unless ``since`` says otherwise; the op ids come from the version's table (ggml.py).

Layout: ``base`` holds the vocabulary (New, View, OpRule, refuse, the layout predicates); one
module per family of ops holds its derive functions and, next to them, its ``ROWS``
(``elementwise``, ``matmul``, ``layout``, ``attention``, ``reduce``, ``recurrent``, ``conv``,
``window``, ``training``); ``table`` joins the rows into ``RULES`` and says what holds per op. This package's namespace is
the public API the firewall, the cost model, ``rpcguard ops`` and the tests use.
"""

from __future__ import annotations

from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, F32_F16, FLOAT, I32, INT32_MAX, MAX_DIMS, ONLY_F32, QUANTIZED, Derive, New, OpRule, Result, Srcs,
    View, contiguous_nb, f32, is_contiguous, nelements, refuse,
)
from rpcguard.protocol.oprules.matmul import VEC_DOT
from rpcguard.protocol.oprules.table import (
    CONTENT_INDEXED, PER_DIMENSION_OPS, RESIDUAL_RISK, RULES, needs_containment, op_status, rule_for, status_markdown,
    table_markdown,
)

__all__ = [
    "OpRule", "New", "View", "Result", "Srcs", "Derive", "RULES", "rule_for", "contiguous_nb", "is_contiguous",
    "nelements", "refuse", "f32", "CONTENT_INDEXED", "RESIDUAL_RISK", "PER_DIMENSION_OPS", "needs_containment",
    "op_status", "status_markdown", "table_markdown", "VEC_DOT", "F32", "F16", "BF16", "I32", "FLOAT", "F32_F16",
    "ONLY_F32", "QUANTIZED", "INT32_MAX", "MAX_DIMS",
]  # fmt: skip
