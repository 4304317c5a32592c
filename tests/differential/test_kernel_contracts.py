"""Beyond the constructor oracle: nodes the REAL constructor builds that the CPU kernel cannot run.

The differential tests (test_ops_differential.py) take ggml's constructors as the definition of
a valid node. For a few ops the constructor checks less than its CPU kernel assumes, so a
graph a client can build with the real ggml still reads outside its tensors or aborts the
server (llama-cpp-python 0.3.36 sources, ggml/src/ggml.c and ggml/src/ggml-cpu/ops.cpp):

* FLASH_ATTN_EXT: ggml_flash_attn_ext (ggml.c:5506-5545) checks q/k with ggml_can_mul_mat and the
  mask's type, contiguity and head broadcast only (its ggml_can_repeat_rows(mask, qk) assert is
  commented out, ggml.c:5524). The kernel loops ic < nek1 (ops.cpp:9500) and reads mask row iq1 at mp[ic]
  (ops.cpp:8950, 8968) and V row ic (ops.cpp:8991), and V head iq2 / (neq2 / nev2) (ops.cpp:8894):
  a V with fewer rows or heads than K, or a mask narrower than n_kv or shorter than n_q, is read
  past its end.
* ROPE: ggml_rope_ext takes any n_dims and ggml_rope_set_offset (ggml.c:4535) any n_offs >= 0; the kernel
  asserts n_dims <= ne0 and n_offs + n_dims <= ne0 (ops.cpp:6355, 6360): GGML_ASSERT aborts the
  whole server.
* ACC / SET: strides and offset in op_params are not checked against dst (#25764), the kernel
  writes there: refused today (graph_op_params_invalid), kept here as the reference.

Each case is built by the real constructors first (so it is something a client can send), then
rpcguard's validator must refuse it. These are stricter than the constructor on purpose; the
lead decides whether the rule table takes them.
"""

from __future__ import annotations

import json

import pytest

from tests.differential.oracle import validate
from tests.support.ggmlref import Built, build_many

ROPE_TAIL = [10000.0, 1.0, 0.0, 1.0, 32.0, 1.0]


def _fa(q_ne, k_ne, v_ne, mask_ne):
    leaves = [{"type": "f32", "ne": q_ne}, {"type": "f16", "ne": k_ne}, {"type": "f16", "ne": v_ne}]
    if mask_ne:
        leaves.append({"type": "f16", "ne": mask_ne})
    return {"leaves": leaves,
            "ops": [{"fn": "flash_attn_ext", "args": [0, 1, 2, 3 if mask_ne else None, 0.125, 0.0, 0.0]}]}  # fmt: skip


