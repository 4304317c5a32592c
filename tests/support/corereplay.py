"""Replays into the protocol core whose outcome can be compared across processes (compiled vs pure).

How this works: ``replay_chunks`` feeds a recorded connection (direction, bytes) chunk by chunk
into a fresh ``Session``; ``replay_frames`` feeds request frames and answers every response the
session expects (the recorded answer when it has the expected length, else zeros; HELLO gets the
version). Either returns a plain, picklable outcome: per chunk the digest of the bytes forwarded
each way and the events (or the refusal's class, reason and detail, which ends the replay), the
session's counters, the buffers, the four verdict caches and the unverified-op uses.

``PureWorker`` runs the same replays in a child interpreter that imports the protocol core from
its ``.py`` sources even where compiled modules are installed (``_SourceFirst`` on
``sys.meta_path``): one process per test module, cases and outcomes pickled over its pipes. The
child prints whether it runs pure, so a test can check that the comparison is between two cores.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["replay_chunks", "replay_frames", "run_case", "run_pytest_pure", "PureWorker", "C2S", "S2C"]

C2S, S2C = 0, 1
ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_DIR = ROOT / "rpcguard" / "protocol"


def _facts(version: tuple[int, int, int]) -> Any:
    from rpcguard.protocol.state import UpstreamFacts

    # What an earlier connection would have taught: no DEVICE_COUNT / GET_DEVICE_MEMORY injected.
    return UpstreamFacts(version=version, device_count=1, memory={0: (1 << 62, 1 << 62)})


def _session(version: tuple[int, int, int], mode: str) -> Any:
    from rpcguard.protocol.session import Session
    from rpcguard.protocol.settings import SessionPolicy

    return Session(SessionPolicy(clear_new_buffers=False, mode=mode), _facts(version))


def _digest(parts: list[Any]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _event(event: Any) -> tuple[str, str]:
    return (type(event).__name__, repr(event))


def _feed(s: Any, way: int, data: bytes, log: list[Any], split: tuple[int, ...] = ()) -> bool:
    """One chunk into ``s`` (in pieces of the sizes in ``split``, cycled; whole when empty);
    appends each piece's outcome to ``log``; False once the session refused (or raised)."""
    from rpcguard.errors import Refusal

    out = s.out
    feed = s.client_data if way == C2S else s.server_data
    pos, k = 0, 0
    while True:
        n = split[k % len(split)] if split else len(data)
        piece, pos, k = data[pos : pos + n], pos + n, k + 1
        try:
            feed(memoryview(piece))
        except Refusal as exc:
            log.append(("refused", type(exc).__name__, exc.reason, exc.detail, [_event(e) for e in out.events]))
            return False
        except Exception as exc:  # a bug in one core: part of the outcome, compared like the rest
            log.append(("raised", type(exc).__name__, str(exc)))
            return False
        st = s.state
        sizes = (len(st.tensor_cache), len(st.node_cache), sum(map(len, st.layout_cache.values())),
                 len(st.head_cache))
        log.append((_digest(out.to_server), _digest(out.to_client), [_event(e) for e in out.events], sizes))
        out.clear()
        if sizes[0] > len(_FULLEST.get(id(s), ((),))[0]):  # the caches' contents when fullest
            _FULLEST[id(s)] = _caches(st)
        if pos >= len(data):
            return True


_FULLEST: dict[int, tuple[Any, ...]] = {}  # session id -> _caches() when its tensor cache was fullest


def _caches(st: Any) -> tuple[Any, ...]:
    return (sorted(st.tensor_cache.items()), sorted(st.node_cache),
            sorted((d, sorted(c)) for d, c in st.layout_cache.items()), sorted(st.head_cache))


