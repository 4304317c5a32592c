"""CUDA scratch: what a node takes from ggml-cuda's memory pool, and the budget it is held to.

How this works: besides the tensors the client placed in its buffers, ggml-cuda's kernels take
per-op scratch from the backend's pool (``ggml_cuda_pool_alloc``: src1 quantised to q8_1 for
MMQ/MMVQ, F16 conversions for cuBLAS, FLASH_ATTN_EXT's partial results, CUB's sort buffers ...).
The pool lives as long as the server process, grows to the largest request it has served and
aborts the server when the device has no memory left (``CUDA_CHECK`` of the allocation,
ggml-cuda.cu:502 legacy pool, :583 VMM pool) or past its 32 GiB reserve (``GGML_ASSERT`` at
:575); a CUDA fault is sticky, so one node with a large enough scratch ends every session of
that server. ``node_scratch`` estimates one node's scratch from its shapes, mirroring the pool
allocations of the path ggml-cuda b11434 takes for it on an NVIDIA GPU of compute capability 7.5
or newer (Turing MMA, fast F16: H100/H200 class), one term per allocation with the line it was
read at (``ROWS``); where the path depends on the device's occupancy (FLASH_ATTN_EXT's parallel
blocks, MMQ's stream-k fixup) it takes the most that any GPU up to ``NSM_MAX`` SMs with
``BLOCKS_PER_SM_MAX`` resident blocks would allocate, and CUB's temporary storage (not in the
tree) is bounded by a stated estimate. ``check_scratch`` refuses a node above the budget
(``policy.max_cuda_scratch_bytes``) ``cuda_scratch_over_budget``: the graph's peak, since the
pool frees each node's scratch before the next (the ``ggml_cuda_pool_alloc`` destructor).
Only the CUDA layer calls it (backend.check_backend); the CPU's work buffer is workbuf.py's.
Sans-IO.
"""

from __future__ import annotations

from typing import Callable, Final, Mapping, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.tensor import RpcTensor

__all__ = ["ROWS", "node_scratch", "check_scratch", "MAX_CUDA_SCRATCH_BYTES", "NSM_MAX", "BLOCKS_PER_SM_MAX"]

#: the default budget of one node's scratch: 4 GiB, an eighth of the VMM pool's 32 GiB reserve
#: (ggml-cuda.cu:575) and ~5% of an 80 GB GPU; the largest real llama.cpp node estimated here is
#: ~1 GiB (an F16 output projection over a 2048-token batch with a 262k vocabulary: dst_temp)
MAX_CUDA_SCRATCH_BYTES: Final = 4 << 30
#: the most SMs of a GPU this models (H100 SXM 132, H200 132, B200 148) and the most resident
#: blocks per SM on sm_75..sm_100 (32): bounds of the occupancy-chosen grids below
NSM_MAX: Final = 160
BLOCKS_PER_SM_MAX: Final = 32
_BLOCKS_PER_WAVE: Final = NSM_MAX * BLOCKS_PER_SM_MAX

MATRIX_ROW_PADDING: Final = 512  # common.cuh:186
_Q8_1_PER_VALUE: Final = (36, 32)  # sizeof(block_q8_1) / QK8_1 (= block_q8_1_mmq 144 bytes / 128 values)
_Q8_1_MMQ: Final = 144  # sizeof(block_q8_1_mmq), mmq.cuh
_MMQ_J_MAX: Final = 256  # the most columns of an MMQ tile (mmq.cuh mmq_x <= 256): ggml_cuda_mmq_get_J_max
_MMQ_I_MAX: Final = 128  # mmq_y <= 128
_MMQ_FIXUP: Final = NSM_MAX * _MMQ_J_MAX * _MMQ_I_MAX * 4  # mmq.cuh:1459-1461: at most one block per SM x J x I floats
_BITONIC_MAX_COLS: Final = 1024  # argsort.cu:287: a row sorted in shared memory takes nothing from the pool
_GGML_PREC_F32: Final = 10  # ggml.h:446
_F32, _F16, _BF16 = (next(t for t, i in TYPES.items() if i.name == n) for n in ("f32", "f16", "bf16"))

Srcs = Sequence[RpcTensor | None]  # oprules.base.Srcs (not imported: oprules/cuda.py imports this module)
Estimate = Callable[[RpcTensor, Srcs], int]


