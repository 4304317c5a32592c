"""Coverage and figures of the differential oracle, per op of the 7.0.0 op table.

    .venv/bin/python -m tests.differential.report [--cases N] [--mutated N] [--seed N] [--details]

For every op of ``enum ggml_op`` (protocol 7.0.0): whether rpcguard has a rule for it, whether
the harness builds it with a real constructor, what the real CPU kernel did with the built graphs
(clean / refused: abort, fault, hang), how many of the kernel-clean ones rpcguard falsely refused,
how many kernel-refused ones it forwarded (missed),  how many generated inputs the constructor accepted and rpcguard accepted, how many
mutations the validator must refuse and did refuse, and the legitimate mutations (the real
constructor builds exactly the mutated node from other inputs) it accepted. The pytest run
(tests/differential/test_ops_differential.py) prints the same table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.oprules import rule_for
from tests.differential.ops import UNBUILDABLE
from tests.differential.oracle import V7, OpResult

__all__ = ["table", "details", "missed_kinds", "to_json", "main", "kernel_lists", "uncovered"]

DEFAULT_CASES = 30  # generated inputs per generator
DEFAULT_MUTATED = 3  # accepted cases per generator whose node is mutated (~10k mutations, ~50 s on a loaded 2-core VM)
DEFAULT_SEED = 1
# Ops of the 7.0.0 table no generator covers, and why.
NOT_COVERED = {
    "NONE": "leaves (every recipe has them; ggml_set_param leaves are nodes with op NONE: OPT_STEP_*)",
    "MAP_CUSTOM1": "function pointer in op_params: no data recipe; denied by rpcguard (#25289)",
    "MAP_CUSTOM2": "function pointer in op_params: no data recipe; denied by rpcguard (#25289)",
    "MAP_CUSTOM3": "function pointer in op_params: no data recipe; denied by rpcguard (#25289)",
    "CUSTOM": "function pointer in op_params: no data recipe; denied by rpcguard (#25289)",
}


def table(results: dict[str, OpResult]) -> str:
    """One line per op of the 7.0.0 table."""
    names = op_table(V7).names  # type: ignore[union-attr]
    rows = [f"{'op':<24}{'rule':<5}{'harness':<8}{'valid: rpcguard/constructor':>28}{'  kernel clean/refused':>22}"
            f"{'  mutations refused/must':>25}{'  legit accepted/all':>21}  status"]  # fmt: skip
    tot = [0, 0, 0, 0, 0, 0, 0, 0]
    for name in names:
        r = results.get(name)
        rule = "yes" if rule_for(name, V7) else "-"
        if r is None:
            rows.append(f"{name:<24}{rule:<5}{'-':<8}{'':>96}  {NOT_COVERED.get(name, 'not generated in this run')}")
            continue
        status = []
        if rule == "-" and r.built:
            status.append("NO RULE (coverage gap)")
        if r.built == 0:
            status.append("constructor always refuses" if name in UNBUILDABLE else "NOT BUILT")
        if r.false_refusals:
            status.append(f"FALSE REFUSALS {len(r.false_refusals)}")
        if r.missed_kernel:
            status.append(f"KERNEL-REFUSED FORWARDED {len(r.missed_kernel)}")
        if r.missed:
            status.append(f"MISSED {len(r.missed)}")
        if r.spec_errors:
            status.append(f"SPEC ERRORS {len(r.spec_errors)}")
        kern = len(r.kernel_refusals)
        rows.append(
            f"{name:<24}{rule:<5}{'yes':<8}{f'{r.accepted}/{r.built} (of {r.generated})':>28}"
            f"{f'{r.kernel_clean}/{kern}':>22}"
            f"{f'{r.refused}/{r.must_refuse}':>25}{f'{r.legit_accepted}/{r.legit}':>21}  {', '.join(status) or 'ok'}"
        )
        vals = (r.accepted, r.built, r.kernel_clean, kern, r.refused, r.must_refuse, r.legit_accepted, r.legit)
        for i, v in enumerate(vals):
            tot[i] += v
    covered = sum(1 for n in names if n in results and results[n].built)
    ruled = sum(1 for n in names if rule_for(n, V7))
    rows.append(
        f"{'TOTAL':<24}{ruled:<5}{f'{covered}/{len(names)}':<8}{f'{tot[0]}/{tot[1]}':>28}{f'{tot[2]}/{tot[3]}':>22}"
        f"{f'{tot[4]}/{tot[5]}':>25}{f'{tot[6]}/{tot[7]}':>21}"
    )
    gaps = uncovered(results)
    if gaps:
        rows.append(f"coverage gaps (built by the harness, no rule for 7.0.0: refused as op_not_verified): "
                    f"{len(gaps)}: {' '.join(gaps)}")  # fmt: skip
    return "\n".join(rows)


def uncovered(results: dict[str, OpResult]) -> list[str]:
    """Ops the harness generates that have no rule for 7.0.0 (refused by default)."""
    return sorted(op for op in results if rule_for(op, V7) is None)


def _short(verdict: str) -> str:
    return re.sub(r"^abort: .*?(ggml/src/)", r"abort: \1", verdict)


def kernel_lists(results: dict[str, OpResult], limit: int = 5) -> str:  # noqa: C901
    """For the rule writer: per op with a rule, false refusals of kernel-clean graphs (reason and
    detail) and kernel-refused graphs rpcguard forwards (how the kernel died); for ops without a
    rule, how the kernel treats the graphs the constructor builds."""
    out = []
    for op, r in sorted(results.items()):
        if rule_for(op, V7) is None:
            if r.kernel_refusals:
                kinds = Counter(_short(v)[:160] for _, _, v, _ in r.kernel_refusals)
                out.append(f"NO RULE {op}: kernel refuses {len(r.kernel_refusals)} of {r.built} built graphs: "
                           + "; ".join(f"{k} x{n}" for k, n in kinds.most_common(3)))  # fmt: skip
            continue
        for gen, recipe, reason, detail in r.false_refusals[:limit]:
            out.append(f"FALSE REFUSAL {op} [{gen}] reason={reason} detail={detail!r}\n  recipe={json.dumps(recipe)}")
        if len(r.false_refusals) > limit:
            kinds = Counter(reason for _, _, reason, _ in r.false_refusals)
            out.append(f"  ... {len(r.false_refusals)} false refusals of {op} in all: {dict(kinds)}")
        for gen, recipe, verdict, _ in r.missed_kernel[:limit]:
            out.append(f"MISSED {op} [{gen}] kernel: {_short(verdict)}\n  recipe={json.dumps(recipe)}")
        if len(r.missed_kernel) > limit:
            kinds = Counter(_short(v)[:120] for _, _, v, _ in r.missed_kernel)
            out.append(f"  ... {len(r.missed_kernel)} kernel-refused graphs of {op} forwarded in all: {dict(kinds)}")
    return "\n".join(out)


def _kind(label: str) -> str:
    """A mutation label without its numbers: 'dst.nb[2]+4' -> 'dst.nb[i]'."""
    return re.sub(r"\[\d+\]", "[i]", re.split(r"[+=]| \(|-\d", label, maxsplit=1)[0])


def missed_kinds(r: OpResult) -> str:
    """Which kinds of mutation the validator let through, with counts."""
    kinds = Counter(_kind(m.label) for m in r.missed)
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))


def details(results: dict[str, OpResult], limit: int = 3) -> str:
    """The failing cases: false refusals and missed mutations, with their recipes."""
    out = []
    for op, r in sorted(results.items()):
        if r.missed:
            out.append(f"MISSED KINDS {op}: {missed_kinds(r)}")
        legit = Counter(_kind(m.label) for m in r.mutations if m.legit)
        if legit:
            out.append(f"LEGIT KINDS {op}: " + ", ".join(f"{k} x{n}" for k, n in sorted(legit.items())))
        for gen, recipe, reason, detail in r.false_refusals[:limit]:
            out.append(f"FALSE REFUSAL {op} [{gen}] reason={reason} detail={detail!r}\n  recipe={json.dumps(recipe)}")
        for gen, recipe, verdict, _ in r.missed_kernel[:limit]:
            out.append(f"KERNEL-REFUSED FORWARDED {op} [{gen}] kernel: {_short(verdict)}\n  recipe={json.dumps(recipe)}")
        for m in r.missed[:limit]:
            out.append(f"MISSED {op} [{m.gen}] {m.label} ({m.rebuild_note})\n  recipe={json.dumps(m.recipe)}")
        for m in r.legit_refused[:limit]:
            out.append(f"LEGIT REFUSED {op} [{m.gen}] {m.label} reason={m.reason}\n  recipe={json.dumps(m.recipe)}")
        for e in r.spec_errors[:limit]:
            out.append(f"SPEC ERROR {op}: {e}")
    return "\n".join(out)


def to_json(results: dict[str, OpResult]) -> dict:
    """Per-op figures and the kinds of missed mutations, for machines."""
    return {
        op: {
            "generated": r.generated, "built": r.built, "accepted": r.accepted,
            "rule": rule_for(op, V7) is not None, "kernel_clean": r.kernel_clean, "gap": r.gap,
            "false_refusals": [{"gen": g, "reason": why, "detail": d, "recipe": rec}
                               for g, rec, why, d in r.false_refusals[:20]],
            "kernel_refusals": [{"gen": g, "kernel": _short(v), "rpcguard": why, "recipe": rec}
                                for g, rec, v, why in r.kernel_refusals[:20]],
            "must_refuse": r.must_refuse, "refused": r.refused, "legit": r.legit, "legit_accepted": r.legit_accepted,
            "missed_kinds": dict(Counter(_kind(m.label) for m in r.missed)),
            "missed": [{"gen": m.gen, "label": m.label, "why": m.rebuild_note, "recipe": m.recipe} for m in r.missed[:20]],
            "legit_refused": [{"gen": m.gen, "label": m.label, "reason": m.reason, "recipe": m.recipe}
                              for m in r.legit_refused[:20]],
            "refusal_reasons": dict(r.reasons),
        }
        for op, r in sorted(results.items())
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.differential.report", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=DEFAULT_CASES)
    ap.add_argument("--mutated", type=int, default=DEFAULT_MUTATED)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--details", action="store_true", help="print failing recipes too")
    ap.add_argument("--kernel-lists", action="store_true",
                    help="print only what the rule writer needs: false refusals and forwarded kernel refusals")
    ap.add_argument("--no-kernel", action="store_true", help="do not compute the built graphs")
    ap.add_argument("--op", action="append", help="only these ops (GGML_OP names without the prefix)")
    ap.add_argument("--json", metavar="FILE", help="also write per-op figures and failing recipes as JSON")
    args = ap.parse_args(argv)
    from tests.differential.oracle import run

    results = run(seed=args.seed, cases=args.cases, mutated=args.mutated, only=set(args.op) if args.op else None,
                  kernel=not args.no_kernel)  # fmt: skip
    print(table(results))
    if args.kernel_lists:
        print(kernel_lists(results))
    if args.details:
        print(details(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
