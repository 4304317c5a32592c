"""atheris fuzz target for the frame firewall (not collected by pytest).

Input layout: byte 0 picks the protocol version, byte 1 the command, the rest is the payload
(for SET_TENSOR the first ``set_tensor_head`` bytes are the head and the rest counts as body).
Each input runs against a fresh session that already holds two buffers with known bases, one
stored graph, and the device count learned. Invariant: the firewall accepts the payload or
raises ``FirewallRefusal``; any other exception is a bug.

Run (from the repository root, with ``pip install atheris``):

    python tests/fuzz/fuzz_firewall.py -atheris_runs=1000000 [CORPUS_DIR]
    python tests/fuzz/fuzz_firewall.py --make-seeds CORPUS_DIR   # valid frames to start from

Without atheris the script replays the files given on the command line (or 20000 random inputs).
"""

from __future__ import annotations

import os
import random
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

try:
    import atheris  # type: ignore[import-not-found]
except ImportError:  # the replay mode below still works
    atheris = None

if atheris is not None:
    with atheris.instrument_imports():
        from rpcguard.errors import FirewallRefusal
        from rpcguard.protocol.firewall import Firewall, FirewallPolicy
        from rpcguard.protocol.state import SessionState, UpstreamFacts
        from rpcguard.protocol.versions import KNOWN_VERSIONS, STREAM, spec_for
else:
    from rpcguard.errors import FirewallRefusal
    from rpcguard.protocol.firewall import Firewall, FirewallPolicy
    from rpcguard.protocol.state import SessionState, UpstreamFacts
    from rpcguard.protocol.versions import KNOWN_VERSIONS, STREAM, spec_for

HANDLES = (0x00005555DEADBE00, 0x00005555DEADC000)
BASES = (0x00007F0000000000, 0x00007F0000200000)
SIZE = 1 << 20
POLICY = FirewallPolicy(max_graph_nodes=4096, max_graph_tensors=16384, denied_ops=frozenset({"SSM_SCAN"}))


def session(version: tuple[int, int, int]) -> SessionState:
    state = SessionState(UpstreamFacts(device_count=2), spec=spec_for(version))
    for handle, base in zip(HANDLES, BASES):
        state.add_buffer(handle, 0, SIZE)
        state.buffers[handle].base = base
    state.graph_stored(0)
    return state


def TestOneInput(data: bytes) -> None:  # noqa: N802 (atheris' name)
    if len(data) < 2:
        return
    version = KNOWN_VERSIONS[data[0] % len(KNOWN_VERSIONS)]
    state = session(version)
    spec = state.spec
    assert spec is not None
    rule = spec.rule(data[1] % len(spec.commands))
    if rule is None:
        return
    payload = memoryview(data)[2:]
    body_len = 0
    if rule.layout == STREAM:
        body_len = max(0, len(payload) - rule.request)
        payload = payload[: rule.request]
    try:
        Firewall(state, POLICY).check_request(rule, payload, body_len)
    except FirewallRefusal:
        pass


def make_seeds(directory: str) -> None:
    """Valid frames (and the corpus' malicious ones) as fuzz seeds."""
    from tests.corpus import CASES, CaseContext

    os.makedirs(directory, exist_ok=True)
    n = 0
    for vi, version in enumerate(KNOWN_VERSIONS):
        ctx = CaseContext(version, HANDLES[0], BASES[0], SIZE)
        for case in CASES:
            if not case.applies(version):
                continue
            for frame in case.build(ctx):
                cmd, length = struct.unpack_from("<BQ", frame)
                with open(os.path.join(directory, f"seed-{n:05d}"), "wb") as f:
                    f.write(bytes([vi, cmd]) + frame[9:])
                n += 1
    print(f"wrote {n} seeds to {directory}")


def main(argv: list[str]) -> None:
    if len(argv) > 2 and argv[1] == "--make-seeds":
        make_seeds(argv[2])
        return
    if atheris is not None:
        atheris.Setup(argv, TestOneInput)
        atheris.Fuzz()
        return
    files = [a for a in argv[1:] if os.path.isfile(a)]
    for path in files:
        with open(path, "rb") as f:
            TestOneInput(f.read())
    if not files:
        rng = random.Random(0)
        for _ in range(20000):
            TestOneInput(bytes(rng.randrange(256) for _ in range(rng.choice((2, 12, 300, 3300)))))
    print("ok: no exception but FirewallRefusal")


if __name__ == "__main__":
    main(sys.argv)
