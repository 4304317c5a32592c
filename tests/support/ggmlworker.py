"""The worker process of tests/support/ggmlref.py: real ggml constructors, graph serialisation, compute.

How this works: ``build_many`` (ggmlref.py) starts ``python -m tests.support.ggmlworker --worker
LIB [--compute SECONDS]`` with one JSON recipe per stdin line. The worker loads libggml-base.so
(ctypes), then forks a child that builds the recipes in order (``_build``: leaves, constructor and
modifier calls, ``ggml_build_forward_expand``), serialises each graph like ggml-rpc.cpp
``serialize_graph`` (``_serialise``) and writes one JSON line per recipe. A GGML_ASSERT in a
constructor reaches the abort callback, which writes the message and ends the child; the worker
forks a new child from the next recipe. With ``--compute`` the child also runs each built graph
on the real CPU backend (tests/support/ggmlkernel.py) and writes a second line with the kernel's
verdict; a compute that aborts, faults or outlives the bound is recorded as that verdict. The
line protocol and the struct mirrors are described in ggmlref.py's docstring.

Run ``python -m tests.support.ggmlworker --selftest`` (or ``ggmlref --selftest``) to check the layout mirrors against the library.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import select
import signal
import struct
import sys
from typing import Any, Iterable

from rpcguard.protocol.encode import TENSOR_STRUCT
from tests.support.ggmlref import (
    ABORT_EXIT,
    BUFFER_BASE,
    BUFFER_HANDLE,
    BUFFER_HANDLE_STEP,
    BUFFER_STRIDE,
    CTX_MEM_BYTES,
    GGML_MAX_NAME,
    GGML_OBJECT_BYTES,
    GRAPH_SIZE,
    MODIFIERS,
    SIGNATURES,
    TYPE_IDS,
    GgmlCgraph,
    GgmlInitParams,
    GgmlTensor,
    HarnessError,
    lib_path,
)

__all__ = ["main", "ModifierRefused"]


class ModifierRefused(Exception):
    """A bool modifier (ggml_prec_set_*) returned false: that op does not take the setting."""


_CTYPES = {
    "t": ctypes.c_void_p, "i32": ctypes.c_int32, "u32": ctypes.c_uint32, "i64": ctypes.c_int64,
    "u64": ctypes.c_size_t, "f32": ctypes.c_float, "b": ctypes.c_bool, "i32x4": ctypes.c_int32 * 4,
    "i64x4": ctypes.c_int64 * 4,
}  # fmt: skip


class _Ggml:
    """The loaded library with the prototypes the worker calls."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.lib = lib
        lib.ggml_init.restype = ctypes.c_void_p
        lib.ggml_init.argtypes = [GgmlInitParams]
        lib.ggml_free.argtypes = [ctypes.c_void_p]
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_new_graph_custom.restype = ctypes.c_void_p
        lib.ggml_new_graph_custom.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_bool]
        lib.ggml_build_forward_expand.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.ggml_set_name.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.ggml_set_name.restype = ctypes.c_void_p
        lib.ggml_set_param.argtypes = [ctypes.c_void_p]
        lib.ggml_new_tensor_4d.restype = ctypes.c_void_p
        lib.ggml_new_tensor_4d.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4
        self.fns: dict[str, tuple[Any, list[str]]] = {}
        for name, (_, sig) in SIGNATURES.items():
            fn = getattr(lib, "ggml_" + name, None)
            if fn is None:
                continue
            kinds = sig.split()
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p] + [_CTYPES[k] for k in kinds]
            self.fns[name] = (fn, kinds)
        self.mods: dict[str, tuple[Any, list[str]]] = {}
        for name, (_, sig) in MODIFIERS.items():
            fn = getattr(lib, "ggml_" + name)
            kinds = sig.split()
            fn.restype = ctypes.c_bool if name.startswith("prec_set") else None  # the rest: void or `a`
            fn.argtypes = [_CTYPES[k] for k in kinds]
            self.mods[name] = (fn, kinds)
        if lib.ggml_tensor_overhead() != GGML_OBJECT_BYTES + ctypes.sizeof(GgmlTensor):
            raise HarnessError(f"ggml_tensor_overhead {lib.ggml_tensor_overhead()} != mirror")
        self.path = path
        self.kernel: Any = None  # a ggmlkernel.Kernel once compute is asked for

    def with_kernel(self) -> None:
        from tests.support.ggmlkernel import Kernel

        self.kernel = Kernel(self.lib, self.path, GgmlTensor, GgmlCgraph)


