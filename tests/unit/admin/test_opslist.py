"""``rpcguard ops``: the op list agrees with the firewall's tables, and the command the example
config refers to exists."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rpcguard.admin.opslist import op_rows, versions_with_ops
from rpcguard.protocol.ggml import DENIED_OPS, op_table
from rpcguard.protocol.oprules import op_status, rule_for
from tests.support.realpeer import PYTHON

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("version", versions_with_ops())
def test_every_op_of_the_enum_once_with_the_firewalls_verdict(version):
    rows = op_rows(version)
    table = op_table(version, allow_inferred=True)
    assert [r.op for r in rows] == list(table.names[:table.count]) and [r.id for r in rows] == list(range(table.count))
    for r in rows:
        if r.op in DENIED_OPS:
            assert r.status == "denied"
        elif r.op == "NONE":
            assert r.status == "leaf"
        else:
            rule = rule_for(r.op, version)
            assert (r.status, r.ctor) == ((op_status(r.op, version), rule.ctor) if rule else ("not verified", ""))
    assert {r.op for r in rows if r.status == "denied"} == set(DENIED_OPS) & set(table.names)


def test_the_command(tmp_path):
    p = subprocess.run([PYTHON, "-m", "rpcguard", "ops", "--protocol", "7.0.0", "--json"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert {r["op"]: r["status"] for r in rows}["MUL_MAT"] == "verified"
    assert {r["op"]: r["status"] for r in rows}["CUSTOM"] == "denied"
    p = subprocess.run([PYTHON, "-m", "rpcguard", "ops", "--protocol", "9.9.9"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("rpcguard: config error: --protocol: no op table for protocol "
                                                     "9.9.9 (rpcguard has 2.0.0, "), p.stderr
    # config/serve.example.yaml sends the reader to `rpcguard ops`
    assert "`rpcguard ops`" in (ROOT / "config" / "serve.example.yaml").read_text()


@pytest.mark.parametrize("version", versions_with_ops())
def test_on_a_cuda_node_the_status_and_the_layer_are_the_cuda_ones(version):
    from rpcguard.admin.opslist import NO_CUDA_KERNEL
    from rpcguard.protocol.oprules.cuda import NO_KERNEL, layer_notes

    cpu = {r.op: r for r in op_rows(version)}
    for r in op_rows(version, "cuda"):
        c = cpu[r.op]
        assert (r.id, r.ctor) == (c.id, c.ctor) and c.layer == ()
        if c.status in ("denied", "leaf", "not verified"):
            assert (r.status, r.layer) == (c.status, ())
        elif r.op in NO_KERNEL:
            assert r.status == NO_CUDA_KERNEL
        else:
            assert r.status == op_status(r.op, version, "cuda") and r.layer == layer_notes(r.op)
    if "GET_ROWS" in cpu and cpu["GET_ROWS"].status != "not verified":
        rows = {r.op: r for r in op_rows(version, "cuda")}
        assert rows["GET_ROWS"].status == "contained only"  # getrows.cu checks no index
        assert any("no CUDA kernel" in r.status for r in rows.values()) or not NO_KERNEL & set(rows)


def test_an_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend 'metal'"):
        op_rows((7, 0, 0), "metal")


def test_the_docs_show_the_cuda_layer_per_op():
    from rpcguard.admin.opslist import cuda_markdown

    doc = (ROOT / "docs" / "firewall.md").read_text(encoding="utf-8")
    begin = doc.index("\n", doc.index("<!-- op-status-cuda:begin")) + 1
    assert doc[begin : doc.index("<!-- op-status-cuda:end -->")] == cuda_markdown((7, 0, 0))


def test_the_command_on_a_cuda_node():
    p = subprocess.run([PYTHON, "-m", "rpcguard", "ops", "--protocol", "7.0.0", "--backend", "cuda", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = {r["op"]: r for r in map(json.loads, p.stdout.splitlines())}
    assert rows["GET_ROWS"]["status"] == "contained only" and rows["GET_ROWS"]["backend"] == "cuda"
    assert rows["DIAG_MASK_ZERO"]["status"] == "refused: no CUDA kernel"
    assert {"what": "refused: a grid y/z dimension > 65535", "source": "pad.cu:70"} in rows["PAD"]["cuda_layer"]
    text = subprocess.run([PYTHON, "-m", "rpcguard", "ops", "--backend", "cuda"], capture_output=True, text=True,
                          timeout=60).stdout
    assert "CUDA refused: a grid y/z dimension > 65535 (pad.cu:70)" in text and "on a cuda node" in text
