"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as PyTorch's DDP hook `powerSGD_hook` runs it: each
device's gradient matrix plus its error feedback becomes P Q^T of rank r, one power iteration warm-started from the
last step's Q. The scheme, which leaves are matrices and the start step: docs/communication.md, 'PowerSGD'.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.errors import FitError
from jdp.sync.base import (
    DDPTwin,
    Local,
    Reduced,
    Sync,
    Tree,
    all_reduce_mean,
    averaged_sums,
    path_keys,
    real_number,
    whole_number,
)

EPSILON = 1e-8  # Gram-Schmidt's guard against a zero column (a rank-deficient P), as torch's hook uses


class Matrix(NamedTuple):
    """How one parameter is compressed: `layers` stacked (n x m) matrices at rank `rank`."""

    layers: int
    n: int
    m: int
    rank: int


def _candidates(model: nnx.Module, params: Tree) -> dict[str, tuple[int, int, int]]:
    """Every parameter that is a stack of matrices ("a.b.kernel" -> (layers, n, m))."""
    ranks = {}  # of each parameter of a layer of known type on its own (path in the parameter tree -> rank)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Conv):
            ranks[(*path, "kernel")] = len(node.kernel_size) + 2
        elif isinstance(node, nnx.Linear | nnx.Embed):
            ranks[(*path, "kernel")] = ranks[(*path, "embedding")] = 2
        elif isinstance(node, nnx.LayerNorm | nnx.BatchNorm | nnx.RMSNorm | nnx.GroupNorm):
            ranks[(*path, "scale")] = 1
        else:
            continue
        ranks[(*path, "bias")] = 1
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = path_keys(path)
        own = ranks.get(keys, leaf.ndim)
        if own >= 2:
            stack = leaf.shape[:leaf.ndim - own]
            found[".".join(str(k) for k in keys)] = (math.prod(stack), math.prod(leaf.shape[len(stack):-1]),
                                                     leaf.shape[-1])
    return found


def matrices(model: nnx.Module, params: Tree, rank: int, min_compression_rate: float = 1) -> dict[str, Matrix]:
    """The parameters PowerSGD compresses ("a.b.kernel" -> its Matrix, at rank min(rank, n, m)): those for which
    r (n + m) min_compression_rate < n m, as torch decides; the others go whole."""
    return {name: Matrix(layers, n, m, min(rank, n, m)) for name, (layers, n, m) in _candidates(model, params).items()
            if min(rank, n, m) * (n + m) * min_compression_rate < n * m}


def orthonormal(p: jax.Array) -> jax.Array:
    """Gram-Schmidt over the columns of each (n x r) matrix of `p` (layers, n, r)."""
    columns = []
    for i in range(p.shape[-1]):
        col = p[..., i]
        for done in columns:
            col = col - jnp.sum(done * col, axis=-1, keepdims=True) * done
        columns.append(col / (jnp.linalg.norm(col, axis=-1, keepdims=True) + EPSILON))
    return jnp.stack(columns, axis=-1)


def needs(what: str, view: Any) -> str:
    """Why PowerSGD refuses a setting (the flags and the object alike), naming the options as `view` does."""
    return (f"{what} compresses each device's gradient before its all-reduce: it needs a per-device step "
            f"({view.use('backend', 'shard_map')} or pmap), {view('sync_every')}=1, {view('shard_optimizer')}=False, "
            f"{view('log_noise_scale')}=False and {view('allreduce_dtype')}=fp32")


