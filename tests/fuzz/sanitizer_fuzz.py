"""Sanitizer oracle: mutated REAL sessions through `rpcguard serve` into an ASan+UBSan server.

    python -m tests.fuzz.sanitizer_fuzz --count 20000 [--seed 1] [--model tiny] [--minutes 60]
    python -m tests.fuzz.sanitizer_fuzz --replay tests/fuzz/findings/*.json

How this works: one real llama.cpp session (the tiny model, a short prompt, a few tokens) is
recorded against the sanitizer server itself (tests/realpeer/sanitizer.sh builds it), and must
come out clean (that is the baseline: an unmutated real session gives no report). Then, for
each iteration, ``mutate.Mutator`` picks one mutation with a seeded RNG, and ``replay.Replayer``
sends the recorded frames up to the mutated one plus ``--tail`` more through `rpcguard serve`
(a real process, enforce mode, default settings, mTLS with test certificates), then a probe.
Oracle, for every session: no sanitizer report and no crash of the server (whatever reached it,
rpcguard forwarded), the probe answered within ``--timeout`` seconds (no hung graph), and the
server's single slot free again for the next session. Refusals by rpcguard are fine and counted
per reason. On a finding the server is restarted, the session is shrunk (set-up frames + the
mutated frame and what follows; then tensor data zeroed) while it still reproduces, and written
to ``--findings`` as JSON with a one-line note. Findings are counted by signature (kind of report,
where ASan/UBSan/ggml points, the op of the mutated tensor) and stored once per location (kind and
where: what one rule has to prevent).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rpcguard.protocol.ggml import op_table  # noqa: E402
from tests.fuzz.mutate import Mutation, Mutator, _get, apply  # noqa: E402
from tests.fuzz.replay import Ending, Replayer, record  # noqa: E402
from tests.fuzz.sanserver import SanServer, Verdict  # noqa: E402
from tests.fuzz.shrink import shrink  # noqa: E402
from tests.fuzz.wire import CMD, VERSION, Frame, Session, encode_frames, tensor_slots  # noqa: E402
from tests.support import realpeer  # noqa: E402
from tests.support.guard import Guard, Pki, start_guard  # noqa: E402

__all__ = ["Fuzzer", "Finding", "load_session", "main", "FINDINGS_DIR", "decode_frames", "file_location"]

FINDINGS_DIR = Path(__file__).resolve().parent / "findings"
OPS = op_table(VERSION)
MAX_KEEP_BYTES = 100_000  # a reproducer bigger than this after shrinking is kept as a note only


def load_session(workdir: Path, server_port: int, model_name: str = "tiny", n_tokens: int = 3) -> Session:
    """The recorded session, cached in $REALPEER_HOME/asan/sessions (recorded once per machine)."""
    cache = realpeer.REALPEER_HOME / "asan" / "sessions" / f"{model_name}-{n_tokens}.json"
    if cache.exists():
        return Session.from_json(json.loads(cache.read_text()))
    preset = [] if model_name == "tiny" else ["--preset", model_name]
    cache.parent.mkdir(parents=True, exist_ok=True)
    model = realpeer.make_model(realpeer.REALPEER_HOME / "asan" / "sessions" / f"{model_name}.gguf", *preset)
    session = record(server_port, model, n_tokens=n_tokens)
    cache.write_text(json.dumps(session.to_json()))
    return session


@dataclass
class Finding:
    signature: str
    note: str
    verdict: Verdict
    ending: Ending
    mutation: Mutation | None
    frames: list[Frame]


@dataclass
class Stats:
    sessions: int = 0
    labels: Counter = field(default_factory=Counter)
    findings: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    t0: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        el = time.monotonic() - self.t0
        top = ", ".join(f"{k}={v}" for k, v in self.labels.most_common(8))
        return (f"{self.sessions} sessions in {el:.0f} s ({self.sessions / max(el, 1e-9):.1f}/s), "
                f"{sum(self.findings.values())} findings ({len(self.findings)} distinct); {top}")


def mutated_op(session_frames: list[Frame], m: Mutation | None) -> str:
    """The op name of the tensor a mutation touched (GRAPH_COMPUTE), else the command."""
    if m is None or m.frame >= len(session_frames):
        return "-"
    f = session_frames[m.frame]
    slots = tensor_slots(f)
    if f.cmd == CMD["GRAPH_COMPUTE"] and m.kind in ("tensor_field", "reshape", "retype") and m.slot < len(slots):
        op = _get(f.payload, slots[m.slot], "op")
        name = OPS.name(op) if OPS else None
        return name or f"op{op}"
    return f.name


def location(verdict: Verdict, ending: Ending) -> str:
    """What a rule must prevent: the kind of report and where it points (one reproducer each)."""
    if verdict.finding:
        return f"{verdict.kind}|{verdict.summary[:160]}"
    return f"{ending.ending}|no answer"


def signature(verdict: Verdict, ending: Ending, where: str) -> str:
    """``location`` and the op of the mutated tensor (counted, not stored separately)."""
    kind, what = location(verdict, ending).split("|", 1)
    return f"{kind}|{where}|{what}"


class Fuzzer:
    """The ASan server, `rpcguard serve` in front of it, and the replay loop."""

    def __init__(self, workdir: Path, *, findings_dir: Path | None = FINDINGS_DIR, tail: int = 3,
                 timeout_s: float = 10.0, log=print) -> None:
        self.workdir, self.findings_dir, self.tail, self.log = workdir, findings_dir, tail, log
        self.pki = Pki(workdir / "pki")
        self.server = SanServer(workdir)
        self.server.start()
        self.serve: Guard = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{self.server.port}",
                                                          "--log-format", "json", *self.pki.serve_args()])
        self.replayer = Replayer(self.serve, self.pki, timeout_s=timeout_s)
        self.stats = Stats()
        self.found: dict[str, Finding] = {}  # by location
        self.locations: dict[str, str] = {}  # signature -> location

    def close(self) -> None:
        self.serve.stop()
        self.server.stop()

    # one session ------------------------------------------------------------------------------
    def check(self, frames: list[Frame], buffers) -> tuple[Verdict, Ending]:
        """Replay ``frames`` and judge; the server is restarted after a finding or a hang."""
        if not self.server.alive():
            self.server.restart()
        self.server.mark()
        ending = self.replayer.run(frames, buffers)
        verdict = self.server.verdict()
        if verdict.finding or ending.ending in ("timeout", "slot_stuck"):
            self.server.restart()
        return verdict, ending

    def iteration(self, session: Session, m: Mutation) -> tuple[Verdict, Ending]:
        frames = apply(session, m)
        stop = min(len(frames), m.frame + 1 + self.tail)
        verdict, ending = self.check(frames[:stop], session.buffers)
        self.stats.sessions += 1
        self.stats.labels[ending.label] += 1
        if verdict.finding or ending.ending in ("timeout", "slot_stuck"):
            self.record_finding(session, m, frames[:stop], verdict, ending)
        return verdict, ending

    def run(self, session: Session, *, count: int, seed: int, minutes: float | None = None,
            report_every: int = 200) -> Stats:
        rng = random.Random(seed)
        mut = Mutator(session, rng)
        deadline = time.monotonic() + 60 * minutes if minutes else None
        for i in range(count):
            if deadline and time.monotonic() > deadline:
                break
            m = mut.pick()
            self.stats.kinds[m.kind] += 1
            self.iteration(session, m)
            if report_every and (i + 1) % report_every == 0:
                self.log(f"[fuzz] {self.stats.line()}")
        return self.stats

    # findings ---------------------------------------------------------------------------------
    def record_finding(self, session: Session, m: Mutation | None, frames: list[Frame], verdict: Verdict,
                       ending: Ending) -> Finding:
        where = mutated_op(session.frames, m) if m else "-"
        sig, loc = signature(verdict, ending, where), location(verdict, ending)
        self.stats.findings[sig] += 1
        self.locations[sig] = loc
        what = verdict.summary if verdict.finding else f"{ending.ending} (no answer in {ending.seconds:.1f} s)"
        note = f"{where}: {m.describe(session.frames) if m else 'corpus'} -> {what}; rpcguard: {ending.label}"
        self.log(f"[fuzz] FINDING {note}")
        if loc in self.found:
            return self.found[loc]
        small = self.shrink(frames, m, session.buffers, verdict, ending)
        finding = Finding(sig, note, verdict, ending, m, small)
        self.found[loc] = finding
        if self.findings_dir is not None:
            self.write(finding, session.buffers)
        return finding

    def shrink(self, frames: list[Frame], m: Mutation | None, buffers, verdict: Verdict,
               ending: Ending) -> list[Frame]:
        def reproduces(cand: list[Frame]) -> bool:
            v, e = self.check(cand, buffers)
            return v.kind == verdict.kind if verdict.finding else e.ending == ending.ending

        if m is None:
            return frames
        slot = m.slot if m.kind in ("tensor_field", "reshape", "retype") else None
        return shrink(frames, min(m.frame, len(frames) - 1), slot, reproduces, self.tail)

    def write(self, finding: Finding, buffers) -> Path:
        assert self.findings_dir is not None
        self.findings_dir.mkdir(parents=True, exist_ok=True)
        loc = location(finding.verdict, finding.ending)
        h = hashlib.sha256(loc.encode()).hexdigest()[:10]
        path = self.findings_dir / f"{finding.verdict.kind if finding.verdict.finding else finding.ending.ending}-{h}.json"
        obj = {
            "note": finding.note,
            "signature": finding.signature,
            "location": loc,
            "status": "open",  # open: rpcguard forwards it; fixed: a rule refuses it (the test enforces it)
            "verdict": finding.verdict.kind, "summary": finding.verdict.summary,
            "rpcguard": finding.ending.label,
            "mutation": finding.mutation.to_json() if finding.mutation else None,
            "server_log": finding.verdict.log[:3000],
            "session": encode_frames(finding.frames, buffers),
        }
        path.write_text(json.dumps(obj, indent=1) + "\n")
        return path




def decode_frames(obj: dict) -> tuple[list[Frame], dict[int, tuple[int, int]]]:
    frames = [Frame(d["cmd"], bytes.fromhex(d["hex"]) + bytes(d["zeros"]),
                    bytes.fromhex(d["answer"]) if d["answer"] is not None else None, d["length"])
              for d in obj["frames"]]
    return frames, {int(h): (v[0], v[1]) for h, v in obj["buffers"].items()}


def file_location(path: Path, obj: dict) -> str:
    """A reproducer's location (computed for files written before the field existed)."""
    if obj.get("location"):
        return obj["location"]
    if obj["verdict"] != "clean":
        return f"{obj['verdict']}|{obj['summary'][:160]}"
    return f"{path.name.split('-', 1)[0]}|no answer"


