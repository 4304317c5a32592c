"""Reference graphs built by the REAL ggml constructors, serialised the way ggml-rpc sends them.

How this works: a *recipe* (plain JSON data) names leaf tensors and a list of constructor calls::

    {"leaves": [{"type": "f16", "ne": [64, 8]}, {"type": "f32", "ne": [64, 3], "nb": null}],
     "ops": [{"fn": "mul_mat", "args": [0, 1]}], "outputs": null}

Tensor arguments are indexes into "every tensor so far" (leaves first, then each op's result);
the other arguments are numbers, bools, null (a NULL tensor) or a 4-int list (``int sections[4]``),
typed by ``SIGNATURES`` (read from ggml.h). A leaf may carry its own strides (``nb``), as the
tensors ``ggml_dup_tensor_layout`` makes for the scheduler's split inputs, and ``"param": true``
(``ggml_set_param``: the optimizer ops need it) and ``"room": N``: N bytes of its buffer past
it, which a kernel may read (the invariant is per buffer; without room a read past the tensor
faults). ``MODIFIERS`` (ggml_rope_set_offset,
ggml_prec_set_acc, ggml_flash_attn_ext_add_sinks, ggml_set_output, ...) are called like constructors. ``"first_node": k`` sends only the graph's nodes
from k on, as the scheduler does for a later split.

``build_many`` runs a batch of recipes in ONE worker subprocess that loads the real
``libggml-base.so`` of the pinned llama-cpp-python (ctypes, no backend registry needed). The
worker forks a child that runs the recipes in order and writes one JSON line per recipe. A
constructor that refuses its inputs hits a GGML_ASSERT and aborts the child: an abort callback
first writes the assert message to the pipe, the worker records that recipe as refused and forks
a new child from the next recipe, so a batch costs one interpreter start whatever aborts.

For a built recipe the child runs ``ggml_build_forward_expand`` on the outputs (the real graph
order and use counts), gives every non-view tensor a fake buffer of its own (``Built.buffers``,
sized as the kernel oracle maps it: the tensor and its views, plus a leaf's ``"room"``; views at
``view_src.data + view_offs``, as after allocation) and serialises the graph exactly like
ggml-rpc.cpp ``serialize_graph`` / ``add_tensor`` / ``serialize_tensor`` (llama-cpp-python 0.3.36,
ggml/src/ggml-rpc/ggml-rpc.cpp:628-671 and 990-1036): tensors in depth-first post-order over
src[0..9] then view_src, de-duplicated, id = the tensor's address, ne/nb truncated to u32, name
copied, use_count from the graph. The result is the GRAPH_COMPUTE payload of protocol 7.0.0.

With ``compute=True`` the child also COMPUTES every built graph on the real CPU backend
(tests/support/ggmlkernel.py: a guard page after every buffer, zero inputs) right after writing
its line, and writes a second line with the kernel's verdict. A kernel GGML_ASSERT/GGML_ABORT
(the abort callback knows the phase), a fault (the child dies by a signal) or a compute that
outlives ``kernel_timeout_s`` (the worker kills the child) is recorded as the recipe's
``Built.kernel`` ("abort: <message>", "signal 11 (SIGSEGV)", "hang > 5 s"); "ok" when it computed.

The worker side (building, serialising, computing) is tests/support/ggmlworker.py. Run
``python -m tests.support.ggmlref --selftest`` to check the layout mirrors against the library.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from rpcguard.protocol.ggml import TYPES

__all__ = [
    "Built",
    "Refused",
    "BUFFER_HANDLE",
    "BUFFER_HANDLE_STEP",
    "BUFFER_BASE",
    "BUFFER_STRIDE",
    "BUFFER_SIZE",
    "SIGNATURES",
    "MODIFIERS",
    "TYPE_IDS",
    "build_many",
    "lib_path",
    "HarnessError",
    "kernel_refused",
]

# The fake server buffers: every tensor that owns memory gets one of its own, handle and base
# like the real server returns (raw heap pointers), buffer k at BUFFER_HANDLE + k*BUFFER_HANDLE_STEP
# and BUFFER_BASE + k*BUFFER_STRIDE, sized as the kernel oracle maps it (Built.buffers). A MUTATED
# graph is validated with every buffer BUFFER_SIZE long, far beyond any recipe, so a mutated tensor
# that grows still fits: a refusal then comes from the op rules, not from the buffer range check.
BUFFER_HANDLE = 0x00005555DEADBE00
BUFFER_HANDLE_STEP = 0x100
BUFFER_BASE = 0x00007F0000000000
BUFFER_STRIDE = 1 << 40
BUFFER_SIZE = BUFFER_STRIDE
PACK_ALIGN_BYTES = 64  # Built.rebase: ggml's TENSOR_ALIGNMENT / the CPU buffer alignment
CTX_MEM_BYTES = 4 << 20  # tensor structs + one graph of GRAPH_SIZE; no data (no_alloc)
GRAPH_SIZE = 128  # nodes + leaves of one recipe
ABORT_EXIT = 134  # a child that hit GGML_ASSERT (the status abort() would give a shell)

TYPE_IDS: dict[str, int] = {t.name: i for i, t in TYPES.items()}  # ggml type_name: "f32", "q4_K"

GGML_MAX_DIMS = 4  # ggml.h:222
GGML_MAX_SRC = 10  # ggml.h:224
GGML_MAX_OP_PARAMS = 64  # ggml.h:226
GGML_MAX_NAME = 64  # ggml.h:229


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor``, ggml.h:685-717 (llama-cpp-python 0.3.36); 336 bytes on x86-64."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class GgmlInitParams(ctypes.Structure):
    """``struct ggml_init_params``, ggml.h:677-682."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class GgmlHashSet(ctypes.Structure):
    """``struct ggml_hash_set``, ggml/src/ggml-impl.h:238-242."""

    _fields_ = [("size", ctypes.c_size_t), ("used", ctypes.POINTER(ctypes.c_uint32)),
                ("keys", ctypes.POINTER(ctypes.c_void_p))]  # fmt: skip


