"""The node's backend (protocol/backend.py) and the CUDA layer of the op table (oprules/cuda.py):
each CUDA row refuses its case on a CUDA node with its own reason, and the same node passes on a
CPU node (the CPU layer adds nothing); detection from GET_ALIGNMENT / GET_ALLOC_SIZE answers and
the server's banner; a setting the server contradicts is refused, never held to the CPU's rules."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import backend
from rpcguard.protocol.encode import graph_payload, pack_tensor
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.oprules import cuda
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.tensor import alloc_size_key, decode_tensor
from tests.support.graphspec import BASE, HANDLE, OPS, SIZE, V7, T, f, state

F32, F16, Q4_0, Q8_0, Q4_K, I32 = 0, 1, 2, 8, 12, 26


def run(tensors, node, setting="auto", st=None) -> None:
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=setting))
    v.check(memoryview(graph_payload([node.id], tensors + [node])), st if st is not None else state())


def cuda_reason(tensors, node, size: int = SIZE) -> str:
    """The node passes on a CPU node and is refused on a CUDA node: the reason."""
    run(tensors, node, "cpu", state(size=size))
    run(tensors, node, "auto", state(size=size))  # nothing detected: the CPU layer
    with pytest.raises(FirewallRefusal) as exc:
        run(tensors, node, "cuda", state(size=size))
    return exc.value.reason


# -- builders ----------------------------------------------------------------------------------

def diag_mask_zero():
    a = T(0x10, F32, (8, 8, 1, 1))
    return [a], T(0x20, F32, (8, 8, 1, 1), op=OPS["DIAG_MASK_ZERO"], src=(0x10,), op_params=(2,))


def unary_permuted():
    # RELU (unary op 10... any op id) on a permuted source: rows contiguous, dims 1/2 swapped
    a = T(0x10, F32, (4, 3, 2, 1), nb=(4, 32, 16, 96))
    return [a], T(0x20, F32, (4, 3, 2, 1), op=OPS["UNARY"], src=(0x10,), op_params=(10,))


def cpy(dst_type: int, src_type: int = F32, ne=(256, 2, 1, 1)):
    a, b = T(0x10, src_type, ne), T(0x11, dst_type, ne)
    return [a, b], T(0x20, dst_type, ne, op=OPS["CPY"], src=(0x10, 0x11), view_src=0x11, data=b.data)


def rope(ne0: int):
    a = T(0x10, F32, (ne0, 2, 3, 1))
    pos = T(0x11, I32, (3, 1, 1, 1))
    params = (0, ne0 - ne0 % 2, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)
    return [a, pos], T(0x20, F32, (ne0, 2, 3, 1), op=OPS["ROPE"], src=(0x10, 0x11), op_params=params)


def flash_attn(d: int = 128, kv_type: int = F16, n_q: int = 4, n_kv: int = 256, dst_data: int | None = None):
    q = T(0x10, F32, (d, n_q, 8, 1))
    k = T(0x11, kv_type, (d, n_kv, 8, 1))
    v = T(0x12, kv_type, (d, n_kv, 8, 1))
    mask = T(0x13, F16, (n_kv, n_q, 1, 1))
    kw = {} if dst_data is None else {"data": dst_data}
    node = T(0x20, F32, (d, 8, n_q, 1), op=OPS["FLASH_ATTN_EXT"], src=(0x10, 0x11, 0x12, 0x13),
             op_params=(f(0.125), 0, 0, 0), **kw)
    return [q, k, v, mask], node


def rms_norm(ne):
    a = T(0x10, F32, ne)
    return [a], T(0x20, F32, ne, op=OPS["RMS_NORM"], src=(0x10,), op_params=(f(1e-6),))


def pad(ne1: int):
    a = T(0x10, F32, (1, ne1, 1, 1))
    return [a], T(0x20, F32, (2, ne1, 1, 1), op=OPS["PAD"], src=(0x10,), op_params=(0, 1, 0, 0, 0, 0, 0, 0, 0))


def add(a_data_offset: int = 0, b_nb1: int = 16):
    a = T(0x10, F32, (4, 2, 1, 1))
    a.data += a_data_offset
    b = T(0x11, F32, (4, 2, 1, 1), nb=(4, b_nb1, 2 * b_nb1, 2 * b_nb1))
    return [a, b], T(0x20, F32, (4, 2, 1, 1), op=OPS["ADD"], src=(0x10, 0x11))


def mul_mat(a_type=Q8_0, k=64, a_data=None):
    a = T(0x10, a_type, (k, 8, 1, 1))
    if a_data is not None:
        a.data = a_data
    b = T(0x11, F32, (k, 3, 1, 1))
    return [a, b], T(0x20, F32, (8, 3, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))


# -- the CUDA rows -----------------------------------------------------------------------------

def test_ops_without_a_cuda_kernel_are_refused_on_cuda_only():
    # ggml-cuda.cu:2474-2475 / :4458 / :5728-5729: no case for DIAG_MASK_ZERO (gap study 2.B)
    assert cuda_reason(*diag_mask_zero()) == "backend_unsupported_op"
    assert cuda.NO_KERNEL == {"DIAG_MASK_ZERO", "IM2COL_BACK", "POOL_2D_BACK", "WIN_PART", "WIN_UNPART",
                              "GET_REL_POS", "ADD_REL_POS"}


def test_non_contiguous_unary_refused():
    # unary.cu:144 GGML_ASSERT(ggml_is_contiguous(src0))
    assert cuda_reason(*unary_permuted()) == "backend_unsupported_op"
    a = T(0x10, F32, (4, 3, 2, 1))
    run([a], T(0x20, F32, (4, 3, 2, 1), op=OPS["UNARY"], src=(0x10,), op_params=(10,)), "cuda")


@pytest.mark.parametrize("dst, src, ok", [
    (Q4_K, F32, False),  # cpy.cu:618 GGML_ABORT: no F32 -> Q4_K kernel
    (Q8_0, F32, True), (Q4_0, F32, True), (F16, F32, True), (F32, Q8_0, True),
])
def test_copy_type_pairs(dst, src, ok):
    tensors, node = cpy(dst, src)
    if ok:
        run(tensors, node, "cuda")
    else:
        assert cuda_reason(tensors, node) == "backend_unsupported_op"


def test_odd_rope_refused():
    # rope.cu:383 GGML_ASSERT(ne00 % 2 == 0)
    assert cuda_reason(*rope(63)) == "backend_unsupported_op"
    run(*rope(64), "cuda")


@pytest.mark.parametrize("d, kv, ok", [
    (128, F16, True), (64, Q8_0, True), (256, Q4_0, True),
    (32, F16, False),  # fattn.cu:621-622 default: no kernel for D = 32
    (256, Q4_K, False),  # fattn.cu:524-539: K/V types with a kernel
])
def test_flash_attn_head_sizes_and_kv_types(d, kv, ok):
    tensors, node = flash_attn(d, kv)
    if ok:
        run(tensors, node, "cuda")
    else:
        assert cuda_reason(tensors, node) == "backend_unsupported_op"


def test_flash_attn_f16_copies_behind_dst_must_fit_the_buffer():
    # fattn-common.cuh:53-83: K and V converted to F16 behind dst, at pad128(dst + nbytes)
    tensors, node = flash_attn(128, Q8_0)
    dst_bytes = 128 * 8 * 4 * 4
    extra = 2 * 2 * (128 * 256 * 8)  # F16 copies of K and V
    at_end = BASE + SIZE - dst_bytes - 64  # dst fits, its F16 copies do not
    tensors, node = flash_attn(128, Q8_0, dst_data=at_end)
    assert cuda_reason(tensors, node) == "backend_reach_out_of_buffer"
    room = BASE + SIZE - ((dst_bytes + 127) // 128 * 128 + extra + 256)
    run(*flash_attn(128, Q8_0, dst_data=room - room % 128), "cuda")
    run(*flash_attn(128, F16, dst_data=at_end), "cuda")  # F16 K/V: nothing behind dst


def test_fa_extra_end_matches_the_formula():
    tensors, node = flash_attn(128, Q8_0, n_kv=256)
    specs = {t.id: t for t in tensors}
    enc = [decode_tensor(pack_tensor(t)) for t in (node, specs[0x10], specs[0x11], specs[0x12])]
    n, q, k, v = enc
    end = cuda.fa_extra_end(n, [q, k, v, None])
    nb = 128 * 8 * 4 * 4
    k_at = -(-(n.data + nb) // 128) * 128
    v_at = -(-(k_at + 2 * 128 * 256 * 8) // 128) * 128
    assert end == v_at + 2 * 128 * 256 * 8 - n.data


def test_grid_axes_past_65535_refused():
    # norm.cu:313 blocks_num(nrows, nchannels, nsamples); pad.cu:70 gridDim(.., ne1, ne2*ne3)
    assert cuda_reason(*rms_norm((64, 1, 70000, 1)), size=1 << 26) == "backend_grid_too_large"
    run(*rms_norm((64, 70000, 1, 1)), "cuda", state(size=1 << 26))  # rows are grid x: fine
    assert cuda_reason(*pad(70000), size=1 << 26) == "backend_grid_too_large"
    run(*pad(65535), "cuda", state(size=1 << 26))


def test_misaligned_tensors_refused():
    # gap study G1; binbcast.cu:284-297 asserts nb % sizeof(T)
    assert cuda_reason(*add(a_data_offset=2)) == "backend_misaligned"
    assert cuda_reason(*add(b_nb1=18)) == "backend_misaligned"
    run(*add(), "cuda")


def test_index_wrap_refused():
    # unary.cu:131 unary_cuda(..., const int k): 2^31 F16 elements (a 4 GiB tensor) wrap k
    ne = (1 << 16, 1 << 13, 2, 2)
    st = state(size=(1 << 32) + 4096)
    a = T(0x10, F16, ne, data=BASE)
    node = T(0x20, F16, ne, op=OPS["UNARY"], src=(0x10,), op_params=(10,), view_src=0x10, data=BASE)
    assert cuda_reason([a], node, size=(1 << 32) + 4096) == "backend_index_overflow"
    small = (1 << 16, 1 << 13, 2, 1)
    run([T(0x10, F16, small, data=BASE)], T(0x20, F16, small, op=OPS["UNARY"], src=(0x10,), op_params=(10,),
                                             view_src=0x10, data=BASE), "cuda", st)


def test_quantized_matrix_padding_must_fit_the_buffer():
    # ggml-cuda.cu:911-917: ne0 64 of q8_0 is padded by row_size(q8_0, 448) = 476 bytes
    row = 64 // 32 * 34
    at_end = BASE + SIZE - 8 * row
    assert cuda_reason(*mul_mat(Q8_0, 64, a_data=at_end)) == "backend_reach_out_of_buffer"
    run(*mul_mat(Q8_0, 64, a_data=at_end - 476), "cuda")
    run(*mul_mat(Q8_0, 512, a_data=BASE + SIZE - 8 * 512 // 32 * 34), "cuda")  # no padding: a multiple of 512


def test_matrix_src0_types():
    assert cuda_reason(*mul_mat(34, 256)) == "backend_unsupported_op"  # TQ1_0: not in supports_op :5344-5374


# -- detection and the setting ------------------------------------------------------------------

def test_alignment_detects_the_backend():
    assert backend.detect(state(128), 0) == "cuda"
    assert backend.detect(state(32), 0) == "cpu"
    assert backend.detect(state(64), 0) == "unknown alignment 64"
    assert backend.detect(state(), 0) is None


def test_auto_follows_the_server_and_a_cuda_answer_is_never_held_to_the_cpu_rules():
    tensors, node = diag_mask_zero()
    run(tensors, node, "auto", state(32))
    with pytest.raises(FirewallRefusal) as exc:
        run(tensors, node, "auto", state(128))
    assert exc.value.reason == "backend_unsupported_op"


@pytest.mark.parametrize("setting, alignment, reason", [
    ("cpu", 128, "backend_mismatch"), ("cuda", 32, "backend_mismatch"),
    ("auto", 64, "backend_unknown"), ("cuda", 64, "backend_unknown"),
])
def test_mismatch_and_unknown_are_refusals(setting, alignment, reason):
    tensors, node = add()
    with pytest.raises(FirewallRefusal) as exc:
        run(tensors, node, setting, state(alignment))
    assert exc.value.reason == reason


def test_padding_in_alloc_size_answers_detects_cuda():
    st = state()
    t = decode_tensor(pack_tensor(T(0x10, Q8_0, (64, 2, 1, 1))))
    plain = 2 * 64 // 32 * 34
    st.upstream.alloc_sizes[alloc_size_key(0, t)] = plain + 476
    assert backend.detect(st, 0) == "cuda"
    st.upstream.alloc_sizes[alloc_size_key(0, t)] = plain
    assert backend.detect(st, 0) == "cpu"


def test_banner_names_each_device():
    text = ("Starting RPC server v7.0.0\n  endpoint       : 127.0.0.1:50052\n  local cache    : n/a\nDevices:\n"
            "  CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)\n  CPU: AMD EPYC 9654 (773000 MiB, 770000 MiB free)\n"
            "  transport      : TCP\n")
    assert backend.parse_banner(text) == {0: "cuda", 1: "cpu"}
    assert backend.parse_banner("Devices:\n  Vulkan0: AMD (1024 MiB, 1000 MiB free)\n") == {0: "vulkan"}


# -- GET_ALLOC_SIZE and INIT_TENSOR --------------------------------------------------------------

def _t(**kw):
    return decode_tensor(pack_tensor(T(0x10, **kw)))


def test_alloc_commands_on_cuda():
    st = state(128)
    # ggml-cuda.cu:914 GGML_ASSERT(nb[0] == element size) for a padded quantized tensor
    bad = _t(type=Q8_0, ne=(64, 2, 1, 1), nb=(68, 136, 272, 272))
    with pytest.raises(FirewallRefusal) as exc:
        backend.check_alloc_command("auto", "GET_ALLOC_SIZE", bad, [], st, 0)
    assert exc.value.reason == "backend_unsupported_op"
    backend.check_alloc_command("auto", "GET_ALLOC_SIZE", bad, [], state(32), 0)  # the CPU never asserts it
    # fattn.cu:729-730: FLASH_ATTN_EXT without K / V
    fa = _t(type=F32, ne=(128, 8, 4, 1), op=OPS["FLASH_ATTN_EXT"])
    with pytest.raises(FirewallRefusal):
        backend.check_alloc_command("auto", "GET_ALLOC_SIZE", fa, [None, None, None], st, 0)
    q, k = _t(type=F32, ne=(128, 4, 8, 1)), _t(type=F16, ne=(128, 256, 8, 1))
    backend.check_alloc_command("auto", "GET_ALLOC_SIZE", fa, [q, k, k], st, 0)
    # ggml-cuda.cu:758-766: INIT_TENSOR zeroes the padding, asked for or not
    row = 64 // 32 * 34
    at_end = _t(type=Q8_0, ne=(64, 2, 1, 1), data=BASE + SIZE - 2 * row)
    with pytest.raises(FirewallRefusal) as exc:
        backend.check_alloc_command("cuda", "INIT_TENSOR", at_end, [], st, 0)
    assert exc.value.reason == "backend_reach_out_of_buffer"
    backend.check_alloc_command("cpu", "INIT_TENSOR", at_end, [], state(), 0)


def test_a_verdict_cached_under_the_cpu_layer_is_not_reused_once_the_server_says_cuda():
    tensors, node = diag_mask_zero()
    st = state()
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64))
    payload = memoryview(graph_payload([node.id], tensors + [node]))
    v.check(payload, st)  # nothing said yet: the CPU layer, the node's verdict cached
    st.upstream.alignment[0] = 128  # GET_ALLOC_SIZE / GET_ALIGNMENT answers arrive
    with pytest.raises(FirewallRefusal) as exc:
        v.check(payload, st)
    assert exc.value.reason == "backend_unsupported_op"


# -- the gap study's cases through a whole session (tests/support/gpucases.py, also run by
# scripts/gpu_check.py against a real server) -----------------------------------------------------

def _session(setting: str):
    from dataclasses import replace

    from rpcguard.protocol.session import Session
    from rpcguard.protocol.settings import FirewallPolicy, SessionPolicy

    policy = SessionPolicy(clear_new_buffers=False, firewall=replace(FirewallPolicy(), backend=setting))
    s = Session(policy, UpstreamFacts(device_count=1, version=V7, memory={0: (1 << 36, 1 << 36)}))
    s.client_data(memoryview(encode_mod.hello_request(V7)))
    s.server_data(memoryview(encode_mod.hello_response(V7)))
    s.state.add_buffer(HANDLE, 0, gpucases.BUFFER_BYTES)
    s.state.set_base(HANDLE, BASE)
    return s


from rpcguard.protocol import encode as encode_mod  # noqa: E402
from tests.support import gpucases  # noqa: E402


@pytest.mark.parametrize("case", gpucases.CASES, ids=lambda c: c.name)
def test_gap_study_cases_refused_on_cuda_forwarded_on_cpu(case):
    frame = case.build(gpucases.Layout(HANDLE, BASE))
    cpu = _session("cpu")
    cpu.client_data(memoryview(frame))  # the CPU layer adds nothing: forwarded
    assert cpu.to_server
    with pytest.raises(FirewallRefusal) as exc:
        _session("cuda").client_data(memoryview(frame))
    assert exc.value.reason == case.want, exc.value.detail


def test_supports_op_rows():
    # REPEAT of I32 (gap study Appendix A): ggml-cuda.cu:5505-5510 f32/f16 only
    a = T(0x10, I32, (4, 1, 1, 1))
    assert cuda_reason([a], T(0x20, I32, (8, 2, 1, 1), op=OPS["REPEAT"], src=(0x10,))) == "backend_unsupported_op"
    run([T(0x10, F32, (4, 1, 1, 1))], T(0x20, F32, (8, 2, 1, 1), op=OPS["REPEAT"], src=(0x10,)), "cuda")
    # SUM of F16: supports_op says yes (rows contiguous), the kernel asserts f32 (sum.cu:28)
    h = T(0x10, F16, (8, 2, 1, 1))
    assert cuda_reason([h], T(0x20, F16, (1, 1, 1, 1), op=OPS["SUM"], src=(0x10,))) == "backend_unsupported_op"
    run([T(0x10, F32, (8, 2, 1, 1))], T(0x20, F32, (1, 1, 1, 1), op=OPS["SUM"], src=(0x10,)), "cuda")


# -- the second audit's rows (docs/cuda-audit.md): each node passes on a CPU node, is refused on CUDA,
# and a neighbour CUDA runs is still forwarded there

BF16, I64 = 30, 27
assert TYPES[BF16].name == "bf16" and TYPES[I64].name == "i64"


def _node(op, type_, ne, src, params=(), **kw):
    return T(0x20, type_, ne, op=OPS[op], src=src, op_params=params, **kw)


def _audit_case(name):
    """name -> (tensors, node refused on CUDA, tensors, node CUDA runs)."""
    if name == "xielu_bf16":  # unary.cu:550
        p = (17, f(0.8), f(0.8), f(0.5), f(1e-6))
        return ([T(0x10, BF16, (8, 2, 1, 1))], _node("UNARY", BF16, (8, 2, 1, 1), (0x10,), p),
                [T(0x10, F32, (8, 2, 1, 1))], _node("UNARY", F32, (8, 2, 1, 1), (0x10,), p))
    if name == "glu_nb0":  # unary.cu:300: ne0 == 1 hides nb0 from is_contiguous_1
        a, b = T(0x10, F32, (1, 2, 1, 1), nb=(8, 8, 16, 16)), T(0x11, F32, (1, 2, 1, 1))
        return ([a, b], _node("GLU", F32, (1, 2, 1, 1), (0x10, 0x11), (2, 0, 0, 0)),
                [T(0x10, F32, (1, 2, 1, 1)), b], _node("GLU", F32, (1, 2, 1, 1), (0x10, 0x11), (2, 0, 0, 0)))
    if name == "mul_mat_f16_src1":  # supports_op ggml-cuda.cu:5326-5328
        return ([T(0x10, F32, (64, 4, 1, 1)), T(0x11, F16, (64, 2, 1, 1))], _node("MUL_MAT", F32, (4, 2, 1, 1), (0x10, 0x11)),
                [T(0x10, F16, (64, 4, 1, 1)), T(0x11, F16, (64, 2, 1, 1))], _node("MUL_MAT", F32, (4, 2, 1, 1), (0x10, 0x11)))
    if name == "concat_blocks":  # concat.cu:213-214
        a, b = T(0x10, Q4_0, (64, 2, 2, 1), nb=(18, 36, 100, 200)), T(0x11, Q4_0, (64, 2, 2, 1))
        return ([a, b], _node("CONCAT", Q4_0, (64, 4, 2, 1), (0x10, 0x11), (1,)),
                [T(0x10, Q4_0, (64, 2, 2, 1)), b], _node("CONCAT", Q4_0, (64, 4, 2, 1), (0x10, 0x11), (1,)))
    if name == "argmax":  # argmax.cu:75
        return ([T(0x10, F32, (8, 3, 1, 1), nb=(4, 64, 192, 192))], _node("ARGMAX", I32, (3, 1, 1, 1), (0x10,)),
                [T(0x10, F32, (8, 3, 1, 1))], _node("ARGMAX", I32, (3, 1, 1, 1), (0x10,)))
    if name == "count_equal":  # count-equal.cu:36
        b = T(0x11, I32, (8, 3, 1, 1))
        return ([T(0x10, I32, (8, 3, 1, 1), nb=(4, 64, 192, 192)), b], _node("COUNT_EQUAL", I64, (1, 1, 1, 1), (0x10, 0x11)),
                [T(0x10, I32, (8, 3, 1, 1)), b], _node("COUNT_EQUAL", I64, (1, 1, 1, 1), (0x10, 0x11)))
    if name == "diag":  # diag.cu:45
        return ([T(0x10, F32, (8, 1, 3, 1), nb=(4, 64, 64, 192))], _node("DIAG", F32, (8, 8, 3, 1), (0x10,)),
                [T(0x10, F32, (8, 1, 3, 1))], _node("DIAG", F32, (8, 8, 3, 1), (0x10,)))
    if name in ("argsort", "top_k"):  # argsort.cu:274, top-k.cu:226
        op, ne, p = ("ARGSORT", (8, 3, 1, 1), (0,)) if name == "argsort" else ("TOP_K", (2, 3, 1, 1), ())
        return ([T(0x10, F32, (8, 3, 1, 1), nb=(4, 64, 192, 192))], _node(op, I32, ne, (0x10,), p),
                [T(0x10, F32, (8, 3, 1, 1))], _node(op, I32, ne, (0x10,), p))
    if name == "pool_2d_f16":  # pool2d.cu:71
        p = (0, 2, 2, 2, 2, 0, 0)
        return ([T(0x10, F16, (8, 8, 1, 1))], _node("POOL_2D", F32, (4, 4, 1, 1), (0x10,), p),
                [T(0x10, F32, (8, 8, 1, 1))], _node("POOL_2D", F32, (4, 4, 1, 1), (0x10,), p))
    if name == "pool_1d_strided":  # pool1d.cu:16 packed read
        p = (0, 2, 2, 0)
        return ([T(0x10, F32, (8, 2, 1, 1), nb=(4, 64, 1024, 1024))], _node("POOL_1D", F32, (4, 2, 1, 1), (0x10,), p),
                [T(0x10, F32, (8, 2, 1, 1))], _node("POOL_1D", F32, (4, 2, 1, 1), (0x10,), p))
    if name == "clamp_strided":  # clamp.cu:8-16 packed index over a view of its source
        p = (f(0.1), f(1.0))
        return ([T(0x10, F32, (8, 8, 1, 1), nb=(4, 64, 1024, 1024))], _node("CLAMP", F32, (8, 8, 1, 1), (0x10,), p),
                [T(0x10, F32, (8, 8, 1, 1))], _node("CLAMP", F32, (8, 8, 1, 1), (0x10,), p))
    if name == "conv_transpose_2d":  # conv2d-transpose.cu:98
        k = T(0x10, F32, (3, 3, 2, 4))
        return ([k, T(0x11, F32, (8, 8, 4, 1), nb=(4, 64, 1024, 4096))],
                _node("CONV_TRANSPOSE_2D", F32, (10, 10, 2, 1), (0x10, 0x11), (1,)),
                [k, T(0x11, F32, (8, 8, 4, 1))], _node("CONV_TRANSPOSE_2D", F32, (10, 10, 2, 1), (0x10, 0x11), (1,)))
    if name == "add1_q8_0":  # binbcast.cu:434
        b = T(0x11, F32, (1, 1, 1, 1))
        return ([T(0x10, Q8_0, (32, 2, 1, 1)), b], _node("ADD1", Q8_0, (32, 2, 1, 1), (0x10, 0x11)),
                [T(0x10, F32, (32, 2, 1, 1)), b], _node("ADD1", F32, (32, 2, 1, 1), (0x10, 0x11)))
    if name in ("wkv6", "gla"):  # wkv.cu:212, gla.cu:85
        def build(S):
            H, n_tok = 2, 4
            ins = [T(0x10 + i, F32, (S, H, n_tok, 1)) for i in range(3)]
            if name == "wkv6":
                ts = ins + [T(0x13, F32, (S, H, 1, 1)), T(0x14, F32, (S, H, n_tok, 1)), T(0x15, F32, (S * S * H, 1, 1, 1))]
                return ts, _node("RWKV_WKV6", F32, (S * H, n_tok + S, 1, 1), tuple(range(0x10, 0x16)))
            ts = ins + [T(0x13, F32, (S, H, n_tok, 1)), T(0x14, F32, (S * S * H, 1, 1, 1))]
            return ts, _node("GATED_LINEAR_ATTN", F32, (S * H, n_tok + S, 1, 1), tuple(range(0x10, 0x15)), (f(1.0),))
        return (*build(32), *build(64))
    raise AssertionError(name)


AUDIT_CASES = ("xielu_bf16", "glu_nb0", "mul_mat_f16_src1", "concat_blocks", "argmax", "count_equal", "diag",
               "argsort", "top_k", "pool_2d_f16", "pool_1d_strided", "clamp_strided", "conv_transpose_2d",
               "add1_q8_0", "wkv6", "gla")


@pytest.mark.parametrize("name", AUDIT_CASES)
def test_audit_rows_refuse_on_cuda_only(name):
    tensors, node, ok_tensors, ok_node = _audit_case(name)
    assert cuda_reason(tensors, node) == "backend_unsupported_op"  # and forwarded on cpu / auto
    run(ok_tensors, ok_node, "cuda")


def test_audit_grid_rows():
    # cumsum.cu:240 grid_dims(ne01, ne02, ne03)
    a = T(0x10, F32, (4, 1, 70000, 1))
    assert cuda_reason([a], _node("CUMSUM", F32, (4, 1, 70000, 1), (0x10,)), size=1 << 26) == "backend_grid_too_large"
    run([T(0x10, F32, (4, 70000, 1, 1))], _node("CUMSUM", F32, (4, 70000, 1, 1), (0x10,)), "cuda", state(size=1 << 26))
    # concat.cu:166 concat_non_cont grid (ne1, ne2, ne3); the packed copy has none
    b = T(0x11, F32, (1, 1, 70000, 1))
    strided = T(0x10, F32, (1, 1, 70000, 1), nb=(4, 8, 8, 8 * 70000))
    node = _node("CONCAT", F32, (2, 1, 70000, 1), (0x10, 0x11), (0,))
    assert cuda_reason([strided, b], node, size=1 << 26) == "backend_grid_too_large"
    run([T(0x10, F32, (1, 1, 70000, 1)), b], node, "cuda", state(size=1 << 26))


def test_rows_past_the_grid_x_limit_refused_for_any_op():
    # argmax.cu:84-90 and every one-block-per-row kernel: grid x <= 2^31-1; SUM_ROWS is not in
    # _INT32_ELEMENTS, so only this rule refuses it
    # (the wire's strides are 32-bit: 2^31 contiguous rows of one F32 lie along ne3)
    def rows(n):
        return [T(0x10, F32, (1, 1, 1, n))], _node("SUM_ROWS", F32, (1, 1, 1, n), (0x10,))

    assert cuda_reason(*rows(cuda.GRID_X_MAX + 1), size=1 << 34) == "backend_grid_too_large"
    run(*rows(cuda.GRID_X_MAX), "cuda", state(size=1 << 34))


def _ssm_scan(d_state, head_dim, n_head, A0, n_tok=2):
    ts = [T(0x10, F32, (d_state, head_dim, n_head, 1)), T(0x11, F32, (head_dim, n_head, n_tok, 1)),
          T(0x12, F32, (n_head, n_tok, 1, 1)), T(0x13, F32, (A0, n_head, 1, 1)),
          T(0x14, F32, (d_state, 1, n_tok, 1)), T(0x15, F32, (d_state, 1, n_tok, 1)), T(0x16, I32, (1, 1, 1, 1))]
    ne = head_dim * n_head * n_tok + d_state * head_dim * n_head
    return ts, _node("SSM_SCAN", F32, (ne, 1, 1, 1), tuple(range(0x10, 0x17)), (1,))


@pytest.mark.parametrize("args, ok", [
    ((64, 16, 2, 1), False),  # Mamba-2 d_state 64: ssm-scan.cu:286 GGML_ABORT
    ((128, 8, 2, 1), False),  # Mamba-2 head_dim 8: supports_op ggml-cuda.cu:5607-5610
    ((16, 1, 64, 16), False),  # Mamba-1 n_head 64: ssm-scan.cu:292 GGML_ASSERT(n_head % 128 == 0)
    ((128, 16, 2, 1), True), ((16, 1, 128, 16), True),
])
def test_ssm_scan_shapes_on_a_contained_cuda_server(args, ok):
    tensors, node = _ssm_scan(*args)

    def check(setting):
        v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=setting, contained=True))
        v.check(memoryview(graph_payload([node.id], tensors + [node])), state())

    check("cpu")
    if ok:
        check("cuda")
    else:
        with pytest.raises(FirewallRefusal) as exc:
            check("cuda")
        assert exc.value.reason == "backend_unsupported_op"


def _audit_case_2(name):
    """The audit's second batch: name -> (tensors, node refused on CUDA, tensors, node CUDA runs)."""
    if name == "set_strided_src1":  # set.cu:14
        a, p = T(0x10, F32, (8, 4, 1, 1)), (32, 128, 128, 0, 0)
        return ([a, T(0x11, F32, (4, 2, 1, 1), nb=(4, 32, 64, 64))], _node("SET", F32, (8, 4, 1, 1), (0x10, 0x11), p),
                [a, T(0x11, F32, (4, 2, 1, 1))], _node("SET", F32, (8, 4, 1, 1), (0x10, 0x11), p))
    if name == "conv_transpose_1d":  # conv-transpose-1d.cu:73
        k, p = T(0x10, F32, (3, 2, 4, 1)), (1, 0, 1)
        return ([k, T(0x11, F32, (8, 4, 1, 1), nb=(4, 64, 256, 256))],
                _node("CONV_TRANSPOSE_1D", F32, (10, 2, 1, 1), (0x10, 0x11), p),
                [k, T(0x11, F32, (8, 4, 1, 1))], _node("CONV_TRANSPOSE_1D", F32, (10, 2, 1, 1), (0x10, 0x11), p))
    if name == "ssm_conv_width":  # ssm-conv.cu:156
        def build(w):
            return ([T(0x10, F32, (w - 1 + 4, 128, 1, 1)), T(0x11, F32, (w, 128, 1, 1))],
                    _node("SSM_CONV", F32, (128, 4, 1, 1), (0x10, 0x11)))
        return (*build(6), *build(4))
    if name == "im2col_f16_input":  # im2col.cu:88
        a, p = T(0x10, F16, (3, 3, 2, 4)), (1, 1, 0, 0, 1, 1, 1)
        return ([a, T(0x11, F16, (8, 8, 2, 1))], _node("IM2COL", F16, (18, 6, 6, 1), (0x10, 0x11), p),
                [a, T(0x11, F32, (8, 8, 2, 1))], _node("IM2COL", F16, (18, 6, 6, 1), (0x10, 0x11), p))
    if name == "out_prod_strides":  # out-prod.cu:63
        a = T(0x10, F32, (8, 4, 1, 1))
        return ([a, T(0x11, F32, (6, 4, 1, 1), nb=(8, 48, 192, 192))], _node("OUT_PROD", F32, (8, 6, 1, 1), (0x10, 0x11)),
                [a, T(0x11, F32, (6, 4, 1, 1))], _node("OUT_PROD", F32, (8, 6, 1, 1), (0x10, 0x11)))
    if name == "out_prod_lda":  # cuBLAS lda = nb01/4 below the rows
        b = T(0x11, F32, (6, 4, 1, 1))
        return ([T(0x10, F32, (8, 4, 1, 1), nb=(4, 16, 64, 64)), b], _node("OUT_PROD", F32, (8, 6, 1, 1), (0x10, 0x11)),
                [T(0x10, F32, (8, 4, 1, 1)), b], _node("OUT_PROD", F32, (8, 6, 1, 1), (0x10, 0x11)))
    if name in ("gdn_head_size", "gdn_q_heads"):  # gated_delta_net.cu:218, :247
        def build(S, qh=2, H=2, n_tok=2):
            ts = [T(0x10, F32, (S, qh, n_tok, 1)), T(0x11, F32, (S, H, n_tok, 1)), T(0x12, F32, (S, H, n_tok, 1)),
                  T(0x13, F32, (1, H, n_tok, 1)), T(0x14, F32, (1, H, n_tok, 1)), T(0x15, F32, (S, S, H, 1))]
            return ts, _node("GATED_DELTA_NET", F32, (S * H, n_tok + S, 1, 1), tuple(range(0x10, 0x16)), (1,))
        return (*(build(8) if name == "gdn_head_size" else build(64, qh=1)), *build(64))
    if name == "lightning_indexer_heads":  # lightning-indexer.cu:749
        def build(nh):
            ts = [T(0x10, F32, (128, nh, 2, 1)), T(0x11, F32, (128, 1, 8, 1)), T(0x12, F32, (nh, 2, 1, 1)),
                  T(0x13, F16, (8, 2, 1, 1))]
            return ts, _node("LIGHTNING_INDEXER", F32, (8, 2, 1, 1), (0x10, 0x11, 0x12, 0x13))
        return (*build(8), *build(64))
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["set_strided_src1", "conv_transpose_1d", "ssm_conv_width", "im2col_f16_input",
                                  "out_prod_strides", "out_prod_lda", "gdn_head_size", "gdn_q_heads",
                                  "lightning_indexer_heads"])
