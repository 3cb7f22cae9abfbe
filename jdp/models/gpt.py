"""nanoGPT's GPT (docs/language_models.md, "Model"); for sampling, `decode` runs new tokens against a KV cache.
`scan_layers=True` stacks the blocks (`jdp.layers.Stack`): the same function and parameters on a leading layer axis,
but other dropout masks (each stacked block draws from its own split of the `dropout` stream)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.layers import Stack, check_remat, remat

Linear = Callable[..., nnx.Linear]  # nnx.Linear(in, out, kernel_init=...) with the block's bias, dtype and rngs
# Per block: keys and values, (B, block_size, heads, head_dim); scanned blocks: one pair, stacked (layers, B, ...).
Cache = list[tuple[jax.Array, jax.Array]] | tuple[jax.Array, jax.Array]


def attention_implementation(dtype: jnp.dtype) -> str:
    """cuDNN's fused attention on GPU in bf16/fp16; XLA's everywhere else."""
    on_gpu = jax.default_backend() == "gpu"
    return "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, **kwargs: Any) -> jax.Array:
    """`jax.nn.dot_product_attention`, float16 on CPU in float32 (XLA:CPU has no float16 dot with float32 sums)."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":  # where the implementation is "xla"
        return jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), **kwargs).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, **kwargs)


class CausalSelfAttention(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, dropout: float, linear: Linear, residual_std: float,
                 rngs: nnx.Rngs):
        if embed_dim % num_heads:
            raise ValueError(f"gpt: embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = linear(embed_dim, 3 * embed_dim, kernel_init=nnx.initializers.normal(0.02))
        self.proj = linear(embed_dim, embed_dim, kernel_init=nnx.initializers.normal(residual_std))
        self.attn_dropout = nnx.Dropout(dropout, rngs=rngs)
        self.resid_dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None,
                 start: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the T positions of `x` to themselves (cache None), or to the cache's positions
        before `start` and themselves (their keys and values written into the cache at `start`)."""
        b, t, d = x_BxTxD.shape
        q, k, v = jnp.split(self.qkv(x_BxTxD).reshape(b, t, 3 * self.num_heads, d // self.num_heads), 3, axis=2)
        if cache is not None:
            k = jax.lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), (0, start, 0, 0))
            v = jax.lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), (0, start, 0, 0))
            visible_TxS = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(t)[:, None]
            y = _attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=visible_TxS)
        elif self.attn_dropout.rate > 0 and not self.attn_dropout.deterministic:
            y = self._explicit(q, k, v)
        else:
            y = _attention(q, k, v, is_causal=True, implementation=attention_implementation(q.dtype))
        return self.resid_dropout(self.proj(y.reshape(b, t, d))), (k, v)

    def _explicit(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Causal attention written out, for dropout on its weights (dot_product_attention has none)."""
        t = q.shape[1]
        scores_BxHxTxT = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores_BxHxTxT = jnp.where(causal, scores_BxHxTxT.astype(jnp.float32), -jnp.inf)
        weights = self.attn_dropout(jax.nn.softmax(scores_BxHxTxT, axis=-1)).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def gelu(x: jax.Array) -> jax.Array:
    """The exact GELU as PyTorch computes it, x/2 (1 + erf(x/sqrt 2)): jax.nn.gelu(approximate=False)'s erfc form has a
    costly gradient, ~25% of the CPU config's fwd+bwd (docs/benchmarks.md, "Where the GPT's step time goes")."""
    return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))).astype(x.dtype))


class MLP(nnx.Module):
    def __init__(self, embed_dim: int, dropout: float, linear: Linear, residual_std: float, rngs: nnx.Rngs):
        self.fc = linear(embed_dim, 4 * embed_dim, kernel_init=nnx.initializers.normal(0.02))
        self.proj = linear(4 * embed_dim, embed_dim, kernel_init=nnx.initializers.normal(residual_std))
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.proj(gelu(self.fc(x))))


