"""Shared test support: real peers (ggml-rpc-server, llama.cpp client), rpcguard processes, PKI.

realpeer.py and llamarun.py start the real llama.cpp peers, guard.py the rpcguard processes and
their PKI; capture.py is the recording relay, rawclient.py a hand-written ggml-rpc client,
waiting.py the polling helpers; opsurvey.py decodes recorded graphs; tensorref.py is the
pre-typing RpcTensor kept as a reference; vectors.py the byte vectors of the spec.
"""
