"""Regression corpus of malicious ggml-rpc frames (one case per advisory, spec §5); see exploits.py."""

from tests.corpus.exploits import CASES, PREAMBLE_ALLOC_BYTES, Case, CaseContext, preamble_frames

__all__ = ["CASES", "Case", "CaseContext", "PREAMBLE_ALLOC_BYTES", "preamble_frames"]