def test_audit_rows_second_batch(name):
    tensors, node, ok_tensors, ok_node = _audit_case_2(name)
    assert cuda_reason(tensors, node) == "backend_unsupported_op"
    run(ok_tensors, ok_node, "cuda")


def test_binbcast_32_bit_sizes():
    # binbcast.cu:259-299: packed operands collapse into one dimension of every element; past 2^32
    # of them the kernel's uint32 sizes and strides abort (a 32 GiB f32 ADD; an 8 GiB one runs)
    g = 1 << 33
    ne = (65536, 8192, 1, 16)
    tensors = [T(0x10, F32, ne, data=BASE), T(0x11, F32, ne, data=BASE + 4 * g)]
    node = _node("ADD", F32, ne, (0x10, 0x11), data=BASE + 8 * g)
    assert cuda_reason(tensors, node, size=12 * g + 4096) == "backend_index_overflow"
    ne = (65536, 8192, 1, 4)
    tensors = [T(0x10, F32, ne, data=BASE), T(0x11, F32, ne, data=BASE + g)]
    run(tensors, _node("ADD", F32, ne, (0x10, 0x11), data=BASE + 2 * g), "cuda", state(size=3 * g + 4096))


def test_get_rows_back_sources_contiguous():
    # getrows.cu:477 GGML_ASSERT(ggml_is_contiguous(src0)): the CPU kernel reads rows by nb01
    b = T(0x11, I32, (4, 1, 1, 1))
    strided = T(0x10, F32, (8, 4, 1, 1), nb=(4, 64, 256, 256))
    assert cuda_reason([strided, b], _node("GET_ROWS_BACK", F32, (8, 6, 1, 1), (0x10, 0x11))) == "backend_unsupported_op"
    run([T(0x10, F32, (8, 4, 1, 1)), b], _node("GET_ROWS_BACK", F32, (8, 6, 1, 1), (0x10, 0x11)), "cuda")


