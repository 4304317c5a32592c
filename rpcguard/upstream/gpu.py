"""What a sandboxed ggml-rpc-server needs of an NVIDIA GPU, and nothing more (issue 29 part 4).

How this works: ``gpu_binds(argv)`` reads the devices the server's ``-d``/``--device`` selects
(``CUDA0,CUDA2``; none: every GPU) and returns the bubblewrap arguments that make exactly those
reachable inside the sandbox: ``/dev/nvidia<minor>`` of each selected GPU and the driver's control
nodes read-write (``nvidiactl`` and ``nvidia-uvm`` are required when -d names a GPU: the CUDA runtime opens both
at its first call; ``nvidia-uvm-tools``, ``nvidia-modeset`` and the MIG capability directory
``nvidia-caps`` when present), and the driver's user-space libraries read-only where they live
outside the directories the sandbox already binds read-only (``/usr``, ``/lib*``, ``/etc/ld.so.*``:
an image that mounts the driver at ``/usr/local/nvidia`` is covered; one under ``/opt`` or found
through ``LD_LIBRARY_PATH`` gets its directory bound and the variable set). Other GPUs' nodes,
``/dev/dri`` and ``/dev/kfd`` stay out.

CUDA numbers devices fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; the server gets that
variable, so ``CUDA<N>`` is the N-th GPU by PCI bus id, whose minor number (hence its
``/dev/nvidia<minor>``) the driver lists in ``/proc/driver/nvidia/gpus/<bus id>/information``.
A missing mechanism is ``GpuUnavailable``, one line naming what is missing (the sandbox's caller
turns it into a start failure). Sandbox.py's caller uses these arguments in place of its
``--dev-bind-try /dev/nvidia*`` (helper G2's file; this module has no state and no I/O beyond
reading ``/dev``, ``/proc`` and the library directories).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["GpuUnavailable", "GpuBinds", "selected_devices", "uses_gpu", "gpu_binds", "REQUIRED_CONTROL",
           "OPTIONAL_CONTROL"]

#: opened by the CUDA runtime at its first call (cuInit): without them no context starts
REQUIRED_CONTROL = ("nvidiactl", "nvidia-uvm")
#: opened when present (profiling counters, the display driver's modeset node, MIG capabilities)
OPTIONAL_CONTROL = ("nvidia-uvm-tools", "nvidia-modeset", "nvidia-caps")
#: directories bubblewrap's sandbox already binds read-only (sandbox._SYSTEM_DIRS)
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc")
_DRIVER_LIBS = ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1")
_DEVICE_ARG = re.compile(r"^CUDA(\d+)$")


class GpuUnavailable(RuntimeError):
    """A mechanism the GPU server needs is missing (one line, names it)."""


@dataclass(frozen=True)
class GpuBinds:
    """Bubblewrap arguments (``--dev-bind``, ``--ro-bind``, ``--setenv``) and what they expose."""

    args: tuple[str, ...]
    devices: tuple[str, ...]  # the /dev paths bound read-write
    libraries: tuple[str, ...]  # directories bound read-only (outside SYSTEM_DIRS)


def selected_devices(argv: Sequence[str]) -> tuple[int, ...] | None:
    """CUDA device indexes the server's ``-d``/``--device`` names; None when it names none (the
    server then opens every device it finds). Non-CUDA names (CPU, RPC...) select no GPU."""
    value = None
    for i, arg in enumerate(argv):
        if arg in ("-d", "--device") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--device="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    out = []
    for name in value.split(","):
        m = _DEVICE_ARG.match(name.strip())
        if m:
            out.append(int(m.group(1)))
    return tuple(out)


def _minors(proc_root: str) -> list[int]:
    """GPU minor numbers in PCI bus id order (CUDA_DEVICE_ORDER=PCI_BUS_ID numbering)."""
    out = []
    for info in sorted(glob.glob(os.path.join(proc_root, "driver/nvidia/gpus/*/information"))):
        try:
            text = open(info, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        m = re.search(r"^Device Minor:\s*(\d+)", text, re.M)
        if m:
            out.append(int(m.group(1)))
    return out


def uses_gpu(argv: Sequence[str], dev_root: str = "/dev") -> bool:
    """Whether the server may open an NVIDIA GPU: its -d names one, or it names none and the
    host has GPU nodes (a GPU listener: one process per session by default, the watchdog on)."""
    sel = selected_devices(argv)
    if sel is not None:
        return bool(sel)
    return bool(glob.glob(os.path.join(dev_root, "nvidia[0-9]*")))


def _library_dirs(env: Mapping[str, str], extra_dirs: Sequence[str]) -> list[str]:
    """Directories holding the driver's libraries outside SYSTEM_DIRS."""
    candidates = [*extra_dirs, *(p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p)]
    out = []
    for d in candidates:
        real = os.path.realpath(d)
        if any(real == s or real.startswith(s + "/") for s in SYSTEM_DIRS):
            continue
        if any(os.path.exists(os.path.join(real, lib)) for lib in _DRIVER_LIBS) and real not in out:
            out.append(real)
    return out


