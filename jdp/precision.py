"""Mixed precision: the cast to the compute dtype, and what the dots and convolutions of the program jdp asks for
compute in (jaxpr, or HLO before XLA's passes: XLA:CPU upcasts bfloat16 products in its own)."""

from __future__ import annotations

import collections
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import subjaxprs

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}  # of each `precision`
_MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")
# `name = bf16[8,8]{1,0} convolution(...)` / `dot(...)` in `Lowered.as_text(dialect="hlo")`
_HLO_MATMUL = re.compile(r"=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+(?:convolution|dot)\(")


def slower_than_fp32(precision: str, platform: str) -> str | None:
    """Why `precision` makes the step no faster than float32 on `platform`'s devices (XLA:CPU's), or None."""
    if platform != "cpu" or precision == "fp32":
        return None
    return (f"precision={precision} runs no faster than fp32 on CPU devices: XLA:CPU's {precision} matmuls are "
            "slower than its float32 ones (the CPU GPT recipe: 60 against 44 ms of matmul time a step, the whole "
            "step no faster; docs/benchmarks.md), so it saves memory here, not time; precision=fp32 is the CPU's")


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Every floating leaf of `tree` cast to `dtype`; integer leaves (token ids, labels) as they are."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def hlo_matmul_dtypes(hlo_text: str) -> collections.Counter[str]:
    """How many dots and convolutions of an HLO module produce each dtype (`bf16`, `f32`, ...)."""
    return collections.Counter(_HLO_MATMUL.findall(hlo_text))


def jaxpr_matmul_dtypes(jaxpr: Any) -> collections.Counter[str]:
    """The same count on a (closed) jaxpr, nested jaxprs (jit, custom_vjp, scan, ...) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    counts = collections.Counter(str(v.aval.dtype) for eqn in jaxpr.eqns if eqn.primitive.name in _MATMUL_PRIMITIVES
                                 for v in eqn.outvars)
    return sum((jaxpr_matmul_dtypes(sub) for sub in subjaxprs(jaxpr)), counts)


def summary(counts: collections.Counter[str]) -> str:
    """`62 dots/convolutions: 62 bf16`, for logs."""
    return f"{sum(counts.values())} dots/convolutions: " + ", ".join(f"{n} {d}" for d, n in counts.most_common())
