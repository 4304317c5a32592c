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
