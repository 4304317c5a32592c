"""Unit tests of rpcguard.protocol.stats (per-session plain-int counters)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpcguard.protocol import stats as stats_mod
from rpcguard.protocol.stats import (
    DEFAULT_COMMAND_NAMES,
    LATENCY_BUCKETS_NS,
    LATENCY_BUCKETS_S,
    N_COMMANDS,
    N_LATENCY_BUCKETS,
    SessionStats,
    command_name,
)

SET_TENSOR, GRAPH_COMPUTE, HELLO = 6, 10, 14
INF = N_LATENCY_BUCKETS - 1


def test_module_is_sans_io() -> None:
    src = (Path(stats_mod.__file__).parent / "stats.py").read_text(encoding="utf-8")  # the source, also when compiled
    for mod in ("asyncio", "prometheus_client", "socket", "ssl"):
        assert f"import {mod}" not in src and f"from {mod}" not in src


def test_bucket_constants() -> None:
    assert N_LATENCY_BUCKETS == len(LATENCY_BUCKETS_S) + 1 == 17
    assert LATENCY_BUCKETS_NS[0] == 100_000 and LATENCY_BUCKETS_NS[-1] == 10_000_000_000
    assert list(LATENCY_BUCKETS_NS) == sorted(set(LATENCY_BUCKETS_NS))
    assert all(isinstance(b, int) for b in LATENCY_BUCKETS_NS)


def _bucket_of(s: SessionStats, cmd: int) -> int:
    (idx,) = [i for i, n in enumerate(s.lat_buckets[cmd]) if n]
    return idx


@pytest.mark.parametrize("i", range(len(LATENCY_BUCKETS_NS)))
def test_latency_bucket_boundaries(i: int) -> None:
    bound = LATENCY_BUCKETS_NS[i]
    at, above, below = SessionStats(), SessionStats(), SessionStats()
    at.observe_latency(SET_TENSOR, bound)  # le: equal to the bound is inside it
    above.observe_latency(SET_TENSOR, bound + 1)
    below.observe_latency(SET_TENSOR, bound - 1)
    assert _bucket_of(at, SET_TENSOR) == i
    assert _bucket_of(above, SET_TENSOR) == i + 1
    assert _bucket_of(below, SET_TENSOR) == i  # bounds are far more than 1 ns apart


def test_latency_extremes_sum_and_count() -> None:
    s = SessionStats()
    s.observe_latency(GRAPH_COMPUTE, 0)
    s.observe_latency(GRAPH_COMPUTE, 60 * 1_000_000_000)  # a minute: +Inf
    s.observe_latency(GRAPH_COMPUTE, 3_000_000)  # 3 ms -> le=0.005
    assert s.lat_buckets[GRAPH_COMPUTE][0] == 1
    assert s.lat_buckets[GRAPH_COMPUTE][INF] == 1
    assert s.lat_buckets[GRAPH_COMPUTE][LATENCY_BUCKETS_S.index(0.005)] == 1
    assert s.lat_count[GRAPH_COMPUTE] == 3
    assert s.lat_sum_ns[GRAPH_COMPUTE] == 60_003_000_000
    assert sum(map(sum, s.lat_buckets)) == 3  # no other command touched


@given(st.integers(min_value=0, max_value=20 * 1_000_000_000))
def test_bucket_matches_linear_search(ns: int) -> None:
    s = SessionStats()
    s.observe_latency(0, ns)
    expected = next((i for i, b in enumerate(LATENCY_BUCKETS_NS) if ns <= b), INF)
    assert _bucket_of(s, 0) == expected


def test_layout_and_slots() -> None:
    s = SessionStats()
    for name in ("req_frames", "req_bytes", "rsp_frames", "rsp_bytes", "lat_sum_ns", "lat_count"):
        assert getattr(s, name) == [0] * N_COMMANDS
    assert len(s.lat_buckets) == N_COMMANDS
    assert all(len(b) == N_LATENCY_BUCKETS for b in s.lat_buckets)
    assert len({id(b) for b in s.lat_buckets}) == N_COMMANDS  # not one aliased list
    assert not hasattr(s, "__dict__")
    with pytest.raises(AttributeError):
        s.typo = 1  # type: ignore[attr-defined]
    with pytest.raises(IndexError):
        s.observe_latency(N_COMMANDS, 1)


def _filled(k: int) -> SessionStats:
    s = SessionStats()
    s.req_frames[SET_TENSOR] += k
    s.req_bytes[SET_TENSOR] += 100 * k
    s.rsp_frames[HELLO] += 1
    s.rsp_bytes[HELLO] += 20
    s.observe_latency(HELLO, 200_000 * k)
    s.alloc_bytes += 1000 * k
    s.upload_bytes_set += 10 * k
    s.upload_bytes_hash_hit += 5 * k
    s.rdma_caps_zeroed_req += k
    s.rdma_caps_zeroed_rsp += 2 * k
    return s


def test_add_into_folds_every_counter() -> None:
    total = SessionStats()
    a, b = _filled(1), _filled(3)
    a.add_into(total)
    b.add_into(total)
    assert total.req_frames[SET_TENSOR] == 4 and total.req_bytes[SET_TENSOR] == 400
    assert total.rsp_frames[HELLO] == 2 and total.rsp_bytes[HELLO] == 40
    assert total.lat_count[HELLO] == 2 and total.lat_sum_ns[HELLO] == 800_000
    assert total.lat_buckets[HELLO][1] == 1  # 200 µs -> le=0.00025
    assert total.lat_buckets[HELLO][3] == 1  # 600 µs -> le=0.001
    assert (total.alloc_bytes, total.upload_bytes_set, total.upload_bytes_hash_hit) == (4000, 40, 20)
    assert (total.rdma_caps_zeroed_req, total.rdma_caps_zeroed_rsp) == (4, 8)
    # the source is untouched
    assert a.req_frames[SET_TENSOR] == 1 and a.lat_count[HELLO] == 1 and a.alloc_bytes == 1000
    assert sum(total.req_frames) == 4 and sum(map(sum, total.lat_buckets)) == 2


def test_add_into_empty_is_identity() -> None:
    total = _filled(2)
    before = (total.per_command(), [list(b) for b in total.lat_buckets], total.alloc_bytes)
    SessionStats().add_into(total)
    assert (total.per_command(), [list(b) for b in total.lat_buckets], total.alloc_bytes) == before


def test_per_command_only_non_zero() -> None:
    assert SessionStats().per_command(DEFAULT_COMMAND_NAMES) == {}
    s = _filled(2)
    s.observe_latency(GRAPH_COMPUTE, 5)  # latency alone does not make a frame entry
    s.req_frames[20] += 1  # an id without a name
    s.req_bytes[20] += 15
    out = s.per_command(DEFAULT_COMMAND_NAMES)
    assert out == {
        "SET_TENSOR": {"req_frames": 2, "req_bytes": 200, "rsp_frames": 0, "rsp_bytes": 0},
        "HELLO": {"req_frames": 0, "req_bytes": 0, "rsp_frames": 1, "rsp_bytes": 20},
        "CMD_20": {"req_frames": 1, "req_bytes": 15, "rsp_frames": 0, "rsp_bytes": 0},
    }
    assert list(out) == ["SET_TENSOR", "HELLO", "CMD_20"]  # command-id order
    assert s.per_command() == out  # default names
    assert list(s.per_command({SET_TENSOR: "SET"})) == ["SET", "CMD_14", "CMD_20"]


def test_command_names() -> None:
    assert len(DEFAULT_COMMAND_NAMES) == 20  # 19: GET_DEVICE_SUPPORTS_OP (7.0.1)
    assert DEFAULT_COMMAND_NAMES[0] == "ALLOC_BUFFER"
    assert DEFAULT_COMMAND_NAMES[HELLO] == "HELLO"
    assert DEFAULT_COMMAND_NAMES[17] == "MEMSET_TENSOR"
    assert command_name(DEFAULT_COMMAND_NAMES, 19) == "GET_DEVICE_SUPPORTS_OP"
    assert command_name(DEFAULT_COMMAND_NAMES, 20) == "CMD_20"


def test_repr_names_commands() -> None:
    assert "SET_TENSOR" in repr(_filled(1))