def test_get_rows_index_rows_past_2_32():
    # getrows.cu:184 GGML_ASSERT(ne11 <= UINT32_MAX / ne12); the row reads it directly
    a = decode_tensor(pack_tensor(T(0x10, F32, (8, 4, 1, 1))))
    idx = decode_tensor(pack_tensor(T(0x11, I32, (1, 1 << 17, 1 << 16, 1), nb=(4, 4, 1 << 19, 1 << 19))))
    n = decode_tensor(pack_tensor(T(0x20, F32, (8, 1, 1, 1), op=OPS["GET_ROWS"], src=(0x10, 0x11))))
    with pytest.raises(FirewallRefusal) as exc:
        cuda.check_node("GET_ROWS", n, [a, idx])
    assert exc.value.reason == "backend_index_overflow"
    cuda.check_node("GET_ROWS", n, [a, idx._replace(ne1=1 << 14)])  # (2^31 index rows: the generic grid-x rule)


# -- the third audit (docs/cuda-audit.md, "Matrix and attention paths"): MUL_MAT / MUL_MAT_ID past
# the kernel choice, FLASH_ATTN_EXT's mask scan

Q4_1, Q8_1, Q8_K, IQ4_NL, IQ1_M = 3, 9, 15, 20, 29
assert [TYPES[t].name for t in (Q4_1, Q8_1, Q8_K, IQ4_NL, IQ1_M)] == ["q4_1", "q8_1", "q8_K", "iq4_nl", "iq1_m"]


