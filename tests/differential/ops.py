"""Every generator of the differential oracle, registered by importing its module.

The generators live in gen_basic.py, gen_nn.py and gen_conv.py; the Case/recipe-builder machinery
and the registry in cases.py (its docstring says how a generator describes its op call).
"""

from __future__ import annotations

from tests.differential import gen_basic, gen_conv, gen_nn  # noqa: F401  (registration)
from tests.differential.cases import FLOAT, GENERATORS, KEEP, QUANT, UNBUILDABLE, Case, R

__all__ = ["Case", "R", "GENERATORS", "QUANT", "FLOAT", "KEEP", "UNBUILDABLE"]
