"""The README's quick start and the example configs work on one host: no two of ggml-rpc-server,
serve, connect and their metrics want the same port, each points at the next, and the
llama-cpp-python pitfall is written down."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def quick_start() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    return section[:section.index("\n## ", 3)]


def port(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, pattern
    return int(m.group(1))


def test_the_quick_start_ports_fit_on_one_host():
    qs = quick_start()
    server = port(qs, r"ggml-rpc-server -H 127\.0\.0\.1 -p (\d+)")
    serve_listen = port(qs, r"rpcguard serve --listen [\d.]+:(\d+)")
    serve_up = port(qs, r"--upstream 127\.0\.0\.1:(\d+)")
    connect_listen = port(qs, r"rpcguard connect --listen 127\.0\.0\.1:(\d+)")
    connect_server = port(qs, r"--server node1\.lab:(\d+)")
    rpc = port(qs, r"llama-server -m model\.gguf --rpc 127\.0\.0\.1:(\d+)")
    assert serve_up == server and connect_server == serve_listen and rpc == connect_listen
    bound = [server, serve_listen, connect_listen, 9450, 9451]  # + both default metrics ports
    assert len(set(bound)) == len(bound), bound
    assert "does not resolve" in qs or "--server-name" in qs  # the hint for a name without DNS


def test_the_example_configs_fit_on_one_host():
    serve = yaml.safe_load((ROOT / "config" / "serve.example.yaml").read_text())
    connect = yaml.safe_load((ROOT / "config" / "connect.example.yaml").read_text())
    ports = [int(x["listen"].rsplit(":", 1)[1]) for x in serve["listeners"]]
    # (a server serve runs has no port of its own on the host: a namespace each)
    ports += [int(x["upstream"].rsplit(":", 1)[1]) for x in serve["listeners"] if isinstance(x["upstream"], str)]
    ports += [int(x["listen"].rsplit(":", 1)[1]) for x in connect["tunnels"]]
    ports += [int(c["metrics"]["listen"].rsplit(":", 1)[1]) for c in (serve, connect)]
    assert len(set(ports)) == len(ports), ports


def test_the_llama_cpp_python_pitfall_is_in_the_readme():
    qs = quick_start()
    assert "rpc_servers" in qs and "0.3.36" in qs and "ggml_backend_rpc_add_server" in qs and "GGML_RPC=ON" in qs


def test_the_quick_start_and_the_example_contain_the_server_for_shared_nodes():
    """issue 28.6: the quick start and config/serve.example.yaml run `serve -- ggml-rpc-server`
    (one sandboxed process per session); --upstream is shown as the single-tenant form."""
    qs = quick_start()
    serve_cmd = qs[qs.index("rpcguard serve --listen"):]
    serve_cmd = serve_cmd[:serve_cmd.index("\n\n") if "\n\n" in serve_cmd else None].split("\n#")[0]
    assert re.search(r"-- \S*ggml-rpc-server", serve_cmd) and "--upstream" not in serve_cmd, serve_cmd
    assert "Single-tenant" in qs and "SHARED UPSTREAM" in qs
    serve = yaml.safe_load((ROOT / "config" / "serve.example.yaml").read_text())
    assert all(isinstance(x["upstream"], dict) and x["upstream"]["exec"][0] == "ggml-rpc-server"
               for x in serve["listeners"])
