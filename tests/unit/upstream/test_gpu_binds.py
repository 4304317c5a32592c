"""rpcguard/upstream/gpu.py against a fake /dev and /proc: only the GPUs -d selects are bound,
with the driver's control nodes; a missing node is one line naming it."""

from __future__ import annotations

import pytest

from rpcguard.upstream.gpu import GpuUnavailable, gpu_binds, selected_devices, uses_gpu

# PCI bus ids in sorted order and the minor the driver gave each (not the same order)
GPUS = {"0000:1b:00.0": 2, "0000:3b:00.0": 0, "0000:86:00.0": 3, "0000:af:00.0": 1}


def fake_host(tmp_path, *, control=("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")):
    dev, proc = tmp_path / "dev", tmp_path / "proc"
    dev.mkdir()
    for minor in GPUS.values():
        (dev / f"nvidia{minor}").touch()
    for name in control:
        (dev / name).touch()
    (dev / "dri").mkdir()
    (dev / "kfd").touch()
    for bus, minor in GPUS.items():
        d = proc / "driver/nvidia/gpus" / bus
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nDevice Minor: \t {minor}\n")
    return str(dev), str(proc)


def binds(args):
    return [args[i + 1] for i in range(len(args)) if args[i] == "--dev-bind"]


def test_selected_devices_from_the_command_line():
    assert selected_devices(["ggml-rpc-server"]) is None
    assert selected_devices(["s", "-d", "CUDA1,CUDA3"]) == (1, 3)
    assert selected_devices(["s", "--device=CPU"]) == ()


def test_only_the_selected_gpu_and_the_control_nodes(tmp_path):
    dev, proc = fake_host(tmp_path)
    b = gpu_binds(["s", "-d", "CUDA1"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    # CUDA1 in PCI bus order is 0000:3b:00.0, minor 0
    assert binds(b.args) == [f"{dev}/nvidia0", f"{dev}/nvidiactl", f"{dev}/nvidia-uvm", f"{dev}/nvidia-uvm-tools",
                             f"{dev}/nvidia-modeset"]
    assert not any("dri" in a or "kfd" in a for a in b.args)
    assert b.args[-3:] == ("--setenv", "CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    two = gpu_binds(["s", "-d", "CUDA0,CUDA2"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    assert binds(two.args)[:2] == [f"{dev}/nvidia2", f"{dev}/nvidia3"]


def test_no_device_flag_binds_every_gpu_and_cpu_only_binds_none(tmp_path):
    dev, proc = fake_host(tmp_path)
    every = gpu_binds(["s"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    assert [p for p in binds(every.args) if p[len(dev) + 7:].isdigit()] == [f"{dev}/nvidia{m}" for m in range(4)]
    assert gpu_binds(["s", "-d", "CPU"], dev_root=dev, proc_root=proc, env={}).args == ()
    assert uses_gpu(["s"], dev) and uses_gpu(["s", "-d", "CUDA0"], dev) and not uses_gpu(["s", "-d", "CPU"], dev)


def test_without_device_flag_the_control_nodes_are_optional(tmp_path):
    # a CPU build of the server on a GPU host, no -d: nothing required (nvidia-uvm appears only
    # once something used CUDA as root)
    dev, proc = fake_host(tmp_path, control=("nvidiactl",))
    b = gpu_binds(["s"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    assert f"{dev}/nvidiactl" in binds(b.args) and f"{dev}/nvidia-uvm" not in binds(b.args)


@pytest.mark.parametrize("missing, words", [
    ("nvidia-uvm", "nvidia-uvm missing"), ("nvidiactl", "nvidiactl missing"),
])
def test_a_missing_control_node_is_one_line(tmp_path, missing, words):
    dev, proc = fake_host(tmp_path, control=tuple(c for c in ("nvidiactl", "nvidia-uvm") if c != missing))
    with pytest.raises(GpuUnavailable) as exc:
        gpu_binds(["s", "-d", "CUDA0"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_a_device_past_the_host_and_a_missing_node(tmp_path):
    dev, proc = fake_host(tmp_path)
    with pytest.raises(GpuUnavailable, match="CUDA7: the host has 4"):
        gpu_binds(["s", "-d", "CUDA7"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())
    (tmp_path / "dev" / "nvidia3").unlink()
    with pytest.raises(GpuUnavailable, match="nvidia3 missing"):
        gpu_binds(["s", "-d", "CUDA2"], dev_root=dev, proc_root=proc, env={}, lib_dirs=())


def test_driver_libraries_outside_the_system_dirs_read_only(tmp_path):
    dev, proc = fake_host(tmp_path)
    libs = tmp_path / "opt-nvidia" / "lib64"
    libs.mkdir(parents=True)
    (libs / "libcuda.so.1").touch()
    b = gpu_binds(["s", "-d", "CUDA0"], dev_root=dev, proc_root=proc, env={"LD_LIBRARY_PATH": f"/usr/lib:{libs}"},
                  lib_dirs=())
    assert b.libraries == (str(libs),)
    i = b.args.index("--ro-bind")
    assert b.args[i:i + 3] == ("--ro-bind", str(libs), str(libs))
    assert ("--setenv", "LD_LIBRARY_PATH", str(libs)) == b.args[-3:]
