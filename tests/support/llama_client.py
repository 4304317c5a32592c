#!/usr/bin/env python3
"""Real llama.cpp client for the multi-architecture tests: one or more RPC servers, context knobs.

Run with the real peer's Python (``REALPEER_PYTHON``), never imported by the tests: it imports
``llama_cpp`` (llama-cpp-python built with RPC). ``tests/support/llamarun.py`` runs it and parses
its output.

How this works: like ``tests/realpeer/rpc_client_smoke.py`` (and llama.cpp's ``--rpc``), every
endpoint is registered with ``ggml_backend_rpc_add_server`` + ``ggml_backend_register`` through
libllama's own handle before ``Llama(...)`` is built, so each endpoint becomes a device
``RPC<i>``; llama.cpp then divides the offloaded layers between those devices (by their reported
free memory, or ``--tensor-split``). On top of that script it sets what changes the graphs the
client sends: flash attention, the KV cache types (``type_k``/``type_v``), the number of
offloaded layers (the rest runs on the client's CPU), and embedding mode (pooling). It prints

    token ids: [...]        greedy generation (``--n-tokens`` tokens), or
    embedding: [...]        with ``--embed``: the pooled embedding of the prompt, every float
                            printed with repr (exact: the server computes the same graph the same
                            way whether or not rpcguard is in between)
    LLAMA_CLIENT_OK

A refused or dropped RPC connection makes libggml-rpc abort the process (SIGABRT).
"""
import argparse
import ctypes
import os
import sys
import time

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}  # enum ggml_type (ggml.h)


def register(lib, endpoint: str) -> None:
    add = lib.ggml_backend_rpc_add_server
    add.restype = ctypes.c_void_p
    add.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    reg = add(endpoint.encode())  # HELLO + DEVICE_COUNT on a short connection
    if not reg:
        sys.exit(f"error: RPC server {endpoint} reported 0 devices")
    lib.ggml_backend_register(reg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("endpoints", nargs="+", help="HOST:PORT of each ggml RPC server (or of a tunnel to it)")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--n-tokens", type=int, default=16)
    ap.add_argument("-p", "--prompt", default="hello world")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--n-batch", type=int, default=512, help="n_batch and n_ubatch (prompt graph size)")
    ap.add_argument("--n-gpu-layers", type=int, default=99, help="layers offloaded to the RPC devices")
    ap.add_argument("--flash-attn", action="store_true")
    ap.add_argument("--type-k", choices=sorted(KV_TYPES), default="f16")
    ap.add_argument("--type-v", choices=sorted(KV_TYPES), default="f16")
    ap.add_argument("--tensor-split", help="comma-separated proportions per device, e.g. 1,3")
    ap.add_argument("--embed", action="store_true", help="embedding mode: print the pooled embedding")
    ap.add_argument("--pooling", type=int, default=-1, help="llama_pooling_type (-1: the model's)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

    import llama_cpp

    lib = llama_cpp.llama_cpp._lib  # libllama's own handle: the registry libllama uses
    for ep in a.endpoints:
        register(lib, ep)
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    print(f"devices: {lib.ggml_backend_dev_count()}")

    kw = dict(model_path=a.model, n_gpu_layers=a.n_gpu_layers, n_ctx=a.n_ctx, n_threads=1,
              n_batch=a.n_batch, n_ubatch=a.n_batch,
              verbose=a.verbose, flash_attn=a.flash_attn,
              type_k=KV_TYPES[a.type_k], type_v=KV_TYPES[a.type_v])
    if a.tensor_split:
        kw["tensor_split"] = [float(x) for x in a.tensor_split.split(",")]
    if a.embed:
        kw.update(embedding=True, pooling_type=a.pooling)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(**kw)
    print(f"load: {time.perf_counter() - t0:.3f} s")

    prompt = llm.tokenize(a.prompt.encode())
    print(f"prompt: {len(prompt)} tokens")
    t0 = time.perf_counter()
    if a.embed:
        vec = llm.embed(a.prompt)
        if vec and isinstance(vec[0], list):  # pooling NONE: one vector per token; keep the last
            vec = vec[-1]
        print(f"embedding: [{', '.join(repr(float(x)) for x in vec)}]")
    else:
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1):  # greedy; never stops on EOS by itself
            out.append(tok)
            if len(out) >= a.n_tokens:
                break
        print(f"token ids: {out}")
    print(f"run: {time.perf_counter() - t0:.3f} s")
    print("LLAMA_CLIENT_OK")


if __name__ == "__main__":
    main()