def _mm(a_type, b_type=F32, k=256, m=8, n=3, a_nb=None, b_nb=None, params=()):
    a = T(0x10, a_type, (k, m, 1, 1), **({"nb": a_nb} if a_nb else {}))
    b = T(0x11, b_type, (k, n, 1, 1), **({"nb": b_nb} if b_nb else {}))
    return [a, b], _node("MUL_MAT", F32, (m, n, 1, 1), (0x10, 0x11), params)


def _mm_id(a_type=Q4_0, tok=3, b_nb=None, params=(), k=256, used=2, b_ne1=None):
    ne11 = used if b_ne1 is None else b_ne1
    ts = [T(0x10, a_type, (k, 16, 8, 1)), T(0x11, F32, (k, ne11, tok, 1), **({"nb": b_nb} if b_nb else {})),
          T(0x12, I32, (used, tok, 1, 1))]
    return ts, _node("MUL_MAT_ID", F32, (16, used, tok, 1), (0x10, 0x11, 0x12), params)


def _contained(tensors, node, setting, size=SIZE):
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=setting, contained=True))
    v.check(memoryview(graph_payload([node.id], tensors + [node])), state(size=size))


def _contained_reason(tensors, node, size=SIZE) -> str:
    _contained(tensors, node, "cpu", size)
    _contained(tensors, node, "auto", size)
    with pytest.raises(FirewallRefusal) as exc:
        _contained(tensors, node, "cuda", size)
    return exc.value.reason