class PowerSGD(Sync):
    """Every gradient goes whole before `start_step`, and a matrix always if r (n + m) floats do not shrink it by
    `min_compression_rate` (torch's PowerSGDState `start_powerSGD_iter` and `min_compression_rate`)."""

    matrices: dict[str, Matrix] = {}
    per_device_state = ("error",)
    seed = 0

    def __init__(self, rank: int = 4, start_step: int = 10, min_compression_rate: float = 1) -> None:
        super().__init__()
        self.rank, self.start_step = whole_number("rank", rank, 1), whole_number("start_step", start_step, 0)
        if not real_number("min_compression_rate", min_compression_rate) >= 1:
            raise ValueError(f"min_compression_rate={min_compression_rate!r} must be at least 1")
        self.min_compression_rate = min_compression_rate

    def params(self) -> dict[str, Any]:
        rate = {"min_compression_rate": self.min_compression_rate} if self.min_compression_rate != 1 else {}
        return {"rank": self.rank, "start_step": self.start_step, **rate}  # left out at 1: old records match

    def ddp_twin(self) -> DDPTwin:
        if self.start_step < 2:
            raise ValueError(f"{self!r}: DDP's powerSGD_hook starts compressing at step 2 at the earliest (its error "
                             "feedback needs a step before); start at step 2 or later")
        return DDPTwin("powerSGD_hook", {"matrix_approximation_rank": self.rank, "start_powerSGD_iter": self.start_step,
                                         "min_compression_rate": self.min_compression_rate,
                                         "orthogonalization_epsilon": EPSILON})

    def bind(self, model: nnx.Module, seed: int) -> PowerSGD:
        bound = copy.copy(self)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        bound.matrices, bound.seed = matrices(model, params, self.rank, self.min_compression_rate), seed
        if not bound.matrices:  # the largest rank at which some parameter is compressed (0: none can be)
            useful = max((math.ceil(n * m / ((n + m) * self.min_compression_rate)) - 1
                          for _, n, m in _candidates(model, params).values()), default=0)
            raise FitError(f"{self!r} compresses none of this model's gradient matrices: at rank {self.rank} each "
                           "would send as much as it whole" + (f"; use a rank of at most {useful}" if useful else
                                                                "; it has no matrix to compress"))
        return bound

    def check(self, options: dict[str, Any], view: Any, what: str, require: Any) -> None:
        require(options["backend"] in ("shard_map", "pmap") and not options["log_noise_scale"], needs(what, view))

    def init_state(self, params: Tree, num_devices: int) -> Tree:
        keys = jax.random.split(jax.random.key(self.seed), max(1, len(self.matrices)))
        return {"q": {name: jax.random.normal(key, (a.layers, a.m, a.rank), jnp.float32)
                      for key, (name, a) in zip(keys, self.matrices.items(), strict=False)},
                "error": {name: jnp.zeros((num_devices, a.layers, a.n, a.m), jnp.float32)
                          for name, a in self.matrices.items()}}

    def reduce(self, local: Local, state: Any, axis_name: str | None, collective: bool = True) -> Reduced:
        def whole(local: Local, state: Any) -> Reduced:
            return super(PowerSGD, self).reduce(local, state, axis_name, collective)._replace(sync_state=state.sync)

        compressed = functools.partial(self._compressed, axis_name if collective else None)
        if not self.start_step:
            return compressed(local, state)
        # The steady state in the true branch, where `jdp.hlo` counts a conditional's bytes.
        return jax.lax.cond(state.step >= self.start_step, compressed, whole, local, state)

    def _compressed(self, axis: str | None, local: Local, state: Any) -> Reduced:
        grads = {".".join(map(str, path_keys(path))): g for path, g in jax.tree_util.tree_flatten_with_path(
            local.grads)[0]}
        q, error = state.sync["q"], state.sync["error"]
        m_of = {name: grads[name].reshape(a.layers, a.n, a.m) + error[name] for name, a in self.matrices.items()}
        averaged = averaged_sums(local, axis, whole={k: g for k, g in grads.items() if k not in self.matrices},
                                 p={name: jnp.einsum("lnm,lmr->lnr", m, q[name]) for name, m in m_of.items()})
        p = {name: orthonormal(x) for name, x in averaged["p"].items()}
        new_q = all_reduce_mean({name: jnp.einsum("lnm,lnr->lmr", m, p[name]) for name, m in m_of.items()}, axis)
        approx = {name: jnp.einsum("lnr,lmr->lnm", p[name], new_q[name]) for name in m_of}
        flat_mean = {**averaged["whole"], **{name: approx[name].reshape(grads[name].shape) for name in approx}}
        mean = jax.tree.unflatten(jax.tree.structure(local.grads), [flat_mean[k] for k in grads])
        sync_state = {"q": new_q, "error": {name: m_of[name] - approx[name] for name in m_of}}
        return self._reduced(mean, local, averaged, sync_state)