def dedupe(directory: Path) -> int:
    """One reproducer per location (the smallest); files named ``<kind>-<hash of location>.json``."""
    best: dict[str, tuple[int, Path, dict]] = {}
    for path in sorted(directory.glob("*.json")):
        obj = json.loads(path.read_text())
        loc = obj["location"] = file_location(path, obj)
        size = path.stat().st_size if "session" in obj else MAX_KEEP_BYTES + 1
        if loc not in best or size < best[loc][0]:
            best[loc] = (size, path, obj)
    removed = 0
    keep = {}
    for loc, (size, path, obj) in best.items():
        name = f"{loc.split('|', 1)[0]}-{hashlib.sha256(loc.encode()).hexdigest()[:10]}.json"
        if size > MAX_KEEP_BYTES:  # still needs the model's real data: keep the note, not the session
            obj.pop("session", None)
            obj["session_dropped"] = f"{size} bytes: the report needs the recorded tensor data (not shrinkable)"
        keep[name] = json.dumps(obj, indent=1) + "\n"
    for path in directory.glob("*.json"):
        if path.name not in keep:
            path.unlink()
            removed += 1
    for name, text in keep.items():
        (directory / name).write_text(text)
    return removed


def write_index(directory: Path) -> Path:
    """findings/README.md: one line per reproducer (file, status, note)."""
    rows = []
    for path in sorted(directory.glob("*.json")):
        obj = json.loads(path.read_text())
        status = obj.get("status") + ("" if "session" in obj else " (note only)")
        rows.append(f"| `{path.name}` | {status} | {obj['note'].replace('|', '/')} |")
    index = directory / "README.md"
    index.write_text("# Sanitizer fuzz findings\n\nReproducers written by `python -m tests.fuzz.sanitizer_fuzz` "
                     "(docs/sanitizer.md); replayed by tests/integration/test_sanitizer_fuzz.py. `open`: rpcguard "
                     "still forwards it; set `fixed` once a rule refuses it.\n\n| file | status | note |\n|---|---|---|\n"
                     + "\n".join(rows) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--minutes", type=float, help="stop after this long whatever the count")
    ap.add_argument("--model", default="tiny", help="make_tiny_model.py preset recorded (default tiny)")
    ap.add_argument("--tail", type=int, default=3, help="frames replayed after the mutated one")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds a graph may take (hang bound)")
    ap.add_argument("--findings", default=str(FINDINGS_DIR), help="where reproducers go ('' = nowhere)")
    ap.add_argument("--replay", nargs="*", help="replay these finding files instead of fuzzing")
    ap.add_argument("--refresh", action="store_true", help="with --replay: store the new server report in the file")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--dedupe", action="store_true", help="keep one reproducer per location in --findings, "
                    "rewrite its README.md, and exit")
    a = ap.parse_args(argv)
    if a.dedupe:
        removed = dedupe(Path(a.findings))
        print(f"removed {removed}; index: {write_index(Path(a.findings))}")
        return 0
    with tempfile.TemporaryDirectory(prefix="sanfuzz-") as tmp:
        fz = Fuzzer(Path(tmp), findings_dir=Path(a.findings) if a.findings else None, tail=a.tail,
                    timeout_s=a.timeout)
        try:
            if a.replay is not None:
                bad = 0
                for path in a.replay:
                    obj = json.loads(Path(path).read_text())
                    frames, buffers = decode_frames(obj["session"])
                    v, e = fz.check(frames, buffers)
                    if a.refresh and v.finding:
                        obj["server_log"] = v.log[:3000]
                        Path(path).write_text(json.dumps(obj, indent=1) + "\n")
                    bad += v.finding or e.ending in ("timeout", "slot_stuck")
                    print(f"{path}: {v.kind} {v.summary} | rpcguard: {e.label}")
                    if v.finding:
                        print("    " + "\n    ".join(v.log[:2500].splitlines()))
                return 1 if bad else 0
            session = load_session(Path(tmp), fz.server.port, a.model)
            base_v, base_e = fz.check(session.frames, session.buffers)
            print(f"[fuzz] baseline: {len(session.frames)} frames, {base_e.label}, server {base_v.kind} "
                  f"{base_v.summary}")
            if base_v.finding or base_e.label != "forwarded:ok":
                print("[fuzz] the unmutated real session is not clean: nothing to compare against")
                return 2
            stats = fz.run(session, count=a.count, seed=a.seed, minutes=a.minutes)
            print(f"[fuzz] done: {stats.line()}")
            for sig, n in stats.findings.most_common():
                print(f"  {n:5d}  {sig}")
            if fz.findings_dir is not None and fz.findings_dir.exists():
                dedupe(fz.findings_dir)
                write_index(fz.findings_dir)
            if a.json:
                Path(a.json).write_text(json.dumps({
                    "sessions": stats.sessions, "seconds": round(time.monotonic() - stats.t0, 1), "seed": a.seed,
                    "labels": dict(stats.labels), "kinds": dict(stats.kinds), "findings": dict(stats.findings),
                    "notes": {loc: f.note for loc, f in fz.found.items()}}, indent=1))
            return 1 if stats.findings else 0
        finally:
            fz.close()


if __name__ == "__main__":
    sys.exit(main())