def test_mul_mat_cublas_converters():
    # ggml-cuda.cu:1890-1894: a src1 that is not F32 takes cuBLAS; :1478 GGML_ASSERT(convert_func):
    # convert.cu has no Q8_K / Q8_1 converter (the CPU's vec_dot types of the K-quants / Q4_1)
    assert cuda_reason(*_mm(Q4_K, Q8_K)) == "backend_unsupported_op"
    assert cuda_reason(*_mm(Q4_1, Q8_1)) == "backend_unsupported_op"
    run(*_mm(Q4_K, F32), "cuda")  # the llama.cpp case: F32 activations (MMVQ / MMQ)
    run(*_mm(Q4_0, Q8_0), "cuda")  # cuBLAS converts Q8_0
    # :1453 a strided src0 is converted by ggml_get_to_fp16_nc_cuda: none for IQ4_NL (convert.cu:670-693)
    row = 256 // 32 * 18
    assert cuda_reason(*_mm(IQ4_NL, Q8_0, a_nb=(18, 2 * row, 16 * row, 16 * row))) == "backend_unsupported_op"
    run(*_mm(IQ4_NL, Q8_0), "cuda")  # contiguous: ggml_get_to_fp16_cuda has it
    run(*_mm(Q4_0, Q8_0, a_nb=(18, 2 * row, 16 * row, 16 * row)), "cuda")  # Q4_0 has a strided converter
    # IQ1_M: no MMQ (mmq.cu:415-443), MMVQ up to 8 columns: 9 columns take cuBLAS
    row = 256 // 256 * 56
    strided = (56, 2 * row, 16 * row, 16 * row)
    assert cuda_reason(*_mm(IQ1_M, F32, n=9, a_nb=strided)) == "backend_unsupported_op"
    run(*_mm(IQ1_M, F32, n=8, a_nb=strided), "cuda")  # MMVQ
    run(*_mm(IQ1_M, F32, n=9), "cuda")  # contiguous