class Block(nnx.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, embed_dim: int, num_heads: int, dropout: float, bias: bool, residual_std: float,
                 dtype: jnp.dtype | None, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=bias, dtype=dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(embed_dim, epsilon=1e-5, use_bias=bias, dtype=dtype, rngs=rngs)
        self.attn = CausalSelfAttention(embed_dim, num_heads, dropout, linear, residual_std, rngs)
        self.ln2 = nnx.LayerNorm(embed_dim, epsilon=1e-5, use_bias=bias, dtype=dtype, rngs=rngs)
        self.mlp = MLP(embed_dim, dropout, linear, residual_std, rngs)

    def __call__(self, x: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None,
                 start: jax.Array | int = 0) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        attended, kv = self.attn(self.ln1(x), cache, start)
        x = x + attended
        return x + self.mlp(self.ln2(x)), kv


class GPT(nnx.Module):
    """`GPT(vocab_size, block_size, ...)(tokens_BxT)` -> next-token logits (B, T, vocab_size), T <= block_size."""

    def __init__(self, vocab_size: int, block_size: int, *, num_layers: int = 6, num_heads: int = 6,
                 embed_dim: int = 384, dropout: float = 0.0, bias: bool = True, dtype: jnp.dtype | None = None,
                 remat: str = "none", scan_layers: bool = False, rngs: nnx.Rngs):
        """`dtype`: the compute dtype (None: the parameters'), parameters being float32. `remat`: "none", "full" or
        "dots" (each block's activations checkpointed); `scan_layers`: the blocks stacked and scanned."""
        self.block_size, self.dtype, self.remat = block_size, dtype, check_remat(remat)
        self.num_layers, self.num_heads, self.scanned = num_layers, num_heads, scan_layers
        # GPT-2: normal(0.02), the projections into the residual stream scaled by 1/sqrt(2 x layers).
        residual_std = 0.02 / math.sqrt(2 * num_layers)
        normal = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(vocab_size, embed_dim, embedding_init=normal, dtype=dtype, rngs=rngs)
        self.wpe = nnx.Embed(block_size, embed_dim, embedding_init=normal, dtype=dtype, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        block = functools.partial(Block, embed_dim, num_heads, dropout, bias, residual_std, dtype)  # of rngs
        self.blocks = (Stack(block, num_layers, rngs=rngs, remat=remat) if scan_layers
                       else nnx.List([block(rngs) for _ in range(num_layers)]))
        self.ln_f = nnx.LayerNorm(embed_dim, epsilon=1e-5, use_bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        return self.decode(tokens_BxT, None, 0)[0]

    def empty_cache(self, batch: int) -> Cache:
        """Zero keys and values for `block_size` positions of every block, in the compute dtype."""
        d = self.wte.embedding[...].shape[1]
        shape = (batch, self.block_size, self.num_heads, d // self.num_heads)
        dtype = self.dtype or self.wte.embedding[...].dtype
        if self.scanned:
            return jnp.zeros((self.num_layers, *shape), dtype), jnp.zeros((self.num_layers, *shape), dtype)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in self.blocks]

    def decode(self, tokens_BxT: jax.Array, cache: Cache | None, start: jax.Array | int) -> tuple[jax.Array, Cache]:
        """Logits of tokens at positions start..start+T-1, attending to the cache before them (None: a plain forward
        pass); the new cache. start + T must not pass block_size (the caller crops the context and starts again)."""
        t = tokens_BxT.shape[1]
        if t > self.block_size:
            raise ValueError(f"gpt: a sequence of {t} tokens is longer than block_size {self.block_size}")
        positions = start + jnp.arange(t)
        # By hand, not through nnx.Embed (whose dtype=None means float32): in `dtype`, else the parameters' dtype.
        wte = self.wte.embedding[...]
        dtype = self.dtype or wte.dtype
        x = self.drop((wte[tokens_BxT] + self.wpe.embedding[...][positions][None]).astype(dtype))
        if self.scanned and cache is None:
            x, new_cache = self.blocks(x, call=lambda block, x: (block(x)[0], None))
        elif self.scanned:
            x, new_cache = self.blocks(x, *cache, call=lambda block, x, k, v: block(x, (k, v), start))
        else:
            new_cache = []
            for i, block in enumerate(self.blocks):
                if cache is None:  # training or scoring: the keys and values are not kept
                    x, kv = remat(lambda block, x: block(x), self.remat)(block, x)
                else:
                    x, kv = block(x, cache[i], start)
                new_cache.append(kv)
        x = self.ln_f(x)
        return x @ wte.T.astype(x.dtype), new_cache  # the head is the token embedding, transposed

    def describe(self) -> str:
        path = attention_implementation(self.dtype or jnp.float32)
        explicit = "; explicit softmax while training (attention dropout)" if self.drop.rate and self.num_layers else ""
        layers = (f"; {self.num_layers} blocks scanned" if self.scanned else "") + (
            f"; remat {self.remat}" if self.remat != "none" else "")
        return f"attention: jax.nn.dot_product_attention ({path}){explicit}{layers}"


def non_embedding_params(params: dict) -> int:
    """The N of the 6N FLOPs-per-token estimate: a GPT's parameters but the position embedding."""
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))  # arrays or shapes (ShapeDtypeStruct)
    return total - math.prod(params["wpe"]["embedding"].shape)


def flops_per_token(params: dict, num_layers: int, block_size: int, embed_dim: int) -> int:
    """Training FLOPs per token: 6N + 12 x layers x block x width (attention, as in the PaLM paper's appendix)."""
    return 6 * non_embedding_params(params) + 12 * num_layers * block_size * embed_dim