def _counter_names() -> list[str]:
    """SessionStats.__slots__ as written in stats.py (a compiled class has no ``__slots__``)."""
    tree = ast.parse((PROTOCOL_DIR / "stats.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SessionStats":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", "") == "__slots__":
                    return list(ast.literal_eval(stmt.value))
    raise AssertionError("SessionStats.__slots__ not found in stats.py")


def _final(s: Any, log: list[Any]) -> dict[str, Any]:
    st, stats = s.state, s.stats
    fullest = _FULLEST.pop(id(s), ([], [], [], []))
    return {
        "fullest_caches": fullest,
        "chunks": log,
        "greeted": s.version is not None,
        "version": s.version,
        "counters": {k: getattr(stats, k) for k in _counter_names()},
        "buffers": sorted((h, b.base, b.size, b.device) for h, b in st.buffers.items()),
        "tensor_cache": sorted(st.tensor_cache.items()),
        "node_cache": sorted(st.node_cache),
        "layout_cache": sorted((d, sorted(c)) for d, c in st.layout_cache.items()),
        "head_cache": sorted(st.head_cache),
        "unverified_uses": sorted(st.unverified_uses.items()),
        "alloc_by_device": sorted(st.alloc_by_device.items()),
        "hash_misses": sorted(st.hash_misses),
        "graph_devices": sorted(st.graph_devices),
    }


def replay_chunks(version: tuple[int, int, int], chunks: list[tuple[int, bytes]], mode: str = "enforce",
                  split: tuple[int, ...] = ()) -> dict[str, Any]:
    """A recorded connection, chunk by chunk in the recorded order."""
    s = _session(version, mode)
    log: list[Any] = []
    for way, data in chunks:
        if not _feed(s, way, data, log, split):
            break
    return _final(s, log)


def replay_frames(version: tuple[int, int, int], frames: list[tuple[int, bytes, bytes | None, int | None]],
                  mode: str = "enforce", split: tuple[int, ...] = ()) -> dict[str, Any]:
    """Request frames (cmd, payload, recorded answer, header length or None); each response the
    session then expects is answered (see the module doc)."""
    s = _session(version, mode)
    log: list[Any] = []
    for cmd, payload, answer, length in frames:
        head = struct.pack("<BQ", cmd, len(payload) if length is None else length)
        if not _feed(s, C2S, head + payload, log, split):
            return _final(s, log)
        while s._expect:  # what the server would answer, in order
            e = s._expect[0]
            if e.cmd == 14:  # HELLO: the version, in the form that matches the request
                from rpcguard.protocol.encode import hello_response

                ans = hello_response(version)[8:]
            elif answer is not None and len(answer) == e.length:
                ans, answer = answer, None
            else:
                ans = bytes(e.length)
            before = len(s._expect)
            if not _feed(s, S2C, struct.pack("<Q", len(ans)) + ans, log, split):
                return _final(s, log)
            if len(s._expect) >= before:  # the session did not take it: stop answering
                break
    return _final(s, log)


def run_case(case: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
    kind, args = case
    return (replay_chunks if kind == "chunks" else replay_frames)(*args)


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Imports ``rpcguard.protocol.*`` from the .py files, never a compiled extension module."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix = "rpcguard.protocol."
        if not fullname.startswith(prefix) or "." in fullname[len(prefix):]:
            return None
        src = PROTOCOL_DIR / (fullname[len(prefix):] + ".py")
        if not src.exists():
            return None
        return importlib.util.spec_from_file_location(fullname, src,
                                                      loader=importlib.machinery.SourceFileLoader(fullname, str(src)))


def _child() -> None:
    """The pure worker's loop: length-prefixed pickled cases in, pickled outcomes out."""
    sys.meta_path.insert(0, _SourceFirst())
    import rpcguard.protocol

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(b"PURE\n" if not rpcguard.protocol.compiled() else b"COMPILED\n")
    out.flush()
    while True:
        head = inp.read(8)
        if len(head) < 8:
            return
        case = pickle.loads(inp.read(struct.unpack("<Q", head)[0]))
        blob = pickle.dumps(run_case(case), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(struct.pack("<Q", len(blob)) + blob)
        out.flush()


class PureWorker:
    """A child interpreter running the pure-Python core (see the module doc)."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.support.corereplay import _child; _child()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env)
        assert self.proc.stdout is not None
        self.core = self.proc.stdout.readline().decode().strip()  # "PURE" (or "COMPILED": a broken setup)

    def run(self, case: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        blob = pickle.dumps(case, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
        self.proc.stdin.flush()
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise RuntimeError(f"pure worker exited ({self.proc.wait()})")
        return pickle.loads(self.proc.stdout.read(struct.unpack("<Q", head)[0]))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_pytest_pure(nodeid: str, timeout_s: float = 600) -> str:
    """Run one test (``path::name``) in a child interpreter on the pure-Python core; its output.

    For the few tests that swap a function inside the protocol core (``monkeypatch.setattr`` on a
    module): compiled modules call each other natively, so the swap would not reach them there."""
    assert not os.environ.get("RPCGUARD_PURE_CHILD"), "the pure child imported the compiled core"
    code = ("import sys; from tests.support.corereplay import _SourceFirst; sys.meta_path.insert(0, _SourceFirst()); "
            "import pytest; sys.exit(pytest.main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RPCGUARD_PURE_CHILD": "1"}
    p = subprocess.run([sys.executable, "-c", code, nodeid, "-q", "-p", "no:cacheprovider", "-p", "no:cloudcoil"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == 0 and " passed" in p.stdout, f"{nodeid} on the pure core:\n{p.stdout[-4000:]}{p.stderr[-2000:]}"
    return p.stdout
