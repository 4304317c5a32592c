"""Shared fixtures. Integration fixtures start REAL processes; see tests/support/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import realpeer  # noqa: E402
from tests.support.guard import Guard, Pki, start_pair  # noqa: E402


@pytest.fixture(scope="session")
def peer_python() -> str:
    """The real llama.cpp Python; a missing peer is a failure, never a skip."""
    try:
        return realpeer.realpeer_python()
    except realpeer.MissingPeer as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def models(tmp_path_factory, peer_python) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("models")
    return {
        "tiny": realpeer.make_model(d / "tiny.gguf"),
        "bench": realpeer.make_model(d / "bench.gguf", "--preset", "bench"),
    }


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path


@pytest.fixture
def rpc_server(workdir, peer_python):
    """A fresh real ggml-rpc-server on a free loopback port; yields its port."""
    proc, port = realpeer.start_rpc_server(workdir)
    yield port
    proc.stop()
    realpeer.release_port(port)


@pytest.fixture
def pair(workdir, pki, rpc_server):
    """serve -> real server, and connect -> serve; yields (connect, serve)."""
    guards: list[Guard] = []

    def make(serve_args=(), connect_args=(), upstream_port=None):
        return start_pair(workdir, pki, upstream_port or rpc_server, guards, serve_args, connect_args)

    yield make
    for g in guards:
        g.stop()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


os.environ.setdefault("GGML_NO_BACKTRACE", "1")
