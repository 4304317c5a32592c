"""The compiled protocol core (mypyc, setup.py) and the pure-Python core give identical results.

The compiled core runs in this process; the pure one in a child interpreter that imports
``rpcguard.protocol.*`` from the .py sources (tests/support/corereplay.py). Both replay the same
input and return the same picklable outcome: per fed piece, the digests of the bytes forwarded
each way and the events, or the refusal (class, reason, detail); then the counters, buffers,
the four verdict caches, unverified-op uses and allocation charges. Inputs:

* every reproducer of the sanitizer fuzzer (tests/fuzz/findings: shrunk real llama.cpp sessions
  with the mutation that crashed the server), in enforce and in monitor mode, whole, split
  into small pieces, byte by byte (a few) and with a trailing partial frame;
* generated mutations of those sessions (tests/fuzz/mutate.py, fixed seed);
* hypothesis: those sessions with random bytes overwritten and random cut points, and random
  byte streams after a valid HELLO exchange.

The recorded full real session (tests/integration/test_compiled_real.py) is the integration
counterpart. In CI the build must be compiled: the first test fails on a pure build unless
``RPCGUARD_PURE_PYTHON`` is set (then the comparison is pure against pure and says so).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rpcguard.protocol
from rpcguard.protocol.encode import hello_request, hello_response
from tests.fuzz.mutate import Mutator, apply
from tests.fuzz.sanitizer_fuzz import decode_frames
from tests.fuzz.wire import VERSION, Session
from tests.support.corereplay import C2S, S2C, PureWorker, run_case

ROOT = Path(__file__).resolve().parents[3]
FINDINGS = sorted((ROOT / "tests" / "fuzz" / "findings").glob("*.json"))
PURE_BUILD = os.environ.get("RPCGUARD_PURE_PYTHON", "") not in ("", "0")


def _hot_modules() -> list[str]:
    m = re.search(r"HOT_MODULES = \(([^)]*)\)", (ROOT / "setup.py").read_text())
    assert m, "setup.py names its HOT_MODULES"
    return re.findall(r'"(\w+)"', m.group(1))


def _sessions() -> list[tuple[str, list[tuple[int, bytes, bytes | None, int | None]], dict[int, tuple[int, int]]]]:
    out = []
    for path in FINDINGS:
        obj = json.loads(path.read_text())
        if "session" not in obj:  # a few findings keep only the mutation (session_dropped)
            continue
        frames, buffers = decode_frames(obj["session"])
        out.append((path.name, [(f.cmd, f.payload, f.answer, f.length) for f in frames], buffers))
    return out


SESSIONS = _sessions()


@pytest.fixture(scope="module")
def pure():
    w = PureWorker()
    yield w
    w.close()


def test_build_is_compiled(pure):
    """CI installs with the compiler: every hot module is an extension module, the child is pure."""
    assert pure.core == "PURE"
    if PURE_BUILD:
        assert not rpcguard.protocol.compiled()
        return
    assert rpcguard.protocol.compiled(), "the protocol core is not compiled (see the pip install output)"
    import importlib

    # mypyc puts the code of every module in one shared library; the per-module extensions are
    # shims that a rebuild leaves untouched when they do not change, so the library's age counts.
    group = [Path(p) for entry in sys.path for p in glob.glob(f"{entry or '.'}/rpcguard_core__mypyc*")]
    for name in _hot_modules():
        mod = importlib.import_module(f"rpcguard.protocol.{name}")
        assert (mod.__file__ or "").endswith(tuple(EXTENSION_SUFFIXES)), name
        # an editable install compiles once: a source edited (or pulled) since then is not what runs
        src = ROOT / "rpcguard" / "protocol" / f"{name}.py"
        built = max([Path(mod.__file__).stat().st_mtime] + [g.stat().st_mtime for g in group])
        assert built >= src.stat().st_mtime, (
            f"{mod.__file__} is older than {src.name}: the compiled core is stale, run pip install -e . again")


def _same(pure, case) -> dict:
    mine = run_case(case)
    theirs = pure.run(case)
    assert mine == theirs
    return mine


@pytest.mark.parametrize("mode", ["enforce", "monitor"])
def test_findings_same_outcome(pure, mode):
    assert len(SESSIONS) > 100
    refused = forwarded = 0
    for name, frames, _ in SESSIONS:
        for split in ((), (1, 7, 300)):
            out = _same(pure, ("frames", (VERSION, frames, mode, split)))
            if out["chunks"][-1][0] == "refused":
                refused += 1
            else:
                forwarded += 1
            assert not any(c[0] == "raised" for c in out["chunks"]), name
    # the corpus exercises both verdicts (enforce refuses the fixed findings, monitor forwards them)
    assert (refused > 0) if mode == "enforce" else (forwarded > 0)


def test_generated_mutations_same_outcome(pure):
    rng = random.Random(12)
    kinds = set()
    caches = 0
    for i in range(400):
        name, frames, buffers = SESSIONS[i % len(SESSIONS)]
        from tests.fuzz.wire import Frame

        s = Session([Frame(c, p, a, n) for c, p, a, n in frames], buffers)
        m = Mutator(s, rng).pick()
        kinds.add(m.kind)
        mutated = [(f.cmd, f.payload, f.answer, f.length) for f in apply(s, m)]
        out = _same(pure, ("frames", (VERSION, mutated, "enforce" if i % 3 else "monitor", ())))
        caches += bool(out["tensor_cache"])
    assert len(kinds) >= 5 and caches > 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_bytes_random_splits_same_outcome(pure, data):
    """A real session with a few bytes overwritten, fed in pieces cut at random points."""
    name, frames, _ = data.draw(st.sampled_from(SESSIONS), label="session")
    frames = list(frames)
    for _ in range(data.draw(st.integers(0, 4), label="flips")):
        i = data.draw(st.integers(0, len(frames) - 1))
        cmd, payload, answer, length = frames[i]
        if payload:
            at = data.draw(st.integers(0, len(payload) - 1))
            payload = payload[:at] + bytes([data.draw(st.integers(0, 255))]) + payload[at + 1 :]
        frames[i] = (cmd, payload, answer, length)
    split = tuple(data.draw(st.lists(st.integers(1, 400), min_size=0, max_size=6), label="split"))
    mode = data.draw(st.sampled_from(["enforce", "monitor"]))
    _same(pure, ("frames", (VERSION, frames, mode, split)))


HELLO_REQ = hello_request(VERSION)
HELLO_RSP = hello_response(VERSION)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(client=st.binary(max_size=600), server=st.binary(max_size=200),
       cuts=st.lists(st.tuples(st.sampled_from([C2S, S2C]), st.integers(1, 64)), max_size=30))
def test_random_streams_same_outcome(pure, client, server, cuts):
    """Random bytes after a valid HELLO exchange, interleaved both ways at random cut points."""
    streams = {C2S: HELLO_REQ + client, S2C: server}
    chunks = [(C2S, HELLO_REQ), (S2C, HELLO_RSP)]
    pos = {C2S: len(HELLO_REQ), S2C: 0}
    for way, n in cuts:
        if pos[way] < len(streams[way]):
            chunks.append((way, streams[way][pos[way] : pos[way] + n]))
            pos[way] += n
    for way in (C2S, S2C):
        if pos[way] < len(streams[way]):
            chunks.append((way, streams[way][pos[way] :]))
    _same(pure, ("chunks", (VERSION, chunks, "enforce", ())))


def test_byte_by_byte_and_trailing_data_same_outcome(pure):
    """A few sessions fed one byte at a time, and with a trailing partial frame after the last."""
    picked = [s for s in SESSIONS if len(b"".join(f[1] for f in s[1])) < 200_000][:4]
    assert picked
    for name, frames, _ in picked:
        for mode in ("enforce", "monitor"):
            out = _same(pure, ("frames", (VERSION, frames, mode, (1,))))
            assert len(out["chunks"]) > 10 * len(frames), name  # really fed byte by byte
            trailing = frames + [(frames[-1][0], b"\x01\x02", None, 1000)]  # header promises 1000 bytes
            _same(pure, ("frames", (VERSION, trailing, mode, ())))