def _tensor(ptr: int) -> GgmlTensor:
    return GgmlTensor.from_address(ptr)


def _build(g: _Ggml, recipe: dict, emit: Any = None) -> dict | None:
    """Build (and serialise) one recipe; with ``emit``, write its line, compute, return None."""
    lib = g.lib
    ctx = lib.ggml_init(GgmlInitParams(CTX_MEM_BYTES, None, True))
    if not ctx:
        raise HarnessError("ggml_init failed")
    try:
        tensors: list[int] = []
        room: dict[int, int] = {}  # leaf -> bytes of its buffer past it ("room")
        for i, leaf in enumerate(recipe["leaves"]):
            ne = (list(leaf["ne"]) + [1, 1, 1, 1])[:4]
            typ = leaf["type"]
            ptr = lib.ggml_new_tensor_4d(ctx, TYPE_IDS[typ] if isinstance(typ, str) else typ, *ne)
            if leaf.get("nb"):
                st = _tensor(ptr)
                for k, v in enumerate(leaf["nb"]):
                    st.nb[k] = v
            lib.ggml_set_name(ptr, f"leaf{i}".encode())
            if leaf.get("param"):
                lib.ggml_set_param(ptr)  # a trainable tensor: a graph node with op NONE
            if leaf.get("room"):
                room[ptr] = int(leaf["room"])
            tensors.append(ptr)
        for op in recipe["ops"]:
            modifier = op["fn"] in g.mods
            fn, kinds = g.mods[op["fn"]] if modifier else g.fns[op["fn"]]
            args = op["args"]
            if len(args) != len(kinds):
                raise HarnessError(f"{op['fn']}: {len(args)} args for signature {kinds}")
            cargs: list[Any] = [] if modifier else [ctx]
            for k, a in zip(kinds, args):
                if k == "t":
                    cargs.append(None if a is None else tensors[a])
                elif k in ("i32x4", "i64x4"):
                    cargs.append(_CTYPES[k](*a))
                else:
                    cargs.append(a)
            ptr = fn(*cargs)
            if modifier:
                if ptr is False:
                    raise ModifierRefused(f"ggml_{op['fn']} returned false")
                ptr = tensors[args[0]]
            elif not ptr:
                raise HarnessError(f"{op['fn']} returned NULL")
            tensors.append(ptr)
        outs = recipe.get("outputs") or [len(tensors) - 1]
        gf = lib.ggml_new_graph_custom(ctx, GRAPH_SIZE, False)
        for o in outs:
            lib.ggml_build_forward_expand(gf, tensors[o])
        first = recipe.get("first_node", 0)
        r = _serialise(g, ctx, GgmlCgraph.from_address(gf), tensors, first, room)
        if emit is None:
            return r
        emit(r)  # the build's line first: an abort from here on is the kernel's
        emit({"kernel": g.kernel.compute(ctx, gf, first, room)}, kernel=True)
        return None
    finally:
        lib.ggml_free(ctx)


def _ctx_tensors(g: _Ggml, ctx: int) -> list[int]:
    lib = g.lib
    lib.ggml_get_first_tensor.restype = lib.ggml_get_next_tensor.restype = ctypes.c_void_p
    lib.ggml_get_first_tensor.argtypes = [ctypes.c_void_p]
    lib.ggml_get_next_tensor.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    out, t = [], lib.ggml_get_first_tensor(ctx)
    while t:
        out.append(t)
        t = lib.ggml_get_next_tensor(ctx, t)
    return out


