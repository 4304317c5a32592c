#!/usr/bin/env python3
"""A REAL llama.cpp client that keeps its RPC session open between generations.

Run with the real-peer Python (``realpeer.realpeer_python()``), like rpc_client_smoke.py:

    longclient.py HOST:PORT -m MODEL -n N --wait FILE1 [--wait FILE2 ...]

It registers the RPC server as llama.cpp's ``--rpc`` does, loads the model with every layer
offloaded, generates N greedy tokens and prints ``ROUND 0 token ids: [...]``. Then, for each
``--wait FILE``, it prints ``WAITING i``, sleeps until FILE exists (the test's signal, e.g.
"certificates rotated"), resets the context and generates again over the SAME connection
(the model's buffers keep llama.cpp's socket open), printing ``ROUND i token ids: [...]``.
Exit 0 with ``LONGCLIENT_OK`` at the end. A dropped session makes libggml-rpc abort().
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def say(text: str) -> None:
    print(text, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--n-tokens", type=int, default=8)
    ap.add_argument("-p", "--prompt", default="hello world")
    ap.add_argument("--wait", action="append", default=[], help="file to wait for before the next round")
    ap.add_argument("--wait-timeout", type=float, default=50.0)
    a = ap.parse_args()
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")

    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    new_api = hasattr(lib, "ggml_backend_rpc_add_server")
    add = lib.ggml_backend_rpc_add_server if new_api else lib.ggml_backend_rpc_add_device
    add.restype = ctypes.c_void_p
    add.argtypes = [ctypes.c_char_p]
    register = lib.ggml_backend_register if new_api else lib.ggml_backend_device_register
    register.argtypes = [ctypes.c_void_p]
    reg = add(a.endpoint.encode())
    if not reg:
        sys.exit(f"error: RPC server {a.endpoint} reported 0 devices")
    register(reg)

    llm = llama_cpp.Llama(model_path=a.model, n_gpu_layers=99, n_ctx=256, n_threads=1, verbose=False)
    say("LOADED")
    prompt = llm.tokenize(a.prompt.encode())

    def generate(round_no: int) -> None:
        llm.reset()  # evaluate the prompt again: every round does real RPC work
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1):
            out.append(tok)
            if len(out) >= a.n_tokens:
                break
        say(f"ROUND {round_no} token ids: {out}")

    generate(0)
    for i, path in enumerate(a.wait, 1):
        say(f"WAITING {i}")
        deadline = time.monotonic() + a.wait_timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                sys.exit(f"error: {path} did not appear within {a.wait_timeout:g} s")
            time.sleep(0.05)
        generate(i)
    del llm
    say("LONGCLIENT_OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
