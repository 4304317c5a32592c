"""The differential oracle: rpcguard's GraphValidator against the real ggml constructors.

How this works, in two batches of real-constructor builds (tests/support/ggmlref.py):

1. Every generator of ops.py makes ``cases`` recipes (seeded per generator). The constructors
   accept some (a real client could send that graph: the validator must ACCEPT it, or it is a
   false refusal) and refuse others (only counted).
2. For the first ``mutated`` accepted cases of each generator, single-field mutations of the
   op's node (dst ne[i]+-1, nb[i]+esz, a size-1 dim's nb made huge, type; the integer op_params
   the generator maps to arguments; the view offset past the source; view_offs alone; each src
   dropped; two srcs swapped) and of its leaf sources (ne[i]+1, a size-1 dim's nb made huge,
   padded rows, elements strided, type) are made on the serialised graph. Each mutation that corresponds to other
   constructor inputs is rebuilt with the real constructors: the mutated graph is *legitimate*
   when every one of its nodes is, field for field and through all its sources, a node of the
   rebuilt or of the original graph (``canon``). Otherwise (the constructor refuses the mutated
   inputs, or builds something else, or no inputs can produce it) the validator must REFUSE it.

With ``kernel`` on (the default), step 1 also COMPUTES every built graph on the real CPU backend
(tests/support/ggmlkernel.py): a constructor-built graph is then one of

* kernel-clean: computed without abort, fault or hang. rpcguard must forward it; a refusal is a
  FALSE REFUSAL, except ``op_not_verified`` (an op with no rule yet: a coverage gap, counted apart);
* kernel-refused: the kernel aborted, faulted (guard page) or hung. rpcguard must refuse it; a
  forwarded one is a MISSED attack (one GRAPH_COMPUTE kills or corrupts the real server).

Legitimate mutations are reported, not asserted: they include graphs the constructor accepts
but a kernel could still mishandle (e.g. a view whose strides reach past its source, which
ggml_view_impl's contiguous-size check lets through), so a refusal there is the lead's call.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from dataclasses import dataclass, field

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import spec_for
from tests.differential.mutations import Mutation, canon_nodes, mutations
from tests.differential.ops import GENERATORS, Case
from tests.support.ggmlref import Built, Refused, build_many, kernel_refused

__all__ = ["OpResult", "Mutation", "run", "validate", "refusal", "V7", "LAST_RESULTS", "GAP"]

LAST_RESULTS: "dict[str, OpResult] | None" = None  # the last run in this process (for the pytest summary)

V7 = (7, 0, 0)
GAP = "op_not_verified"  # the reason for an op without a rule: a coverage gap, not a false refusal
CRASH = "EXCEPTION "  # prefix of validate()'s answer when the validator raised something else


def validate(payload: bytes, buffers: list[tuple[int, int, int]]) -> str | None:
    """None when rpcguard's validator accepts the GRAPH_COMPUTE payload, else its reason."""
    got = refusal(payload, buffers)
    return None if got is None else got[0]


def refusal(payload: bytes, buffers: list[tuple[int, int, int]]) -> tuple[str, str] | None:
    """None when rpcguard's validator accepts the payload, else (reason, detail). ``buffers``:
    the session's buffers, as the kernel oracle laid them out (Built.buffers)."""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    for handle, base, size in buffers:
        st.add_buffer(handle, 0, size)
        st.buffers[handle].base = base
    try:
        # contained: the shape rules of content-indexed ops (oprules.needs_containment) are what
        # this oracle checks; that they need containment is tests/unit/protocol/test_oprules.py's business
        GraphValidator(FirewallPolicy(max_graph_nodes=4096, max_graph_tensors=16384, contained=True)).check(memoryview(payload), st)
    except FirewallRefusal as exc:
        return exc.reason, exc.detail
    except Exception as exc:  # noqa: BLE001  a validator bug: reported, never counted as a refusal
        return f"{CRASH}{type(exc).__name__}: {exc}", ""
    return None