def _serialise(g: _Ggml, ctx: int, cg: GgmlCgraph, recipe_tensors: list[int], first: int = 0,
               room: dict[int, int] | None = None) -> dict:
    """ggml-rpc.cpp serialize_graph(): add_tensor over the nodes, then the payload.

    ``first`` > 0 sends only nodes[first:], like a later split of the scheduler
    (ggml_graph_view): the earlier nodes then travel as sources, with their op, but not as nodes.
    """
    hs = cg.visited_hash_set
    use: dict[int, int] = {}
    words = (ctypes.c_uint32 * ((hs.size + 31) // 32)).from_address(ctypes.addressof(hs.used.contents))
    for w, bits in enumerate(words):
        while bits:
            low = bits & -bits
            i = w * 32 + low.bit_length() - 1
            bits ^= low
            use[hs.keys[i]] = cg.use_counts[i]
    nodes = [cg.nodes[i] for i in range(min(first, cg.n_nodes - 1), cg.n_nodes)]
    order: list[int] = []
    seen: set[int] = set()

    def add(ptr: int | None) -> None:  # add_tensor, ggml-rpc.cpp:990-1008
        if not ptr or ptr in seen:
            return
        seen.add(ptr)
        t = _tensor(ptr)
        for s in list(t.src):
            add(s)
        add(t.view_src)
        order.append(ptr)

    for n in nodes:
        add(n)
    # Fake allocation: every tensor that owns memory gets a buffer of its own, its data the
    # buffer's first byte, sized as the kernel oracle maps it (ggmlkernel.buffer_sizes: the
    # tensor, its views, the leaf's room), so that the firewall and the kernel see one layout.
    from tests.support.ggmlkernel import buffer_sizes

    sizes = buffer_sizes(g.lib, GgmlTensor, _ctx_tensors(g, ctx), room or {})
    data: dict[int, int] = {}
    handle: dict[int, int] = {}
    buffers: list[list[int]] = []
    for ptr in order:
        if _tensor(ptr).view_src:
            continue
        k = len(buffers)
        handle[ptr], data[ptr] = BUFFER_HANDLE + k * BUFFER_HANDLE_STEP, BUFFER_BASE + k * BUFFER_STRIDE
        buffers.append([handle[ptr], data[ptr], sizes[ptr]])
        if sizes[ptr] > BUFFER_STRIDE:
            raise HarnessError("a tensor larger than the fake buffers' stride")
    blobs = []
    for ptr in order:
        t = _tensor(ptr)
        d = data[t.view_src] + t.view_offs if t.view_src else data[ptr]
        blobs.append(
            TENSOR_STRUCT.pack(
                ptr, t.type, handle[t.view_src or ptr],
                *(x & 0xFFFFFFFF for x in t.ne), *(x & 0xFFFFFFFF for x in t.nb),
                t.op, *t.op_params, t.flags,
                *(s or 0 for s in t.src), t.view_src or 0, t.view_offs, d,
                t.name.ljust(GGML_MAX_NAME, b"\0")[:GGML_MAX_NAME - 1] + b"\0", use.get(ptr, 0),
            )
        )  # fmt: skip
    payload = (
        struct.pack("<II", 0, len(nodes))
        + struct.pack(f"<{len(nodes)}Q", *nodes)
        + struct.pack("<I", len(order))
        + b"".join(blobs)
    )
    pos = {p: i for i, p in enumerate(order)}
    return {
        "ok": True,
        "payload": payload.hex(),
        "nodes": nodes,
        "n_tensors": len(order),
        "refs": [pos.get(p) for p in recipe_tensors],
        "buffers": buffers,
    }


def _child(g: _Ggml, recipes: list[str], start: int, wfd: int) -> None:
    """Run recipes[start:] in order, one JSON line each (two with a kernel); an abort ends the process."""
    out = os.fdopen(wfd, "w", buffering=1)
    phase = {"kernel": False}

    @ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    def on_abort(msg: bytes) -> None:
        text = re.sub(r"^\S*?/(ggml/src/)", r"\1", msg.decode(errors="replace"))  # drop the build path
        line = {"kernel": "abort: " + text} if phase["kernel"] else {"ok": False, "message": text, "abort": True}
        out.write(json.dumps(line) + "\n")
        out.flush()
        os._exit(ABORT_EXIT)  # sooner than abort(): no SIGABRT, no core dump

    def emit(r: dict, kernel: bool = False) -> None:
        out.write(json.dumps(r) + "\n")
        out.flush()  # the worker times the compute from this line on
        phase["kernel"] = not kernel

    g.lib.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    g.lib.ggml_set_abort_callback(ctypes.cast(on_abort, ctypes.c_void_p))
    for line in recipes[start:]:
        try:
            r = _build(g, json.loads(line), emit if g.kernel else None)
        except HarnessError as exc:
            r = {"ok": False, "message": f"harness: {exc}", "harness": True}
        except ModifierRefused as exc:
            r = {"ok": False, "message": str(exc)}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            r = {"ok": False, "message": f"harness: bad recipe: {exc!r}", "harness": True}
        except Exception as exc:  # noqa: BLE001  only after the build's line: the compute's harness failed
            if not phase["kernel"]:
                raise
            r = {"message": f"harness: {exc!r}"}
        if phase["kernel"]:  # the harness failed after the build's line: say so as the verdict
            r = {"kernel": f"skipped: {r['message'] if r else 'no verdict'}"}
        phase["kernel"] = False
        if r is not None:
            out.write(json.dumps(r) + "\n")
    out.flush()
    os._exit(0)


def _died(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"signal {sig} ({signal.Signals(sig).name})" if sig in signal.valid_signals() else f"signal {sig}"
    return f"exit {os.WEXITSTATUS(status)}"


def _worker(path: str, kernel_timeout_s: float | None = None) -> int:
    """Fork a child per run of recipes; a child killed inside recipe i resumes at i + 1.

    With ``kernel_timeout_s`` (compute mode) a built recipe is followed by its kernel verdict;
    a child silent for longer than that is killed and the recipe it was on counts as a hang.
    """
    # Recipes stay JSON text until a child parses one: a small parent forks faster (a batch of
    # 10k recipes as dicts made every fork, i.e. every constructor abort, ~2x slower).
    recipes = sys.stdin.read().splitlines()
    g = _Ggml(path)
    if kernel_timeout_s is not None:
        g.with_kernel()
    gc.disable()  # children are short-lived: no collection, and no copy-on-write of GC headers
    gc.freeze()
    # The time bound is the compute's; a build (or a fork) gets a generous one, for a loaded machine.
    build_bound_s = None if kernel_timeout_s is None else max(60.0, kernel_timeout_s)
    i = 0
    while i < len(recipes):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _child(g, recipes, i, w)
            finally:
                os._exit(3)
        os.close(w)
        pending = False  # a build line was read, its kernel verdict not yet
        last = ""
        hung = False
        buf = b""
        while True:
            ready, _, _ = select.select([r], [], [], kernel_timeout_s if pending else build_bound_s)
            if not ready:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                last = raw.decode()
                if last.startswith('{"kernel"'):
                    pending = False
                    sys.stdout.write(last + "\n")
                    continue
                sys.stdout.write(last + "\n")
                i += 1
                pending = kernel_timeout_s is not None and '"ok": true' in last
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if hung:
            if pending:
                sys.stdout.write(json.dumps({"kernel": f"hang > {kernel_timeout_s:g} s"}) + "\n")
            else:  # not in a compute: the build of recipe i never answered
                sys.stdout.write(json.dumps({"ok": False, "message": "harness: constructor hang", "harness": True}) + "\n")
                i += 1
            continue
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            continue
        if pending:  # died inside the kernel without an abort message: a fault
            sys.stdout.write(json.dumps({"kernel": _died(status)}) + "\n")
            continue
        if '"abort": true' in last or last.startswith('{"kernel"'):
            continue  # the abort callback already wrote the line
        # Killed without a message (a signal other than the abort): recipe i is the one.
        sys.stdout.write(json.dumps({"ok": False, "message": f"constructor killed the process: {_died(status)}"}) + "\n")
        i += 1
    sys.stdout.flush()
    return 0


def _selftest() -> int:
    g = _Ggml(str(lib_path()))
    print("libggml-base:", lib_path())
    print("ggml_tensor mirror:", ctypes.sizeof(GgmlTensor), "bytes; overhead", g.lib.ggml_tensor_overhead())
    print("constructors resolved:", len(g.fns), "of", len(SIGNATURES), "; modifiers:", len(g.mods))
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:
        return _worker(args[1], float(args[3]) if args[2:3] == ["--compute"] else None)
    if args[:1] == ["--selftest"]:
        return _selftest()
    print("usage: python -m tests.support.ggmlworker --selftest | --worker LIB [--compute S] < recipes.json",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
