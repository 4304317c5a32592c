"""rpcguard: mutual-TLS tunnel and frame firewall for llama.cpp's ggml RPC protocol."""

__all__ = ["__version__"]

__version__ = "0.1.0"
