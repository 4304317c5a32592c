"""The kernel oracle: compute a graph the real constructors built on the REAL ggml CPU backend.

How this works: tests/support/ggmlworker.py builds a recipe in a no_alloc ggml context of its forked
child; with ``compute`` on, the child then hands that context and graph to ``Kernel.compute``,
which runs it the way ggml-rpc-server's graph_compute does (ggml-rpc.cpp:1712-1783: the nodes
the client sent, ``ggml_backend_graph_compute`` on the CPU backend, and a non-success status is a
``GGML_ASSERT`` there). A kernel ``GGML_ASSERT``/``GGML_ABORT`` calls the abort callback of
ggmlworker's child (which reports it and exits); a fault kills the child by signal; the parent
bounds the time. Any of these means "the kernel refuses this graph": sent to a real server, the
graph kills it.

Memory is laid out like an electric fence around BUFFERS, so that silent out-of-bounds accesses
fault too: every tensor that owns memory (no ``view_src``) gets a buffer of its own, one anonymous
mapping with one PROT_NONE guard page, and the graph is computed twice: first with every buffer
ENDING right before its guard page (4-byte aligned: an overrun of at most 3 bytes goes unseen;
kernels cannot assume more than element alignment anyway: views start at any element), then
with it starting right AFTER a guard page (underruns: a kernel that indexes below the start).
The tensor's data is the buffer's first byte. The buffer (``buffer_sizes``, the same one the
serialised graph declares, ggmlworker.py) covers the tensor and every view of it (a view may
reach past its source: ggml_view_impl only checks the view's own size, and the server only
checks the whole buffer, so that is the client's memory), plus the recipe leaf's ``room``: bytes
of its buffer past the tensor, which a kernel may read (the project's invariant is per buffer,
issue 20 point 3: a kernel may address its tensor's buffer outside the tensor, never past it),
and at least the largest stride of the tensor and its views (what the layout rule asks of any
buffer, opcheck.check_layout). Without room the buffer ends where the tensor's bytes do: a
kernel that reads or writes past the tensor hits the guard page, SIGSEGV. All data is
zero: indexes (GET_ROWS, SET_ROWS, MUL_MAT_ID, ADD_ID) and positions (ROPE) are 0, which every
valid shape can take; so a refusal comes from the shapes,
strides, types and op_params, never from the data. The backend runs one thread
(``ggml_backend_cpu_set_n_threads``): the real server runs several, which changes how rows are
split between threads but not which assertions a kernel makes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Mapping

__all__ = ["Kernel", "GUARD_BYTES", "TENSOR_ALIGN_BYTES", "DATA_ALIGN_BYTES", "MAX_SPAN_BYTES", "buffer_sizes"]

GUARD_BYTES = 4096  # one page after every tensor's span
TENSOR_ALIGN_BYTES = 32  # ggml-impl.h TENSOR_ALIGNMENT; ggml_backend_cpu_buffer_from_ptr asserts it for the base
DATA_ALIGN_BYTES = 4  # a tensor's data: 4-byte aligned, so at most 3 bytes between its end and the guard
MAX_SPAN_BYTES = 1 << 30  # a graph whose tensors need more is not computed (reported "skipped")
GGML_STATUS_SUCCESS = 0  # ggml.h enum ggml_status

_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value


def buffer_sizes(lib: Any, tensor_cls: Any, tensors: list[int], room: Mapping[int, int]) -> dict[int, int]:
    """The size of the buffer of every tensor of ``tensors`` that owns memory (no ``view_src``):
    its span (the tensor and every view of it, ggml_nbytes from its data) rounded up to
    DATA_ALIGN_BYTES, plus ``room[tensor]`` (a leaf's bytes past it), and at least the largest
    nb[1..3] of the tensor and its views (the layout rule refuses a stride past the buffer)."""
    spans: dict[int, int] = {}
    strides: dict[int, int] = {}
    for t in tensors:
        st = tensor_cls.from_address(t)
        root = st.view_src or t
        spans[root] = max(spans.get(root, 1), (st.view_offs if st.view_src else 0) + lib.ggml_nbytes(t))
        strides[root] = max(strides.get(root, 0), *st.nb[1:])
    return {
        r: max(-(-n // DATA_ALIGN_BYTES) * DATA_ALIGN_BYTES + room.get(r, 0), strides[r]) for r, n in spans.items()
    }


class TooLarge(Exception):
    """The graph's tensors need more than MAX_SPAN_BYTES: not computed."""


class Kernel:
    """libggml-cpu.so next to libggml-base.so, with the few calls the oracle makes."""

    def __init__(self, base: Any, base_path: str, tensor_cls: Any, cgraph_cls: Any) -> None:
        self.base = base  # the loaded libggml-base (ggmlworker._Ggml.lib)
        self.tensor_cls = tensor_cls
        self.cgraph_cls = cgraph_cls
        cpu = ctypes.CDLL(str(Path(base_path).with_name("libggml-cpu.so")))
        cpu.ggml_backend_cpu_init.restype = ctypes.c_void_p
        cpu.ggml_backend_cpu_set_n_threads.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.cpu = cpu
        b = base
        b.ggml_backend_cpu_buffer_from_ptr.restype = ctypes.c_void_p
        b.ggml_backend_cpu_buffer_from_ptr.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        b.ggml_backend_tensor_alloc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_backend_view_init.argtypes = [ctypes.c_void_p]
        b.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
        b.ggml_backend_graph_compute.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_backend_graph_compute.restype = ctypes.c_int
        b.ggml_get_first_tensor.restype = ctypes.c_void_p
        b.ggml_get_first_tensor.argtypes = [ctypes.c_void_p]
        b.ggml_get_next_tensor.restype = ctypes.c_void_p
        b.ggml_get_next_tensor.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_graph_view.restype = cgraph_cls
        b.ggml_graph_view.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc = libc
        self.backend: int | None = None  # made in the forked child, on first use

    def compute(self, ctx: int, gf: int, first: int, room: Mapping[int, int] | None = None) -> str:
        """Allocate ``ctx``'s tensors behind guard pages, compute nodes[first:]: "ok" or why not.
        ``room``: bytes of a tensor's buffer past its span (buffer_sizes).

        Returns only when the kernel returned; an abort or a fault ends the process instead.
        """
        if self.backend is None:
            self.backend = self.cpu.ggml_backend_cpu_init()
            self.cpu.ggml_backend_cpu_set_n_threads(self.backend, 1)
        for guard_after in (True, False):  # overruns, then underruns
            verdict = self._compute_once(ctx, gf, first, guard_after, room or {})
            if verdict != "ok":
                return verdict
        return "ok"

    def _compute_once(self, ctx: int, gf: int, first: int, guard_after: bool, room: Mapping[int, int]) -> str:
        maps: list[tuple[int, int]] = []
        bufs: list[int] = []
        try:
            try:
                self._allocate(ctx, maps, bufs, guard_after, room)
            except TooLarge as exc:
                return f"skipped: {exc}"
            cg = self.cgraph_cls.from_address(gf)
            first = min(first, cg.n_nodes - 1)
            view = self.base.ggml_graph_view(gf, first, cg.n_nodes)  # what the server receives
            status = self.base.ggml_backend_graph_compute(self.backend, ctypes.addressof(view))
            return "ok" if status == GGML_STATUS_SUCCESS else f"status {status} (the server GGML_ASSERTs on it)"
        finally:
            self._release(ctx)
            for buf in bufs:
                self.base.ggml_backend_buffer_free(buf)
            for addr, size in maps:
                self.libc.munmap(addr, size)

    def _tensors(self, ctx: int) -> list[int]:
        out = []
        t = self.base.ggml_get_first_tensor(ctx)
        while t:
            out.append(t)
            t = self.base.ggml_get_next_tensor(ctx, t)
        return out

    def _release(self, ctx: int) -> None:
        """Detach every tensor from its buffer (ggml_backend_tensor_alloc wants them unallocated)."""
        for t in self._tensors(ctx):
            st = self.tensor_cls.from_address(t)
            st.buffer = st.data = None

    def _allocate(self, ctx: int, maps: list, bufs: list, guard_after: bool, room: Mapping[int, int]) -> None:
        b = self.base
        tensors = self._tensors(ctx)
        sizes = buffer_sizes(b, self.tensor_cls, tensors, room)  # root tensor -> its buffer's bytes
        views = [t for t in tensors if self.tensor_cls.from_address(t).view_src]
        if sum(sizes.values()) > MAX_SPAN_BYTES:
            raise TooLarge(f"{sum(sizes.values())} bytes of buffers")
        for root, size in sizes.items():
            pages = -(-(size + TENSOR_ALIGN_BYTES) // GUARD_BYTES) * GUARD_BYTES
            addr = self.libc.mmap(None, pages + GUARD_BYTES, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
            if addr in (None, _MAP_FAILED):
                raise TooLarge(f"mmap of {pages} bytes failed (errno {ctypes.get_errno()})")
            maps.append((addr, pages + GUARD_BYTES))
            guard = addr + pages if guard_after else addr
            if self.libc.mprotect(guard, GUARD_BYTES, _PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect of the guard page failed")
            if guard_after:  # the buffer ends at the guard page
                end = addr + pages
                data = end - size
                base = data // TENSOR_ALIGN_BYTES * TENSOR_ALIGN_BYTES  # the buffer's base must be aligned
            else:  # it starts right after it
                data = base = addr + GUARD_BYTES
                end = data + size
            buf = b.ggml_backend_cpu_buffer_from_ptr(base, end - base)  # zero-filled: every input is 0
            bufs.append(buf)
            b.ggml_backend_tensor_alloc(buf, root, data)
        for v in views:
            b.ggml_backend_view_init(v)