CASES = {
    "flash_attn_ext: V has fewer rows (n_kv) than K": _fa([64, 4, 2, 1], [64, 256, 2, 1], [64, 32, 2, 1], None),
    "flash_attn_ext: mask narrower than n_kv": _fa([64, 4, 2, 1], [64, 256, 2, 1], [64, 256, 2, 1], [16, 64, 1, 1]),
    "flash_attn_ext: mask has fewer rows than n_q": _fa([64, 7, 2, 1], [64, 32, 2, 1], [64, 32, 2, 1], [32, 1, 1, 1]),
    "flash_attn_ext: V has heads K and Q do not divide": _fa([64, 1, 4, 1], [64, 32, 4, 1], [64, 32, 3, 1], None),
    "rope_ext: n_dims > ne0 (server abort)": {
        "leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
        "ops": [{"fn": "rope_ext", "args": [0, 1, None, 32, 0, 4096, *ROPE_TAIL]}],
    },
    "rope_set_offset: n_offs + n_dims > ne0 (server abort)": {
        "leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
        "ops": [{"fn": "rope_ext", "args": [0, 1, None, 8, 0, 4096, *ROPE_TAIL]},
                {"fn": "rope_set_offset", "args": [2, 12]}],
    },
    "acc: row stride past dst (#25764)": {
        "leaves": [{"type": "f32", "ne": [8, 4, 1, 1]}, {"type": "f32", "ne": [8, 4, 1, 1]}],
        "ops": [{"fn": "acc", "args": [0, 1, 1 << 20, 1 << 22, 1 << 22, 0]}],
    },
    "set: offset past dst (#25764)": {
        "leaves": [{"type": "f32", "ne": [8, 4, 1, 1]}, {"type": "f32", "ne": [8, 1, 1, 1]}],
        "ops": [{"fn": "set", "args": [0, 1, 32, 128, 128, 1 << 20]}],
    },
    # ggml_interpolate (ggml.c:5208): NEAREST takes i0 / sf in single precision (ops.cpp:8243);
    # (float)20986227 rounds up to 20986228 = ne00: one element past the source (SIGSEGV at the
    # guard page when computed); every mode does the same in dims 2-3
    "interpolate: nearest index rounds up past the source (dim 0, > 2^24)": {
        "leaves": [{"type": "f32", "ne": [20986228, 1, 1, 1]}],
        "ops": [{"fn": "interpolate", "args": [0, 20986228, 1, 1, 1, 0]}],
    },
    "interpolate: bilinear dim 2 index rounds up past the source (> 2^24)": {
        "leaves": [{"type": "f32", "ne": [1, 1, 20986228, 1]}],
        "ops": [{"fn": "interpolate", "args": [0, 1, 1, 20986228, 1, 1]}],
    },
    # ggml_conv_transpose_1d (ggml.c:4727) takes any s0; the kernel adds into dst[i10*s0 + i00]
    # (ops.cpp:6687): with s0 = -1, L = 2, K = 3 the result has ne0 = 2 and i10 = 1 writes dst[-1]
    "conv_transpose_1d: negative stride writes before dst": {
        "leaves": [{"type": "f32", "ne": [3, 2, 2, 1]}, {"type": "f32", "ne": [2, 2, 1, 1]}],
        "ops": [{"fn": "conv_transpose_1d", "args": [0, 1, -1, 0, 1]}],
    },
    # ggml_conv_2d_dw_direct (ggml.c:4916) builds a result of b's type from any b; the kernel reads
    # b and writes dst as float arrays (ops.cpp:7832): an F16 input is read and written twice over
    "conv_2d_dw_direct: F16 input read as floats": {
        "leaves": [{"type": "f32", "ne": [3, 3, 1, 2]}, {"type": "f16", "ne": [5, 5, 2, 1]}],
        "ops": [{"fn": "conv_2d_dw_direct", "args": [0, 1, 1, 1, 0, 0, 1, 1]}],
    },
    # ... and takes a b neither contiguous nor channels-first, which the kernel aborts on (ops.cpp:7907)
    "conv_2d_dw_direct: padded input rows (server abort)": {
        "leaves": [{"type": "f32", "ne": [3, 3, 1, 2]}, {"type": "f32", "ne": [5, 5, 2, 1], "nb": [4, 32, 160, 320]}],
        "ops": [{"fn": "conv_2d_dw_direct", "args": [0, 1, 1, 1, 0, 0, 1, 1]}],
    },
    # -- convolutions (3D, transposed, col2im) --
    # ggml_conv_3d_direct (ggml.c:4994) asserts only a.ne3 == IC*OC and b.ne3 == IC*N: negative counts
    # pass; in size_t the kernel's bytes per patch wrap, its patches per batch is 0 and it divides by it
    # (ops.cpp:7493-7496): SIGFPE on the real kernel
    "conv_3d_direct: negative IC, N, OC whose products match (server SIGFPE)": {
        "leaves": [{"type": "f32", "ne": [1, 1, 1, 1]}, {"type": "f32", "ne": [2, 2, 2, 1]}],
        "ops": [{"fn": "conv_3d_direct", "args": [0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, -1, -1, -1]}],
    },
    # ggml_conv_2d_direct (ggml.c:4956) builds a result of b's type from any b; the kernel reads b and
    # writes dst as floats (ops.cpp:7391, 7431): SIGSEGV
    "conv_2d_direct: F16 input read as floats": {
        "leaves": [{"type": "f32", "ne": [3, 3, 2, 2]}, {"type": "f16", "ne": [5, 5, 2, 1]}],
        "ops": [{"fn": "conv_2d_direct", "args": [0, 1, 1, 1, 0, 0, 1, 1]}],
    },
    # one patch (4M + 32 F32 taps) past the planner's 16 MiB GGML_IM2COL_WORK_SIZE: the kernel's
    # patches per batch is 0 and it divides by it (ops.cpp:7353) before its assert: SIGFPE
    "conv_2d_direct: one patch past the 16 MiB work buffer (server SIGFPE)": {
        "leaves": [{"type": "f32", "ne": [1, 1, (1 << 22) + 32, 1]}, {"type": "f32", "ne": [1, 1, (1 << 22) + 32, 1]}],
        "ops": [{"fn": "conv_2d_direct", "args": [0, 1, 1, 1, 0, 0, 1, 1]}],
    },
    # ggml_conv_transpose_2d_p0 (ggml.c:5048) takes any stride; the kernel adds into
    # dst[(i11*s + i01)*ne0 + i10*s + i00] (ops.cpp:7692): s = -1 writes before dst (SIGSEGV)
    "conv_transpose_2d_p0: negative stride writes before dst": {
        "leaves": [{"type": "f32", "ne": [3, 3, 1, 1]}, {"type": "f32", "ne": [2, 2, 1, 1]}],
        "ops": [{"fn": "conv_transpose_2d_p0", "args": [0, 1, -1]}],
    },
    # ... and any kernel view; the kernel copies each [KW, KH] plane as KW*KH packed elements
    # (ops.cpp:7625): rows that overlap (nb1 < KW*es) are read past the view's extent (SIGSEGV)
    "conv_transpose_2d_p0: kernel rows overlap, planes read packed": {
        "leaves": [{"type": "f32", "ne": [4, 4, 1, 1], "nb": [4, 4, 28, 28]}, {"type": "f32", "ne": [2, 2, 1, 1]}],
        "ops": [{"fn": "conv_transpose_2d_p0", "args": [0, 1, 1]}],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def built():
    return dict(zip(CASES, build_many(list(CASES.values()))))


@pytest.mark.parametrize("name", list(CASES))
def test_constructor_accepts_but_kernel_cannot_run_it(built, name):
    b = built[name]
    assert isinstance(b, Built), f"the real constructor refuses it now ({b.message}): drop the case"
    reason = validate(b.payload, b.buffers)
    assert reason is not None and not reason.startswith("EXCEPTION"), (
        f"rpcguard forwards a node the CPU kernel reads out of bounds with / aborts on: {name}\n"
        f"recipe={json.dumps(CASES[name])}"
    )


# -- ROPE's reach past its freq factors (and an odd row), judged per buffer (issue 20 point 3) --
# ggml_rope_cache_init / ggml_mrope_cache_init (ops.cpp:6209-6210, 6234-6235) read freq_factors[i0/2]
# for every even i0 < ne0: ceil(ne0/2) floats, past the n_dims/2 the constructor asks for. Read
# inside the factors' buffer (leaf "room") the kernel computes and rpcguard forwards; flush
# against the buffer's end the guarded kernel faults and rpcguard refuses. An odd ne0 copies one
# element past every row of src0 and dst (ops.cpp:6450-6462): a fresh dst ends its buffer here.


def _rope_ff(mode: int, ne0: int, n_dims: int, room: int, back: bool = False) -> dict:
    leaves = [{"type": "f32", "ne": [ne0, 2, 3, 1]}, {"type": "i32", "ne": [12 if mode & 8 else 3, 1, 1, 1]},
              {"type": "f32", "ne": [n_dims // 2, 1, 1, 1], **({"room": room} if room else {})}]
    if mode & 8:
        secs = [n_dims // 2, n_dims // 2, 0, 0] if mode == 24 else [n_dims // 3] * 3 + [0]
        op = {"fn": "rope_multi_back" if back else "rope_multi", "args": [0, 1, 2, n_dims, secs, mode, 4096, *ROPE_TAIL]}
    else:
        op = {"fn": "rope_ext_back" if back else "rope_ext", "args": [0, 1, 2, n_dims, mode, 4096, *ROPE_TAIL]}
    return {"leaves": leaves, "ops": [op]}


ROPE_FF = [(mode, ne0, n_dims, back) for mode, ne0, n_dims in ((0, 16, 8), (2, 16, 8), (8, 16, 6), (40, 16, 6),
                                                              (24, 16, 8), (0, 80, 32))
           for back in (False, True)]


@pytest.fixture(scope="module")
def rope_ff():
    recipes = []
    for mode, ne0, n_dims, back in ROPE_FF:
        need = (ne0 // 2 - n_dims // 2) * 4
        recipes += [_rope_ff(mode, ne0, n_dims, r, back) for r in (0, need - 4, need, need + 64)]
    odd = {"leaves": [{"type": "f32", "ne": [7, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
           "ops": [{"fn": "rope_ext", "args": [0, 1, None, 4, 0, 4096, *ROPE_TAIL]}]}
    return build_many(recipes + [odd], compute=True)


@pytest.mark.parametrize("i", range(len(ROPE_FF)), ids=[f"mode{m}-ne0{e}-n_dims{d}{'-back' if b else ''}"
                                                        for m, e, d, b in ROPE_FF])
def test_rope_freq_factors_are_judged_by_their_buffer(rope_ff, i):
    flush, short, exact, plenty = rope_ff[4 * i : 4 * i + 4]
    for b, fits in ((flush, False), (short, False), (exact, True), (plenty, True)):
        assert isinstance(b, Built), b
        reason = validate(b.payload, b.buffers)
        if fits:
            assert b.kernel == "ok" and reason is None, (b.kernel, reason)
        else:
            assert b.kernel.startswith("signal") and reason == "tensor_layout_invalid", (b.kernel, reason)


def test_rope_odd_row_past_a_flush_dst_is_refused(rope_ff):
    b = rope_ff[-1]
    assert isinstance(b, Built) and b.kernel.startswith("signal"), b  # the guarded kernel writes past dst
    assert validate(b.payload, b.buffers) == "tensor_layout_invalid"
