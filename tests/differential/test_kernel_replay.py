"""The kernel oracle's verdicts hold on the REAL ggml-rpc-server, over the wire.

tests/support/ggmlkernel.py computes constructor-built graphs in-process; here the same graphs go
to the real 7.0.0 server binary (tests/differential/asan_replay.py's Replayer: one server buffer
per tensor, zeroed, payload rebased), and the server must agree: the graphs the oracle says a
kernel aborts on kill the server with that same assertion, the clean ones are computed and the
server keeps answering. (Out-of-bounds faults need the ASan server to show on the wire: run
``python -m tests.differential.asan_replay``; this test uses the plain server every CI has.)
"""

from __future__ import annotations

import os

import pytest

from tests.differential.asan_replay import Replayer
from tests.support import realpeer
from tests.support.ggmlref import Built, build_many

ROPE_TAIL = [10000.0, 1.0, 0.0, 1.0, 32.0, 1.0]
CASES = {
    "rope n_dims > ne0": ({"leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
                           "ops": [{"fn": "rope_ext", "args": [0, 1, None, 32, 0, 4096, *ROPE_TAIL]}]},
                          "n_dims <= ne0"),
    "get_rows of q8_K": ({"leaves": [{"type": "q8_K", "ne": [256, 7, 1, 2]}, {"type": "i32", "ne": [4, 1, 2, 1]}],
                          "ops": [{"fn": "get_rows", "args": [0, 1]}]}, "fatal error"),
    "repeat of a transposed source": ({"leaves": [{"type": "f32", "ne": [5, 4, 1, 4]}, {"type": "f32", "ne": [4, 5, 1, 4]}],
                                       "ops": [{"fn": "transpose", "args": [0]}, {"fn": "repeat", "args": [2, 1]}]},
                                      "nb00 == sizeof(float)"),
    "hadamard hint, n not a power of 2": ({"leaves": [{"type": "q4_0", "ne": [96, 3, 1, 1]}, {"type": "f32", "ne": [96, 1, 1, 1]}],
                                           "ops": [{"fn": "mul_mat", "args": [0, 1]}, {"fn": "mul_mat_set_hint", "args": [2, 1]}]},
                                          "(n & (n - 1)) == 0"),
    "rope": ({"leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
              "ops": [{"fn": "rope_ext", "args": [0, 1, None, 8, 0, 4096, *ROPE_TAIL]}]}, None),
    "mul_mat q4_0": ({"leaves": [{"type": "q4_0", "ne": [64, 8]}, {"type": "f32", "ne": [64, 3]}],
                      "ops": [{"fn": "mul_mat", "args": [0, 1]}]}, None),
    "permute, cont, soft_max with mask": ({"leaves": [{"type": "f32", "ne": [8, 4, 2]}, {"type": "f16", "ne": [4, 8]}],
                                           "ops": [{"fn": "permute", "args": [0, 1, 0, 2, 3]}, {"fn": "cont", "args": [2]},
                                                   {"fn": "soft_max_ext", "args": [3, 1, 0.5, 0.0]}]}, None),
}  # fmt: skip


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    built = build_many([recipe for recipe, _ in CASES.values()], compute=True)
    rep = Replayer(_server_binary(), tmp_path_factory.mktemp("replay"))
    try:
        return {name: (b, rep.run(b) if isinstance(b, Built) else None) for name, b in zip(CASES, built)}
    finally:
        rep.close()


def _server_binary() -> str:
    return os.environ.get("REALPEER_RPC_SERVER_BIN") or realpeer._read_env(realpeer.REALPEER_HOME / "env.sh")[
        "REALPEER_RPC_SERVER_BIN"
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_the_real_server_agrees_with_the_kernel_oracle(verdicts, name):
    b, server = verdicts[name]
    assert isinstance(b, Built), f"the real constructor refuses {name} now: {b.message}"
    expect = CASES[name][1]
    if expect is None:
        assert b.kernel == "ok" and server == "ok", (b.kernel, server)
    else:
        assert b.kernel.startswith("abort: ") and expect in b.kernel, b.kernel
        assert server.startswith("dead: ") and expect in server, server