class GgmlCgraph(ctypes.Structure):
    """``struct ggml_cgraph``, ggml/src/ggml-impl.h:341-359 (read for nodes and use_counts)."""

    _fields_ = [
        ("size", ctypes.c_int),
        ("n_nodes", ctypes.c_int),
        ("n_leafs", ctypes.c_int),
        ("nodes", ctypes.POINTER(ctypes.c_void_p)),
        ("grads", ctypes.POINTER(ctypes.c_void_p)),
        ("grad_accs", ctypes.POINTER(ctypes.c_void_p)),
        ("leafs", ctypes.POINTER(ctypes.c_void_p)),
        ("use_counts", ctypes.POINTER(ctypes.c_int32)),
        ("visited_hash_set", GgmlHashSet),
        ("order", ctypes.c_int),
        ("uid", ctypes.c_uint64),
    ]


GGML_OBJECT_BYTES = 32  # struct ggml_object, ggml/src/ggml.c:958-967
assert ctypes.sizeof(GgmlTensor) == 336

# Every ``GGML_API struct ggml_tensor * ggml_<name>(struct ggml_context * ctx, ...)`` of
# ggml/include/ggml.h (llama-cpp-python 0.3.36): name -> (header line, argument kinds after ctx).
# Kinds: t tensor (recipe index or null), i32/u32/i64/u64 integers (enums are i32), f32 float,
# b bool, i32x4 `int sections[4]`, i64x4 `int64_t * ne` (4 dims). Read mechanically from the header
# (declarations split on commas after stripping comments); functions taking callbacks (custom ops)
# or arrays of other shapes (ggml_new_tensor) are left out.
SIGNATURES: dict[str, tuple[int, str]] = {
    # fmt: off
    "new_tensor_1d": (842, "i32 i64"), "new_tensor_2d": (847, "i32 i64 i64"),
    "new_tensor_3d": (853, "i32 i64 i64 i64"), "new_tensor_4d": (860, "i32 i64 i64 i64 i64"),
    "dup_tensor": (870, "t"), "view_tensor": (871, "t"), "dup": (902, "t"), "dup_inplace": (907, "t"),
    "add": (911, "t t"), "add_inplace": (916, "t t"), "add_cast": (921, "t t i32"),
    "add_id": (928, "t t t"), "acc": (949, "t t u64 u64 u64 u64"),
    "acc_inplace": (958, "t t u64 u64 u64 u64"), "sub": (967, "t t"), "sub_inplace": (972, "t t"),
    "mul": (977, "t t"), "mul_inplace": (982, "t t"), "div": (987, "t t"), "div_inplace": (992, "t t"),
    "sqr": (997, "t"), "sqr_inplace": (1001, "t"), "sqrt": (1005, "t"), "sqrt_inplace": (1009, "t"),
    "log": (1013, "t"), "log_inplace": (1017, "t"), "expm1": (1021, "t"), "expm1_inplace": (1025, "t"),
    "softplus": (1029, "t"), "softplus_inplace": (1033, "t"), "sin": (1037, "t"),
    "sin_inplace": (1041, "t"), "cos": (1045, "t"), "cos_inplace": (1049, "t"), "sum": (1054, "t"),
    "sum_rows": (1059, "t"), "cumsum": (1063, "t"), "mean": (1068, "t"), "argmax": (1073, "t"),
    "count_equal": (1078, "t t"), "repeat": (1085, "t t"), "repeat_4d": (1091, "t i64 i64 i64 i64"),
    "repeat_back": (1100, "t t"), "concat": (1107, "t t i32"), "abs": (1113, "t"),
    "abs_inplace": (1117, "t"), "sgn": (1121, "t"), "sgn_inplace": (1125, "t"), "neg": (1129, "t"),
    "neg_inplace": (1133, "t"), "step": (1137, "t"), "step_inplace": (1141, "t"), "tanh": (1145, "t"),
    "tanh_inplace": (1149, "t"), "elu": (1153, "t"), "elu_inplace": (1157, "t"), "relu": (1161, "t"),
    "leaky_relu": (1165, "t f32 b"), "relu_inplace": (1169, "t"), "sigmoid": (1173, "t"),
    "sigmoid_inplace": (1177, "t"), "gelu": (1181, "t"), "gelu_inplace": (1185, "t"),
    "gelu_erf": (1191, "t"), "gelu_erf_inplace": (1195, "t"), "gelu_quick": (1199, "t"),
    "gelu_quick_inplace": (1203, "t"), "silu": (1207, "t"), "silu_inplace": (1211, "t"),
    "silu_back": (1217, "t t"), "hardswish": (1223, "t"), "hardsigmoid": (1228, "t"), "exp": (1232, "t"),
    "exp_inplace": (1236, "t"), "floor": (1240, "t"), "floor_inplace": (1244, "t"), "ceil": (1248, "t"),
    "ceil_inplace": (1252, "t"), "round": (1256, "t"), "round_inplace": (1260, "t"), "trunc": (1270, "t"),
    "trunc_inplace": (1274, "t"), "xielu": (1284, "t f32 f32 f32 f32"), "glu": (1296, "t i32 b"),
    "reglu": (1302, "t"), "reglu_swapped": (1306, "t"), "geglu": (1310, "t"), "geglu_swapped": (1314, "t"),
    "swiglu": (1318, "t"), "swiglu_swapped": (1322, "t"), "geglu_erf": (1326, "t"),
    "geglu_erf_swapped": (1330, "t"), "geglu_quick": (1334, "t"), "geglu_quick_swapped": (1338, "t"),
    "glu_split": (1344, "t t i32"), "reglu_split": (1350, "t t"), "geglu_split": (1355, "t t"),
    "swiglu_split": (1360, "t t"), "geglu_erf_split": (1365, "t t"), "geglu_quick_split": (1370, "t t"),
    "swiglu_oai": (1375, "t t f32 f32"), "swiglu_clamp": (1382, "t t f32"), "norm": (1389, "t f32"),
    "norm_inplace": (1394, "t f32"), "rms_norm": (1399, "t f32"), "rms_norm_inplace": (1404, "t f32"),
    "group_norm": (1411, "t i32 f32"), "group_norm_inplace": (1417, "t i32 f32"),
    "l2_norm": (1425, "t f32"), "l2_norm_inplace": (1430, "t f32"), "rms_norm_back": (1437, "t t f32"),
    "mul_mat": (1482, "t t"), "mul_mat_id": (1500, "t t t"), "out_prod": (1509, "t t"),
    "scale": (1518, "t f32"), "scale_inplace": (1524, "t f32"), "scale_bias": (1530, "t f32 f32"),
    "scale_bias_inplace": (1536, "t f32 f32"), "set": (1543, "t t u64 u64 u64 u64"),
    "set_inplace": (1553, "t t u64 u64 u64 u64"), "set_1d": (1562, "t t u64"),
    "set_1d_inplace": (1568, "t t u64"), "set_2d": (1575, "t t u64 u64"),
    "set_2d_inplace": (1583, "t t u64 u64"), "cpy": (1591, "t t"), "cast": (1597, "t i32"),
    "cont": (1603, "t"), "cont_1d": (1608, "t i64"), "cont_2d": (1613, "t i64 i64"),
    "cont_3d": (1619, "t i64 i64 i64"), "cont_4d": (1626, "t i64 i64 i64 i64"), "reshape": (1636, "t t"),
    "reshape_1d": (1643, "t i64"), "reshape_2d": (1648, "t i64 i64"),
    "reshape_3d": (1656, "t i64 i64 i64"), "reshape_4d": (1663, "t i64 i64 i64 i64"),
    "view_1d": (1672, "t i64 u64"), "view_2d": (1678, "t i64 i64 u64 u64"),
    "view_3d": (1686, "t i64 i64 i64 u64 u64 u64"), "view_4d": (1696, "t i64 i64 i64 i64 u64 u64 u64 u64"),
    "permute": (1708, "t i32 i32 i32 i32"), "transpose": (1717, "t"), "get_rows": (1726, "t t"),
    "get_rows_back": (1731, "t t t"), "set_rows": (1748, "t t t"), "diag": (1754, "t"),
    "diag_mask_inf": (1759, "t i32"), "diag_mask_inf_inplace": (1765, "t i32"),
    "diag_mask_zero": (1771, "t i32"), "diag_mask_zero_inplace": (1777, "t i32"),
    "clamp": (1782, "t f32 f32"), "clamp_inplace": (1789, "t f32 f32"), "soft_max": (1795, "t"),
    "soft_max_inplace": (1800, "t"), "soft_max_ext": (1813, "t t f32 f32"),
    "soft_max_ext_inplace": (1820, "t t f32 f32"), "soft_max_ext_back": (1831, "t t f32 f32"),
    "soft_max_ext_back_inplace": (1839, "t t f32 f32"), "rope": (1851, "t t i32 i32"),
    "rope_inplace": (1859, "t t i32 i32"), "rope_ext": (1892, "t t t i32 i32 i32 f32 f32 f32 f32 f32 f32"),
    "rope_multi": (1937, "t t t i32 i32x4 i32 i32 f32 f32 f32 f32 f32 f32"),
    "rope_ext_inplace": (1954, "t t t i32 i32 i32 f32 f32 f32 f32 f32 f32"),
    "rope_multi_inplace": (1969, "t t t i32 i32x4 i32 i32 f32 f32 f32 f32 f32 f32"),
    "rope_ext_back": (2021, "t t t i32 i32 i32 f32 f32 f32 f32 f32 f32"),
    "rope_multi_back": (2036, "t t t i32 i32x4 i32 i32 f32 f32 f32 f32 f32 f32"),
    "im2col": (2063, "t t i32 i32 i32 i32 i32 i32 b i32"),
    "im2col_back": (2076, "t t i64x4 i32 i32 i32 i32 i32 i32 b"), "col2im_1d": (2092, "t i32 i32 i32"),
    "conv_1d": (2099, "t t i32 i32 i32"), "conv_1d_ph": (2109, "t t i32 i32"),
    "conv_1d_dw": (2118, "t t i32 i32 i32"), "conv_1d_dw_ph": (2126, "t t i32 i32"),
    "conv_transpose_1d": (2133, "t t i32 i32 i32"), "conv_2d": (2141, "t t i32 i32 i32 i32 i32 i32"),
    "im2col_3d": (2152, "t t i64 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32"),
    "conv_3d": (2171, "t t i64 i32 i32 i32 i32 i32 i32 i32 i32 i32"), "conv_2d_sk_p0": (2195, "t t"),
    "conv_2d_s1_ph": (2208, "t t"), "conv_2d_dw": (2214, "t t i32 i32 i32 i32 i32 i32"),
    "conv_2d_dw_direct": (2230, "t t i32 i32 i32 i32 i32 i32"), "conv_transpose_2d_p0": (2241, "t t i32"),
    "conv_2d_direct": (2247, "t t i32 i32 i32 i32 i32 i32"),
    "conv_3d_direct": (2258, "t t i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32"),
    "pool_1d": (2281, "t i32 i32 i32 i32"), "pool_2d": (2291, "t i32 i32 i32 i32 i32 f32 f32"),
    "pool_2d_back": (2302, "t t i32 i32 i32 i32 i32 f32 f32"), "upscale": (2329, "t i32 i32"),
    "interpolate": (2349, "t i64 i64 i64 i64 u32"), "pad": (2359, "t i32 i32 i32 i32"),
    "pad_circular": (2368, "t i32 i32 i32 i32"), "pad_ext": (2376, "t i32 i32 i32 i32 i32 i32 i32 i32"),
    "pad_ext_circular": (2390, "t i32 i32 i32 i32 i32 i32 i32 i32"), "pad_reflect_1d": (2403, "t i32 i32"),
    "roll": (2411, "t i32 i32 i32 i32"), "tri": (2421, "t i32"), "fill": (2427, "t f32"),
    "fill_inplace": (2432, "t f32"), "timestep_embedding": (2440, "t i32 i32"), "argsort": (2452, "t i32"),
    "argsort_top_k": (2458, "t i32"), "top_k": (2465, "t i32"), "arange": (2470, "f32 f32 f32"),
    "flash_attn_ext": (2487, "t t t t f32 f32 f32"), "flash_attn_back": (2516, "t t t t b"),
    "ssm_conv": (2524, "t t"), "ssm_scan": (2529, "t t t t t t t i64"), "win_part": (2546, "t i32"),
    "win_unpart": (2553, "t i32 i32 i32"), "unary": (2560, "t i32"), "unary_inplace": (2565, "t i32"),
    "get_rel_pos": (2571, "t i32 i32"), "add_rel_pos": (2578, "t t t"),
    "add_rel_pos_inplace": (2584, "t t t"), "rwkv_wkv6": (2590, "t t t t t t"),
    "gated_linear_attn": (2599, "t t t t t f32"), "rwkv_wkv7": (2608, "t t t t t t t"),
    "solve_tri": (2631, "t t b b b"), "gated_delta_net": (2652, "t t t t t t i64"),
    "lightning_indexer": (2673, "t t t t"), "dsv4_hc_comb": (2690, "t t t f32 i32"),
    "dsv4_hc_pre": (2701, "t t"), "dsv4_hc_pre_gated": (2709, "t t f32"),
    "dsv4_hc_post": (2722, "t t t t"), "cross_entropy_loss": (2812, "t t"),
    "cross_entropy_loss_back": (2817, "t t t"), "opt_step_adamw": (2826, "t t t t t"),
    "opt_step_sgd": (2835, "t t t"),
    # GGML_DEPRECATED declarations (the functions are still exported):
    "add1": (934, "t t"), "add1_inplace": (940, "t t"),
    # fmt: on
}