def _nel(t: RpcTensor | None) -> int:
    return 0 if t is None else t.ne0 * t.ne1 * t.ne2 * t.ne3


def _nrows(t: RpcTensor | None) -> int:
    return 0 if t is None else t.ne1 * t.ne2 * t.ne3


def _quantized(t: RpcTensor | None) -> bool:
    info = TYPES.get(t.type) if t is not None else None
    return info is not None and info.blck_size > 1


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _q8_1(n_rows: int, ne10: int) -> int:
    """src1 quantised to q8_1 for n_rows rows of ne10 values, rows padded to 512 (mmq.cu:188-189,
    mmvq.cu:1531) plus MMQ's tail of one tile of columns."""
    return n_rows * _pad(ne10, MATRIX_ROW_PADDING) * _Q8_1_PER_VALUE[0] // _Q8_1_PER_VALUE[1] + _MMQ_J_MAX * _Q8_1_MMQ


def _cublas(src0: RpcTensor, src1: RpcTensor, dst: RpcTensor, prec: int) -> int:
    """ggml_cuda_mul_mat_cublas (ggml-cuda.cu:1621-1642 picks the compute type; :1440-1528 the
    pool): src0 and src1 converted to the compute type when they are not of it, dst computed
    into a temporary of the compute type when that is not F32, and the batched pointer arrays."""
    ct = _F16 if _quantized(src0) else src0.type
    if prec == _GGML_PREC_F32 or ct not in (_F16, _BF16, _F32):
        ct = _F32
    ts = TYPES[ct].type_size
    n = 0
    if src0.type != ct:
        n += _nel(src0) * ts  # :1449 src0_alloc.alloc(ggml_nelements(src0))
    if src1.type != ct:
        n += _nel(src1) * ts  # :1476 src1_alloc.alloc(ggml_nelements(src1))
    if ct != _F32:
        n += _nel(dst) * ts  # :1524 dst_temp.alloc(ne_dst)
    return n + 3 * dst.ne2 * dst.ne3 * 8  # :1578-1579 ptrs_src (2*ne23), ptrs_dst (ne23)