def gpu_binds(argv: Sequence[str], *, dev_root: str = "/dev", proc_root: str = "/proc",
              env: Mapping[str, str] | None = None, lib_dirs: Sequence[str] = ("/opt/nvidia/lib64",)) -> GpuBinds:
    """The bubblewrap arguments for the GPUs ``argv``'s -d selects (see the module docstring);
    raises GpuUnavailable naming the first missing node or mapping."""
    env = os.environ if env is None else env
    sel = selected_devices(argv)
    if sel == ():
        return GpuBinds((), (), ())  # -d names no GPU: no GPU node at all
    minors = _minors(proc_root)
    if sel is None:
        nodes = sorted(p for p in glob.glob(os.path.join(dev_root, "nvidia[0-9]*")) if p[len(dev_root) + 7:].isdigit())
        if not nodes:
            return GpuBinds((), (), ())
    else:
        if not minors:
            raise GpuUnavailable(f"-d {','.join(f'CUDA{n}' for n in sel)}: no GPU listed in "
                                 f"{proc_root}/driver/nvidia/gpus (is the NVIDIA driver loaded?)")
        nodes = []
        for n in sel:
            if n >= len(minors):
                raise GpuUnavailable(f"-d CUDA{n}: the host has {len(minors)} NVIDIA GPU(s)")
            nodes.append(os.path.join(dev_root, f"nvidia{minors[n]}"))
    devices = []
    for node in nodes:
        if not os.path.exists(node):
            raise GpuUnavailable(f"{node} missing: the GPU's device node (nvidia-modprobe, or the container's device list)")
        devices.append(node)
    for name in REQUIRED_CONTROL:
        path = os.path.join(dev_root, name)
        if not os.path.exists(path) and sel is None:
            continue  # no -d: the server may be a CPU build on a GPU host; bound when present
        if not os.path.exists(path):
            raise GpuUnavailable(f"{path} missing: the CUDA runtime opens it at start (nvidia-modprobe -u for "
                                 "nvidia-uvm)")
        devices.append(path)
    for name in OPTIONAL_CONTROL:
        path = os.path.join(dev_root, name)
        if os.path.exists(path):
            devices.append(path)
    args: list[str] = []
    for path in devices:
        args += ["--dev-bind", path, path]
    libs = _library_dirs(env, lib_dirs)
    for d in libs:
        args += ["--ro-bind", d, d]
    args += ["--setenv", "CUDA_DEVICE_ORDER", "PCI_BUS_ID"]
    if libs:
        args += ["--setenv", "LD_LIBRARY_PATH", ":".join(libs)]
    return GpuBinds(tuple(args), tuple(devices), tuple(libs))