def unbounded(buffers: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The same buffers, each BUFFER_SIZE long: what a mutated graph is validated against (a
    mutated tensor that grows still fits; a refusal comes from the op rules)."""
    from tests.support.ggmlref import BUFFER_SIZE

    return [(h, b, BUFFER_SIZE) for h, b, _ in buffers]


@dataclass
class OpResult:
    op: str
    generated: int = 0
    built: int = 0  # accepted by the real constructors
    accepted: int = 0  # ... and by rpcguard
    # Refused by rpcguard though the kernel computed it (or was not asked): (gen, recipe, reason, detail)
    false_refusals: list[tuple[str, dict, str, str]] = field(default_factory=list)
    gap: int = 0  # kernel-clean graphs refused as op_not_verified (no rule yet)
    gap_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # detail's op -> count
    kernel_clean: int = 0  # built graphs the real CPU kernel computed (kernel on)
    kernel_skipped: int = 0  # ... it was not asked to (too large)
    # Built graphs the real kernel aborted / faulted / hung on: (gen, recipe, verdict, rpcguard reason or None)
    kernel_refusals: list[tuple[str, dict, str, str | None]] = field(default_factory=list)
    must_refuse: int = 0
    refused: int = 0
    missed: list[Mutation] = field(default_factory=list)  # must refuse, but accepted (or crashed)
    legit: int = 0
    legit_accepted: int = 0
    legit_refused: list[Mutation] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gens: set[str] = field(default_factory=set)
    spec_errors: list[str] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)  # all of them, payloads dropped
    built_graphs: list[tuple[str, dict, Built]] = field(default_factory=list)  # run(keep_built=True) only

    @property
    def missed_kernel(self) -> list[tuple[str, dict, str, str | None]]:
        """Kernel-refused graphs rpcguard forwards (or crashed on): attacks that get through."""
        return [k for k in self.kernel_refusals if k[3] is None or k[3].startswith(CRASH)]


# -- the run ----------------------------------------------------------------------------------


def run(
    seed: int = 1, cases: int = 40, mutated: int = 6, only: set[str] | None = None, kernel: bool = True,
    keep_built: bool = False,
) -> dict[str, OpResult]:
    """Generate, build (and compute, with ``kernel``), validate and mutate; results per GGML op name."""
    results: dict[str, OpResult] = {}
    made: list[tuple[str, Case]] = []
    for name, (op, fn) in GENERATORS.items():
        if only and op not in only:
            continue
        rng = random.Random(f"{seed}:{name}")
        res = results.setdefault(op, OpResult(op))
        res.gens.add(name)
        for _ in range(cases):
            made.append((name, fn(rng)))
            res.generated += 1
    built = build_many([c.recipe for _, c in made], compute=kernel)
    muts: list[Mutation] = []
    bufs: dict[int, list[tuple[int, int, int]]] = {}  # id(mutation) -> its original's buffers
    per_gen: dict[str, int] = defaultdict(int)
    for (name, case), b in zip(made, built):
        res = results[case.op]
        if not isinstance(b, Built):
            if b.message.startswith("harness"):
                res.spec_errors.append(f"{name}: {b.message}")
            continue
        res.built += 1
        if keep_built:
            res.built_graphs.append((name, case.recipe, b))
        got = refusal(b.payload, b.buffers)
        if got is None:
            res.accepted += 1
        if kernel_refused(b.kernel):
            res.kernel_refusals.append((name, case.recipe, b.kernel, None if got is None else got[0]))
        else:
            res.kernel_clean += b.kernel == "ok"
            res.kernel_skipped += b.kernel is not None and b.kernel != "ok"
            if got is not None and got[0] == GAP:
                res.gap += 1
                m = re.search(r"op (\w+) has no verified rule", got[1])
                res.gap_ops[m.group(1) if m else "?"] += 1
            elif got is not None:
                res.false_refusals.append((name, case.recipe, *got))
        if per_gen[name] < mutated:
            per_gen[name] += 1
            for m in mutations(name, case, b):
                m.original, m.op = b.payload, case.op
                muts.append(m)
                bufs[id(m)] = unbounded(b.buffers)
    rebuilt = build_many([m.rebuild for m in muts if m.rebuild is not None])
    it = iter(rebuilt)
    for m in muts:
        res = results[m.op]
        rb = next(it) if m.rebuild is not None else None
        if isinstance(rb, Built):
            mine = canon_nodes(m.payload)
            known = set(canon_nodes(rb.payload)) | set(canon_nodes(m.original))
            m.legit = all(c in known for c in mine)
            m.rebuild_note = "rebuilt: same graph" if m.legit else "rebuilt: constructor builds another node"
        elif isinstance(rb, Refused):
            m.rebuild_note = "constructor refuses: " + rb.message.split(": ", 1)[-1][:120]
        else:
            m.rebuild_note = "no constructor inputs give this node"
        m.reason = validate(m.payload, bufs.pop(id(m)))
        forwarded = m.reason is None or m.reason.startswith(CRASH)
        if m.legit or not forwarded:
            m.payload = b""  # results keep the verdicts, not ~10k payloads (missed ones keep theirs)
        m.original = b""
        res.mutations.append(m)
        if m.legit:
            res.legit += 1
            if m.reason is None:
                res.legit_accepted += 1
            else:
                res.legit_refused.append(m)
        else:
            res.must_refuse += 1
            if m.reason is None or m.reason.startswith(CRASH):
                res.missed.append(m)
            else:
                res.refused += 1
                res.reasons[m.reason] += 1
    return results