def _mul_mat(n: RpcTensor, s: Srcs) -> int:
    """ggml_cuda_mul_mat (ggml-cuda.cu:1879-1932): src1 or dst not F32 -> cuBLAS; a quantized
    src0 -> MMVQ (ne11 <= 8) or MMQ (Turing MMA: ggml_cuda_should_use_mmq, mmq.cu:371-373), both
    src1 as q8_1 (mmvq.cu:1531, mmq.cu:188-190) and MMQ's stream-k fixup (mmq.cuh:1459-1461);
    a float src0 -> MMVF/MMF (no pool) or cuBLAS: the larger is counted."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return 0
    if b.type != _F32 or n.type != _F32:
        return _cublas(a, b, n, n.param0)
    if _quantized(a):
        q = _q8_1(b.ne1 * b.ne2 * b.ne3, b.ne0)
        # MMVQ (no stream-k fixup) is certain for one column only: ggml_cuda_should_use_mmvq takes
        # up to 8 (mmvq.cuh:3) but fewer for some types on some GPUs (mmvq.cu:318-340)
        return q if b.ne1 <= 1 else q + _MMQ_FIXUP
    return _cublas(a, b, n, n.param0)


def _mul_mat_id(n: RpcTensor, s: Srcs) -> int:
    """ggml_cuda_mul_mat_id (ggml-cuda.cu:1934-2060): a quantized src0 -> MMVQ (mmvq.cu:1531) or
    MMQ (mmq.cu:239-260: the ids, expert bounds and src1 as q8_1 for every token x expert used);
    a float src0 -> MMF or the fallback (ggml-cuda.cu:2026-2031: ids, src1 and dst sorted by
    expert, then cuBLAS per expert on slices of them): the larger is counted."""
    a, b, ids = s[0], s[1], s[2]
    if a is None or b is None or ids is None:
        return 0
    used, tokens = ids.ne0, ids.ne1  # ids [n_expert_used, n_tokens]
    rows = tokens * used
    if _quantized(a) and b.type == _F32 and n.type == _F32:
        mmq = 2 * rows * 4 + (a.ne2 + 1) * 4 + _q8_1(rows, b.ne0) + _MMQ_FIXUP
        return max(mmq, _q8_1(b.ne1 * b.ne2 * b.ne3, b.ne0))
    ts1, tsd = TYPES[b.type].type_size, TYPES[n.type].type_size
    sorted_ = 2 * rows * 4 + rows * b.ne0 * ts1 + rows * n.ne0 * tsd
    # per expert, cuBLAS of its slice: src0 converted whole (one expert), its rows of src1 and dst
    ct_ts = 4 if n.param0 == _GGML_PREC_F32 else 2
    per_expert = (a.ne0 * a.ne1 * ct_ts if a.type not in (_F16, _BF16) or ct_ts == 4 else 0) \
        + rows * (b.ne0 + n.ne0) * ct_ts
    return sorted_ + per_expert


def _parallel_blocks(ntiles_dst_min: int, ntiles_kv: int) -> int:
    """The most ``parallel_blocks`` launch_fattn picks without stream-k (fattn-common.cuh:1191-1213):
    it starts at the occupancy (<= BLOCKS_PER_SM_MAX), never exceeds the KV tiles, and raises it
    only while that improves the last wave's efficiency, which is >= 95% from ~21 waves on."""
    return min(ntiles_kv, max(BLOCKS_PER_SM_MAX, -(-21 * _BLOCKS_PER_WAVE // max(1, ntiles_dst_min))))


def _flash_attn_ext(n: RpcTensor, s: Srcs) -> int:
    """launch_fattn (fattn-common.cuh:981-1230). The F16 copies of K/V are behind dst (the CUDA
    layer's reach), not in the pool. Kernel choice on Turing or newer (fattn.cu:636-664): VEC for
    at most two queries, else MMA, except head sizes 40 and 72, which take TILE. MMA runs
    stream-k: a fixup of at most one wave of blocks x ncols (<= 64) x (2 + DV/2) float2
    (:1188-1189). VEC and TILE do not: ``parallel_blocks`` partial results of dst and their row
    meta (:1216-1218), bounded by ``_parallel_blocks`` over the fewest dst tiles their column
    tiles allow (VEC 2 queries per tile, fattn-vec.cuh:541; TILE 64, fattn-tile.cuh:1160-1166)
    and KV tiles of at least 32. The sparse KV-max lists (:1100-1110) when op_params[4] is set."""
    q, k = s[0], s[1]
    if q is None or k is None:
        return 0
    dv, ntiles_kv = n.ne0, max(1, -(-k.ne1 // 32))
    partials = _nel(n) * 4 + _nrows(n) * 8
    if q.ne1 <= 2:
        blocks = _parallel_blocks(-(-q.ne1 // 2) * q.ne2 * q.ne3, ntiles_kv)
        total = blocks * partials if blocks > 1 else 0
    elif q.ne0 in (40, 72):
        blocks = _parallel_blocks(-(-q.ne1 // 64) * k.ne2 * q.ne3, ntiles_kv)
        total = blocks * partials if blocks > 1 else 0
    else:
        total = _BLOCKS_PER_WAVE * 64 * (2 + dv // 2) * 8
    if n.param4:
        mask = s[3]
        total += q.ne1 * (mask.ne3 if mask is not None else 1) * (k.ne1 + 1) * 4
    return total


def _cub_sort(ncols: int, nrows: int) -> int:
    """argsort_f32_i32_cuda_cub (argsort.cu:45-130): indices, keys and sorted keys (12 bytes per
    element), the segment offsets, and CUB's temporary storage, estimated as 8 bytes per element +
    1 MiB (DeviceSegmentedSort's double buffers; its size is CUB's, not in the tree)."""
    if ncols <= _BITONIC_MAX_COLS:
        return 0  # argsort.cu:287: bitonic in shared memory
    n = ncols * nrows
    return 12 * n + 4 * (nrows + 1) + 8 * n + (1 << 20)


def _argsort(n: RpcTensor, s: Srcs) -> int:
    a = s[0]
    return 0 if a is None else _cub_sort(a.ne0, _nrows(a))


def _top_k(n: RpcTensor, s: Srcs) -> int:
    """ggml_cuda_op_top_k (top-k.cu:225-275): the argsort fallback's whole sorted index rows
    (:247, :270) plus the sort; CUB's top-k and the radix states (:36, :192-193) are smaller."""
    a = s[0]
    return 0 if a is None else 4 * _nel(a) + _cub_sort(a.ne0, _nrows(a))


def _ssm_scan(n: RpcTensor, s: Srcs) -> int:
    """ssm_scan_ssd (ssm-scan.cu:605-660): per head and sequence, chunk-sized (64) buffers."""
    x, b = s[1], s[4]
    if x is None or b is None:
        return 0
    head_dim, n_head, n_tok, n_seq = x.ne0, x.ne1, x.ne2, x.ne3
    d_state, n_group, c = b.ne0, b.ne1, 64
    return (2 * n_tok * n_head * n_seq * 4 + c * c * n_group * n_seq * 4 + c * head_dim * n_head * n_seq * 2
            + d_state * c * n_head * n_seq * (2 + 4) + c * c * n_head * n_seq * 2)


def _conv_f16_input(n: RpcTensor, s: Srcs) -> int:
    """conv2d.cu:400 / conv3d.cu:315: the input converted to F16 with its padding (at most the
    padded input; here the input plus a kernel's width of padding per side) and the split-K
    partial sums (conv2d.cu:427, at most dst in F32)."""
    kernel, x = s[0], s[1]
    if kernel is None or x is None or kernel.type != _F16:
        return 0
    padded = (x.ne0 + 2 * kernel.ne0) * (x.ne1 + 2 * kernel.ne1) * x.ne2 * x.ne3
    return padded * 2 + _nel(n) * 4


def _out_prod(n: RpcTensor, s: Srcs) -> int:
    return 3 * n.ne2 * n.ne3 * 8  # out-prod.cu:97-99 pointer arrays


def _cross_entropy(n: RpcTensor, s: Srcs) -> int:
    return 4 * _nrows(s[0])  # cross-entropy-loss.cu:123 one float per row


#: op -> (estimate, where the allocations were read), ggml-cuda b11434
ROWS: Final[Mapping[str, tuple[Estimate, str]]] = {
    "MUL_MAT": (_mul_mat, "ggml-cuda.cu:1440-1528,1578-1579,1879-1932; mmq.cu:188-190; mmvq.cu:1531; mmq.cuh:1459"),
    "MUL_MAT_ID": (_mul_mat_id, "ggml-cuda.cu:2026-2031; mmq.cu:239-260; mmvq.cu:1531"),
    "FLASH_ATTN_EXT": (_flash_attn_ext, "fattn-common.cuh:1017-1021,1188-1189,1199-1218"),
    "ARGSORT": (_argsort, "argsort.cu:52-70,124,287"),
    "TOP_K": (_top_k, "top-k.cu:36,192-193,247,270"),
    "SSM_SCAN": (_ssm_scan, "ssm-scan.cu:616-621,659"),
    "CONV_2D": (_conv_f16_input, "conv2d.cu:400,427"),
    "CONV_3D": (_conv_f16_input, "conv3d.cu:315,341"),
    "OUT_PROD": (_out_prod, "out-prod.cu:97-99"),
    "CROSS_ENTROPY_LOSS": (_cross_entropy, "cross-entropy-loss.cu:123"),
}


def node_scratch(op: str, n: RpcTensor, s: Srcs) -> int:
    """Bytes of pool scratch one node of ``op`` takes on CUDA (0 for ops that take none)."""
    row = ROWS.get(op)
    if row is None:
        return 0
    try:
        return max(0, row[0](n, s))
    except (ArithmeticError, LookupError, AttributeError, TypeError):
        return 0  # a source the constructor row requires is missing: that row refused it


def check_scratch(op: str, n: RpcTensor, s: Srcs, budget: int) -> int:
    """``node_scratch``, refused ``cuda_scratch_over_budget`` above ``budget`` (0: no budget)."""
    need = node_scratch(op, n, s)
    if budget and need > budget:
        raise FirewallRefusal(
            "cuda_scratch_over_budget",
            f"node id={n.id:#x} op {op} on CUDA takes an estimated {need} bytes of pool scratch "
            f"({ROWS[op][1]}) > policy.max_cuda_scratch_bytes {budget}")
    return need