def test_mmq_src1_precision():
    # mmq.cu:127 GGML_ASSERT(prec == UNDEFINED || Q8 || Q4) on op_params[3]
    for prec in (10, 15, 20):
        assert cuda_reason(*_mm(Q4_0, params=(0, 0, 0, prec))) == "backend_unsupported_op"
    for prec in (0, 30, 40):
        run(*_mm(Q4_0, params=(0, 0, 0, prec)), "cuda")
    run(*_mm(F16, params=(0, 0, 0, 10)), "cuda")  # no MMQ for F16: the value is not read
    run(*_mm(Q4_0, params=(10, 0, 0, 0)), "cuda")  # op_params[0] (ggml_prec_set_acc): cuBLAS reads it
    assert _contained_reason(*_mm_id(params=(0, 0, 0, 15))) == "backend_unsupported_op"
    _contained(*_mm_id(params=(0, 0, 0, 30)), "cuda")


def test_mmvf_mmf_src1_column_stride():
    # mmvf.cu:429 GGML_ASSERT(stride_col_y % 2 == 0): an F32 src1 whose row stride is 65 floats
    assert cuda_reason(*_mm(F32, k=64, b_nb=(4, 260, 780, 780))) == "backend_unsupported_op"
    run(*_mm(F32, k=64, b_nb=(4, 264, 792, 792)), "cuda")
    run(*_mm(F32, k=64, n=32, b_nb=(4, 260, 260 * 32, 260 * 32)), "cuda")  # 32 columns: cuBLAS
    # mmf.cuh:655 after mmf.cu:112 halves it for F16: a stride of 6 floats is 3 half2 pairs
    a_ne, b_nb = 64, (4, 4 * 66, 4 * 66 * 10, 4 * 66 * 10)
    assert cuda_reason(*_mm(F16, k=a_ne, m=32, n=10, b_nb=b_nb)) == "backend_unsupported_op"
    run(*_mm(F16, k=a_ne, m=32, n=10, b_nb=(4, 4 * 68, 4 * 68 * 10, 4 * 68 * 10)), "cuda")


