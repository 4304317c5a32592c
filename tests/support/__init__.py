"""Shared test support: real peers (ggml-rpc-server, llama.cpp client), rpcguard processes, PKI."""
