"""A sync strategy written outside jdp, on its public seam: sign compression with error feedback (Karimireddy et
al. 2019, "Error feedback fixes SignSGD"). docs/communication.md prints the same class."""

import jax
import jax.numpy as jnp

from jdp.sync import Sync
from jdp.sync.base import PER_DEVICE, Reduced, all_reduce_mean, floating, merge_floating


class SignEF(Sync):
    """Each device sends the signs of gradient + error, 8 to a byte, and one float32 scale per leaf (the mean
    absolute value); every device averages the devices' scaled signs, and keeps what its signs missed as its error."""

    def __init__(self, error_feedback: bool = True):
        super().__init__()
        self.error_feedback = error_feedback

    def params(self):  # what defines its numerics: recorded, and compared on resume
        return {"error_feedback": self.error_feedback}

    def init_state(self, params, num_devices):  # one error buffer per device
        return {"error": jax.tree.map(lambda p: jnp.zeros((num_devices, *p.shape), jnp.float32), params)}

    def layouts(self, abstract_state):
        layouts = super().layouts(abstract_state)
        return layouts._replace(sync={"error": jax.tree.map(lambda _: PER_DEVICE, abstract_state.sync["error"])})

    def check(self, options, view, what, require):
        require(options["backend"] in ("shard_map", "pmap"), f"{what} keeps each device's own error: it needs a "
                f"per-device step; use {view.use('backend', 'shard_map')}")

    def reduce(self, local, state, axis_name, collective=True):
        axis = axis_name if collective else None
        gather = (lambda x: jax.lax.all_gather(x, axis)) if axis else (lambda x: x[None])

        def compress(g, e):
            p = g + e if self.error_feedback else g
            scale = jnp.mean(jnp.abs(p))
            bits = jnp.packbits(p.reshape(-1) >= 0)  # the wire: uint8, 8 signs each
            signs = jnp.unpackbits(gather(bits), axis=-1, count=p.size).astype(bool)  # (devices, size)
            scales = gather(scale)[:, None]
            mean = jnp.mean(jnp.where(signs, scales, -scales), axis=0).reshape(p.shape)
            mine = jnp.where(p >= 0, scale, -scale)
            return mean, p - mine

        pairs = jax.tree.map(compress, local.grads, state.sync["error"])
        mean = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=lambda x: isinstance(x, tuple))
        error = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=lambda x: isinstance(x, tuple))
        averaged = all_reduce_mean({"model_state": floating(local.model_state), "sums": local.sums,
                                    "weight": local.weight}, axis)
        return Reduced(self._of_mean(mean, local.rows, averaged["weight"]), averaged["sums"], averaged["weight"],
                       merge_floating(averaged["model_state"], local.model_state), None, {"error": error})