def test_mul_mat_id_src1_token_stride():
    # mmq.cu:232 / ggml-cuda.cu:2010 GGML_ASSERT(nb12 % nb11 == 0); mmq.cu:250 nb12 / nb11
    assert _contained_reason(*_mm_id(b_nb=(4, 1024, 2560, 7680))) == "backend_unsupported_op"
    assert _contained_reason(*_mm_id(b_ne1=1, b_nb=(4, 0, 1024, 3072))) == "backend_unsupported_op"
    assert _contained_reason(*_mm_id(b_nb=(4, 4096, 1024, 3072))) == "backend_unsupported_op"
    _contained(*_mm_id(), "cuda")  # packed src1 (the down projection)
    _contained(*_mm_id(b_ne1=1), "cuda")  # one row broadcast to the experts (gate/up)
    _contained(*_mm_id(tok=512), "cuda", size=1 << 26)  # a 512-token batch, 8 experts


def test_matrix_int32_offsets():
    # mmvq.cu:719 / mmq.cuh:1061 int kbx_offset: 17 Q4_0 experts 2^27 blocks apart put the last at
    # block 2^31 (a 36 GiB buffer; nb is 32-bit on the wire, so the offset builds up over ne2)
    step = 18 << 27
    buf = 17 * step + (1 << 20)

    def case(experts):
        a = T(0x10, Q4_0, (256, 16, experts, 1), nb=(18, 144, step, step), data=BASE)
        b = T(0x11, F32, (256, 2, 3, 1), data=BASE + 17 * step)
        ids = T(0x12, I32, (2, 3, 1, 1), data=BASE + 17 * step + 8192)
        return [a, b, ids], _node("MUL_MAT_ID", F32, (16, 2, 3, 1), (0x10, 0x11, 0x12), data=BASE + 17 * step + 16384)

    assert _contained_reason(*case(17), size=buf) == "backend_index_overflow"
    _contained(*case(16), "cuda", size=buf)  # the last expert at block 15 * 2^27


def _fa(q3=1, m3=1, n_q=4, n_kv=256, m_rows=None, mask_data=None):
    d = 128
    ts = [T(0x10, F32, (d, n_q, 8, q3)), T(0x11, F16, (d, n_kv, 8, q3)), T(0x12, F16, (d, n_kv, 8, q3)),
          T(0x13, F16, (n_kv, m_rows or n_q, 1, m3), **({"data": mask_data} if mask_data else {}))]
    return ts, _node("FLASH_ATTN_EXT", F32, (d, 8, n_q, q3), (0x10, 0x11, 0x12, 0x13), (f(0.125), 0, 0, 0))


