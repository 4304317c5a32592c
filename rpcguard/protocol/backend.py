"""Which ggml backend runs behind a device of the upstream, and its layer of the rules.

How this works: the protocol carries no backend name, but a server says enough about itself:
GET_ALIGNMENT answers 32 on the CPU backend (TENSOR_ALIGNMENT, ggml-impl.h:44) and 128 on CUDA
(ggml-cuda.cu:897-901); CUDA's GET_ALLOC_SIZE answers pad a quantized tensor whose ne0 is not a
multiple of 512 (ggml-cuda.cu:911-917), the CPU's never pad; and a server serve runs prints its
devices at start ("  CUDA0: NVIDIA H200 (...)", ggml-rpc.cpp:2103-2108). ``detect`` reads the
first two from a session's ``UpstreamFacts``; ``parse_banner`` the third. The operator's setting
(``policy.backend``: auto, cpu or cuda) is checked against them by ``resolve``:

* the setting and the server agree, or the server has said nothing yet: the setting's layer
  (``auto`` with nothing said: the CPU layer, which adds nothing to the constructor rules);
* ``auto`` and the server says cpu or cuda: that layer;
* they disagree: ``backend_mismatch``, and an answer no backend known here gives (an alignment
  other than 32 or 128): ``backend_unknown``. Both are refusals of the session's graphs, so they
  are logged and counted like every refusal, and a CUDA node is never held to the CPU's rules.

``check_backend`` is the hook graph.py calls after a node passed its constructor row and its
reach; ``check_alloc_command`` the one checks.py calls for GET_ALLOC_SIZE and INIT_TENSOR.
Sans-IO: only the facts a session learned and the policy's setting go in.
"""

from __future__ import annotations

import re
from typing import Final, Mapping, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.cudascratch import check_scratch
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules import cuda, cudafusion
from rpcguard.protocol.oprules.base import OpRule, Srcs
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.tensor import RpcTensor

__all__ = ["SETTINGS", "LAYERS", "ALIGNMENT_OF", "detect", "resolve", "parse_banner", "backend_layer", "check_backend",
           "check_fusions", "check_alloc_command"]

#: what ``policy.backend`` accepts: ``auto`` (detected per session and device) or a layer's name
LAYERS: Final = ("cpu", "cuda")
SETTINGS: Final = ("auto", *LAYERS)
#: GET_ALIGNMENT answer -> backend (ggml-impl.h:44 TENSOR_ALIGNMENT 32 via ggml-backend.cpp:2615;
#: ggml-cuda.cu:897-901 returns 128)
ALIGNMENT_OF: Final[Mapping[int, str]] = {32: "cpu", cuda.ALIGNMENT: "cuda"}
# A device line of the server's banner: "  CUDA0: NVIDIA H200 (143771 MiB, 142000 MiB free)",
# "  CPU: AMD EPYC ... (...)" (ggml-rpc.cpp:2108 prints ggml_backend_dev_name: description)
_DEVICE_LINE: Final = re.compile(r"^\s+([A-Za-z][A-Za-z_-]*?)(\d*): .*\(\d+ MiB, \d+ MiB free\)\s*$")


_ZERO: Final = RpcTensor._make([0] * (len(RpcTensor._fields) - 2) + [b"", 0])


def _padding_seen(alloc_sizes: Mapping[tuple[int, ...], int], device: int) -> bool | None:
    """True when a GET_ALLOC_SIZE answer on ``device`` padded a quantized row as CUDA does, False
    when an answer for a tensor CUDA would pad was its plain size, None when no answer tells. The
    keys are tensor.alloc_size_key's: device, type, ne0..3, nb0..3, op (0: not FLASH_ATTN_EXT)."""
    for key, size in alloc_sizes.items():
        if len(key) != 11 or key[0] != device or key[10] != 0 or key[1] not in TYPES:
            continue
        t = _ZERO._replace(type=key[1], ne0=key[2], ne1=key[3], ne2=key[4], ne3=key[5], nb0=key[6], nb1=key[7],
                           nb2=key[8], nb3=key[9])
        plain, padded = cuda.alloc_size(t, pad=False), cuda.alloc_size(t)
        if plain != padded and size in (plain, padded):
            return size == padded
    return None


def detect(state: SessionState, device: int) -> str | None:
    """What the server said about ``device``'s backend: "cpu", "cuda", "unknown alignment N",
    or None when it has said nothing that tells."""
    facts = state.upstream
    align = facts.alignment.get(device)
    if align is not None:
        return ALIGNMENT_OF.get(align, f"unknown alignment {align}")
    padded = _padding_seen(facts.alloc_sizes, device)
    if padded is None:
        return None
    return "cuda" if padded else "cpu"


def resolve(setting: str, detected: str | None) -> str:
    """The layer for a device: ``setting`` (policy.backend) against what the server said
    (``detect``); raises ``backend_mismatch`` / ``backend_unknown`` (see the module docstring)."""
    if detected is not None and detected not in LAYERS:
        raise FirewallRefusal("backend_unknown",
                              f"the server answered {detected}: no backend known here does; set policy.backend "
                              f"({', '.join(LAYERS)}) only for a server of that backend")
    if setting == "auto":
        return detected or "cpu"
    if detected is not None and detected != setting:
        raise FirewallRefusal("backend_mismatch",
                              f"policy.backend is {setting} but the server's answers are those of {detected} "
                              "(GET_ALIGNMENT / GET_ALLOC_SIZE): fix the setting or the server")
    return setting