# Functions that change a node after its constructor, as llama.cpp does (llama-graph.cpp,
# llama-model.cpp, src/models/*.cpp): name -> (ggml.h line, argument kinds, no ctx). In a recipe
# they are calls like the constructors; their "result" is the tensor they changed (the first
# argument), so a later call or the op under test refers to the modified node.
MODIFIERS: dict[str, tuple[int, str]] = {
    "set_input": (893, "t"), "set_output": (894, "t"),
    "prec_set_acc": (1453, "t i32"), "prec_set_src": (1474, "t i32 i32"),
    "mul_mat_set_hint": (1495, "t i32"), "soft_max_add_sinks": (1827, "t t"),
    "rope_set_offset": (2057, "t i32"), "flash_attn_ext_set_n_kv_max": (2507, "t i32"),
    "flash_attn_ext_add_sinks": (2511, "t t"),
}  # fmt: skip


class HarnessError(RuntimeError):
    """The harness itself failed (library missing, worker crashed outside a recipe)."""


@dataclass
class Refused:
    """The real constructor refused a recipe: the GGML_ASSERT / abort message it printed."""

    message: str
    ok: bool = False


@dataclass
class Built:
    """A recipe the real constructors accepted, serialised as one GRAPH_COMPUTE payload (7.0.0)."""

    payload: bytes  # u32 device | u32 n_nodes | u64 nodes[] | u32 n_tensors | rpc_tensor[]
    nodes: list[int]  # node ids, in graph order
    n_tensors: int
    refs: list[int | None]  # position in the tensor list of every recipe tensor (None: not sent)
    # (handle, base, size) of the buffer of every tensor that owns memory, in list order: its data
    # is the base; the size is what the kernel oracle maps (ggmlkernel.buffer_sizes)
    buffers: list[tuple[int, int, int]] = field(default_factory=list)
    ok: bool = True
    extra: dict = field(default_factory=dict)
    kernel: str | None = None  # compute=True: "ok", or how the real CPU kernel refused the graph

    @property
    def tensor_bytes(self) -> int:
        """Offset of the first rpc_tensor in ``payload``."""
        return 8 + 8 * len(self.nodes) + 4

    def _packed(self) -> dict[int, int]:
        offs, at = {}, 0
        for h, _, size in self.buffers:
            offs[h] = at
            at += -(-size // PACK_ALIGN_BYTES) * PACK_ALIGN_BYTES
        return offs

    @property
    def packed_size(self) -> int:
        """Bytes of one real buffer that holds all of ``buffers`` one after another (``rebase``)."""
        return sum(-(-size // PACK_ALIGN_BYTES) * PACK_ALIGN_BYTES for _, _, size in self.buffers)

    def rebase(self, handle: int, base: int) -> bytes:
        """The payload with every tensor moved into ONE real buffer (``handle``, ``base``), the fake
        buffers packed one after another (aligned)."""
        from rpcguard.protocol.encode import TENSOR_STRUCT

        offs = self._packed()
        bases = {h: b for h, b, _ in self.buffers}
        out = bytearray(self.payload)
        for i in range(self.n_tensors):
            at = self.tensor_bytes + TENSOR_STRUCT.size * i
            f = list(TENSOR_STRUCT.unpack_from(out, at))
            if f[2] in offs:  # buffer, data
                f[2], f[-3] = handle, base + offs[f[2]] + f[-3] - bases[f[2]]
            TENSOR_STRUCT.pack_into(out, at, *f)
        return bytes(out)


def lib_path() -> Path:
    """libggml-base.so of the real peer: $RPCGUARD_GGML_LIB, else next to REALPEER_RPC_SERVER_BIN."""
    explicit = os.environ.get("RPCGUARD_GGML_LIB")
    if explicit:
        return Path(explicit)
    from tests.support import realpeer

    binary = os.environ.get("REALPEER_RPC_SERVER_BIN") or realpeer._read_env(
        realpeer.REALPEER_HOME / "env.sh"
    ).get("REALPEER_RPC_SERVER_BIN")
    if not binary:
        raise HarnessError("real peer not built: run `bash tests/realpeer/setup.sh` (REALPEER_RPC_SERVER_BIN unset)")
    path = Path(binary).parent / "libggml-base.so"
    if not path.exists():
        raise HarnessError(f"{path} missing: run `bash tests/realpeer/setup.sh`")
    return path


# -- the parent side -------------------------------------------------------------------------


def kernel_refused(verdict: str | None) -> bool:
    """True when a ``Built.kernel`` verdict says the real kernel aborted, faulted or hung."""
    return verdict is not None and verdict != "ok" and not verdict.startswith("skipped")


def build_many(
    recipes: list[dict], *, timeout_s: float = 280.0, compute: bool = False, kernel_timeout_s: float = 5.0
) -> list[Built | Refused]:
    """Build every recipe with the real constructors in one worker process; one result each.

    ``compute``: also run each built graph on the real CPU backend (``Built.kernel``); a compute
    longer than ``kernel_timeout_s`` counts as a hang.
    """
    if not recipes:
        return []
    env = dict(os.environ, GGML_NO_BACKTRACE="1", OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.ggmlworker", "--worker", str(lib_path())]
        + (["--compute", str(kernel_timeout_s)] if compute else []),
        input="\n".join(map(json.dumps, recipes)).encode(),  # one line each: parsed by the child
        capture_output=True,
        timeout=timeout_s,
        env=env,
        cwd=root,
    )
    if proc.returncode != 0:
        raise HarnessError(f"worker failed rc={proc.returncode}: {proc.stderr.decode(errors='replace')[-2000:]}")
    out: list[Built | Refused] = []
    for line in proc.stdout.decode().splitlines():
        r = json.loads(line)
        if "kernel" in r:  # the verdict of the Built just before
            if not out or not isinstance(out[-1], Built) or out[-1].kernel is not None:
                raise HarnessError(f"kernel verdict without a built recipe: {line[:200]}")
            out[-1].kernel = r["kernel"]
            continue
        if r["ok"]:
            out.append(Built(bytes.fromhex(r["payload"]), r["nodes"], r["n_tensors"], r["refs"],
                             [tuple(x) for x in r["buffers"]], kernel=r.get("kernel")))  # type: ignore[misc]
        else:
            out.append(Refused(r["message"]))
    if len(out) != len(recipes):
        raise HarnessError(f"worker returned {len(out)} results for {len(recipes)} recipes")
    return out


def main(argv: Iterable[str] | None = None) -> int:
    from tests.support.ggmlworker import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main())