def test_flash_attn_mask_scan():
    # fattn-common.cuh:681 mask += sequence*s33 (grid y = Q.ne3, :1122): no % ne33 in the scan
    assert cuda_reason(*_fa(q3=2, m3=1)) == "backend_unsupported_op"
    run(*_fa(q3=2, m3=2), "cuda")  # one mask per sequence (llama.cpp's n_stream masks)
    run(*_fa(q3=2, m3=1, n_kv=200), "cuda")  # K.ne1 % 256: no scan, the kernels broadcast (% ne33)
    # the scan reads the rows of the last 64-query tile (fattn-common.cuh:695): 1030 queries read
    # 1088 mask rows, which must lie in the mask's buffer
    n_kv, n_q = 256, 1030
    end = BASE + SIZE - n_kv * 2 * n_q
    assert cuda_reason(*_fa(n_q=n_q, mask_data=end - end % 128)) == "backend_reach_out_of_buffer"
    room = BASE + SIZE - n_kv * 2 * 1088
    run(*_fa(n_q=n_q, mask_data=room - room % 128), "cuda")
    run(*_fa(n_q=1024, mask_data=BASE + SIZE - n_kv * 2 * 1024), "cuda")  # a whole number of tiles


def test_flash_attn_grid_z():
    # fattn-common.cuh:1219 blocks_num.z = ntiles_z_gqa*K.ne2*Q.ne3: the decode kernel (VEC, ncols2 1)
    # launches Q heads x sequences on grid z
    def case(seqs):
        d, n_kv, heads = 64, 256, 128
        ts = [T(0x10, F32, (d, 1, heads, seqs), data=BASE), T(0x11, F16, (d, n_kv, 1, seqs), data=BASE + (1 << 26)),
              T(0x12, F16, (d, n_kv, 1, seqs), data=BASE + (1 << 26)), T(0x13, F16, (n_kv, 1, 1, seqs), data=BASE + (3 << 26))]
        return ts, _node("FLASH_ATTN_EXT", F32, (d, heads, 1, seqs), (0x10, 0x11, 0x12, 0x13), (f(0.125), 0, 0, 0),
                         data=BASE + (4 << 26))

    assert cuda_reason(*case(513), size=5 << 26) == "backend_grid_too_large"
    run(*case(511), "cuda", state(size=5 << 26))  # 65408 blocks on z: under the 65535 limit


def test_matrix_grid_yz():
    # quantize.cu:583 num_blocks(ne11, .., ne12*ne13): 70000 one-row batches of a broadcast Q4_0 matrix
    def case(batches, b_rows=3):
        a = T(0x10, Q4_0, (256, 8, 1, 1), data=BASE)
        b = T(0x11, F32, (256, b_rows, batches, 1), data=BASE + (1 << 20))
        return [a, b], _node("MUL_MAT", F32, (8, b_rows, batches, 1), (0x10, 0x11), data=BASE + (1 << 29))

    big = 1 << 30
    assert cuda_reason(*case(70000), size=big) == "backend_grid_too_large"
    run(*case(65535), "cuda", state(size=big))
    # F32 matrices with 32 columns take cuBLAS (batched pointers, grid y ne12/16): forwarded
    a = T(0x10, F32, (64, 8, 1, 1), data=BASE)
    b = T(0x11, F32, (64, 32, 70000, 1), data=BASE + (1 << 20))
    run([a, b], _node("MUL_MAT", F32, (8, 32, 70000, 1), (0x10, 0x11), data=BASE + (1 << 29)), "cuda", state(size=big))


def test_mul_mat_id_experts_on_a_grid_axis():
    # mmq.cuh:1422-1423 (grid z = experts, mmq.cu:311), mmf.cuh:610 (grid y = experts)
    def case(experts):
        ts = [T(0x10, Q4_0, (32, 8, experts, 1), data=BASE), T(0x11, F32, (32, 2, 3, 1), data=BASE + (1 << 24)),
              T(0x12, I32, (2, 3, 1, 1), data=BASE + (1 << 24) + 4096)]
        return ts, _node("MUL_MAT_ID", F32, (8, 2, 3, 1), (0x10, 0x11, 0x12), data=BASE + (1 << 24) + 8192)

    assert _contained_reason(*case(70000), size=1 << 25) == "backend_grid_too_large"
    _contained(*case(256), "cuda", size=1 << 25)  # 256 experts (DeepSeek-V3)


def test_flash_attn_int32_strides():
    # fattn-common.cuh:39 const int32_t nb11, nb12: K heads 2^31 bytes apart (a view over a 4 GiB buffer)
    def case(k_nb2, heads=2):
        d, n_kv = 128, 256
        ts = [T(0x10, F32, (d, 4, heads, 1), data=BASE), T(0x11, F16, (d, n_kv, heads, 1), nb=(2, 256, k_nb2, k_nb2),
                                                            data=BASE + (1 << 20)),
              T(0x12, F16, (d, n_kv, heads, 1), data=BASE + (1 << 20)), T(0x13, F16, (n_kv, 4, 1, 1), data=BASE + (1 << 19))]
        return ts, _node("FLASH_ATTN_EXT", F32, (d, heads, 4, 1), (0x10, 0x11, 0x12, 0x13), (f(0.125), 0, 0, 0),
                         data=BASE + (1 << 18))

    size = (1 << 20) + (1 << 32)
    assert cuda_reason(*case(1 << 31), size=size) == "backend_index_overflow"
    run(*case((1 << 31) - 256), "cuda", state(size=size))
    run(*case(1 << 31, heads=1), "cuda", state(size=size))  # one head: nb2 is multiplied by zero


def test_block_types_aligned_for_their_loads():
    # vecdotq.cuh:18-29 get_int_b2 (2-byte loads, "assume at least 2 byte alignment") / get_int_b4;
    # half d / half2 dm fields: a Q4_0 weight at an odd address, a Q4_K one at 2 mod 4, faults
    def case(t, off=0, nb=None):
        k = 256
        a = T(0x10, t, (k, 8, 1, 1), **({"nb": nb} if nb else {}))
        a.data += off
        return [a, T(0x11, F32, (k, 3, 1, 1))], _node("MUL_MAT", F32, (8, 3, 1, 1), (0x10, 0x11))

    assert cuda_reason(*case(Q4_0, 1)) == "backend_misaligned"
    assert cuda_reason(*case(Q4_0, nb=(18, 145, 1160, 1160))) == "backend_misaligned"
    assert cuda_reason(*case(Q4_K, 2)) == "backend_misaligned"
    run(*case(Q4_0, 18), "cuda")  # a whole block in: the K-cache views of llama.cpp
    run(*case(Q4_K, 144), "cuda")
    mxfp4 = 39
    assert TYPES[mxfp4].name == "mxfp4"
    run(*case(mxfp4, 17), "cuda")  # 17-byte blocks: byte loads, no alignment past 1
