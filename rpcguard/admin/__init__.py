"""Operator commands the CLI runs: check (probe a node as llama.cpp would), status (read running instances' metrics), ops (what the firewall does with every graph op)."""