def parse_banner(text: str) -> dict[int, str]:
    """Device index (in the server's order, which -d sets) -> backend name, from the start-up
    lines of ggml-rpc-server (ggml-rpc.cpp:2103-2108): "CUDA0" -> cuda, "CPU" -> cpu, any other
    device name lower-cased without its number (vulkan, metal ...)."""
    out: dict[int, str] = {}
    in_devices = False
    for line in text.splitlines():
        if line.strip() == "Devices:":
            in_devices = True
            continue
        if in_devices:
            m = _DEVICE_LINE.match(line)
            if m is None:
                in_devices = line.startswith("  ") and ":" in line
                continue
            out[len(out)] = m.group(1).lower()
    return out


def backend_layer(setting: str, state: SessionState, device: int) -> str:
    """The layer of the rules for ``device`` in this session (resolve of what it detected)."""
    return resolve(setting, detect(state, device))


def check_backend(layer: str, rule: OpRule, node: RpcTensor, srcs: Srcs, state: SessionState, strict: bool,
                  scratch_budget: int = 0) -> None:
    """The backend layer (``backend_layer``) for one node that passed its constructor row (graph.py
    calls it): nothing on the CPU, the CUDA rows and reach (oprules/cuda.py) and the pool scratch
    (cudascratch.py, refused above ``scratch_budget``; 0: none) on CUDA. ``strict``: the buffer
    checks are on (the reach needs the buffers' bases)."""
    if layer != "cuda":
        return
    cuda.check_node(rule.op, node, srcs)
    check_scratch(rule.op, node, srcs, scratch_budget)
    if strict:
        for t, n in cuda.reach(rule.op, node, srcs):
            _in_buffer(t, n, state, f"node id={node.id:#x} op {rule.op} on CUDA")


def check_fusions(g: cudafusion.FusionGraph, starts: Sequence[int], state: SessionState, strict: bool) -> None:
    """The CUDA pair rules (oprules/cudafusion.py) of one graph whose nodes each passed: the top-k
    matcher's tail, then the rule of each node in ``starts`` (those whose op starts a fused
    pattern); what a fused kernel reads past the nodes' tensors is kept inside their buffers
    (``strict``: the buffer checks are on). A rule that passed is remembered under the bytes of
    the nodes it looked at and their sources (``FusionGraph.key``), as the node verdicts are."""
    if not g.n:
        return
    cudafusion.check_tail(g)
    for i in starts:
        n = cudafusion.span(g, i)
        if not n:
            continue
        key = g.key(i, n)
        if key is not None and g.cached(key):
            continue
        for t, nbytes in cudafusion.check_node(g, i):
            if strict:
                _in_buffer(t, nbytes, state, f"the nodes from id={g.nid(i):#x} (op {g.op(i)}) fused on CUDA")
        if key is not None:
            g.remember(key)


def _in_buffer(t: RpcTensor, n: int, state: SessionState, who: str) -> None:
    buf = state.buffers.get(t.buffer)
    if buf is None or buf.base is None:
        return
    end = t.data - buf.base + n
    if end > buf.size:
        raise FirewallRefusal(
            "backend_reach_out_of_buffer",
            f"tensor id={t.id:#x}: {who} addresses {n} bytes from its data, to byte {end} of its {buf.size}-byte buffer",
        )


def check_alloc_command(setting: str, command: str, t: RpcTensor, srcs: Srcs, state: SessionState,
                        device: int) -> None:
    """GET_ALLOC_SIZE (``srcs``: its sources, None where the id is 0) and INIT_TENSOR (``srcs`` empty) on a
    CUDA device: what CUDA's get_alloc_size asserts (cuda.check_alloc_tensor, FLASH_ATTN_EXT's
    sources, fattn.cu:553,729-730), and INIT_TENSOR's zeroed padding inside the buffer
    (ggml-cuda.cu:750-769: every quantized INIT_TENSOR writes it, asked for or not)."""
    if backend_layer(setting, state, device) != "cuda":
        return
    cuda.check_alloc_tensor(t, command)
    if command == "GET_ALLOC_SIZE" and t.op == _fa_op(state):
        q = srcs[0] if len(srcs) > 0 else None
        k = srcs[1] if len(srcs) > 1 else None
        v = srcs[2] if len(srcs) > 2 else None
        if q is None or k is None or v is None or not k.ne2 or q.ne2 % k.ne2:
            raise FirewallRefusal("backend_unsupported_op",
                                  f"GET_ALLOC_SIZE of a FLASH_ATTN_EXT tensor id={t.id:#x} without non-empty q, k, v "
                                  "(q.ne2 a multiple of k.ne2): CUDA asserts or divides by zero (fattn.cu:553,729-730)")
    if command == "INIT_TENSOR":
        pad = cuda.alloc_size(t)
        buf = state.buffers.get(t.buffer)
        if buf is not None and buf.base is not None and t.data - buf.base + pad > buf.size:
            raise FirewallRefusal("backend_reach_out_of_buffer",
                                  f"INIT_TENSOR id={t.id:#x}: CUDA zeroes its padded size {pad} from {t.data:#x}, past "
                                  f"the end of buffer {buf.handle:#x} (ggml-cuda.cu:758-766)")


def _fa_op(state: SessionState) -> int:
    from rpcguard.protocol.ggml import op_table

    spec = state.spec
    table = op_table(spec.version) if spec is not None else None
    return table.ids.get("FLASH_ATTN_EXT", -1) if table is not None else -1
