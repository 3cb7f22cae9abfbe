"""Micro-measurements behind docs/benchmarks.md's explanations of XLA:CPU costs.

    python benchmarks/probe_xla_cpu.py allreduce   # in-process pmean of 7.5 MB vs the same sum on one device
    python benchmarks/probe_xla_cpu.py matmul      # MLP 784-1024-1024-10 gradient: examples/s by batch rows
    python benchmarks/probe_xla_cpu.py conv        # the 2-D CNN's fwd+bwd: XLA conv vs im2col variants
    python benchmarks/probe_xla_cpu.py gpt         # the CPU GPT's fwd+bwd with each GELU, and its top operations
"""

from __future__ import annotations

import statistics
import sys
import time

import jax

MLP_PARAMS = 1_863_690  # 784*1024 + 1024 + 1024*1024 + 1024 + 1024*10 + 10


def timed_ms(fn, *args, reps: int = 30) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def allreduce() -> None:
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",), axis_types=(AxisType.Auto,))

    def on_devices(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))

    x = jax.device_put(jnp.ones((2 * MLP_PARAMS,), jnp.float32), NamedSharding(mesh, P("d")))
    print(f"pmean of 7.5 MB on 2 CPU devices: {timed_ms(on_devices(lambda v: jax.lax.pmean(v, 'd')), x):.3f} ms")
    a = b = jnp.ones((MLP_PARAMS,), jnp.float32)
    print(f"(a + b) / 2 of 7.5 MB on one device: {timed_ms(jax.jit(lambda a, b: (a + b) / 2), a, b):.3f} ms")
    small = [jax.device_put(jnp.ones((2000,), jnp.float32), NamedSharding(mesh, P("d"))) for _ in range(6)]
    separate = jax.jit(jax.shard_map(lambda *v: [jax.lax.pmean(t, "d") for t in v], mesh=mesh, in_specs=P("d"),
                                     out_specs=P("d"), check_vma=False))
    together = jax.jit(jax.shard_map(lambda *v: jax.lax.pmean(v, "d"), mesh=mesh, in_specs=P("d"),
                                     out_specs=P("d"), check_vma=False))
    print(f"6 tiny pmeans: {timed_ms(separate, *small):.3f} ms; one tuple pmean: {timed_ms(together, *small):.3f} ms")


def matmul() -> None:
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    weights = [jax.random.normal(key, s) for s in ((784, 1024), (1024, 1024), (1024, 10))]

    def loss(ws, x):
        h = jax.nn.relu(x @ ws[0])
        h = jax.nn.relu(h @ ws[1])
        return jnp.sum(h @ ws[2])

    grad = jax.jit(jax.grad(loss))
    for rows in (32, 64, 128, 256):
        ms = timed_ms(grad, weights, jnp.ones((rows, 784)))
        print(f"MLP gradient, {rows} rows: {ms:.2f} ms, {rows / ms * 1e3:,.0f} examples/s")


def conv() -> None:
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (128, 28, 28, 1))
    weights = (jax.random.normal(key, (3, 3, 1, 32)) * 0.1, jax.random.normal(key, (3, 3, 32, 64)) * 0.1,
               jax.random.normal(key, (12 * 12 * 64, 128)) * 0.01, jax.random.normal(key, (128, 10)) * 0.1)
    dn = ("NHWC", "HWIO", "NHWC")

    def xla_conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)

    def patches(x, w):
        kh, kw, cin, cout = w.shape
        p = jax.lax.conv_general_dilated_patches(x, (kh, kw), (1, 1), "VALID", dimension_numbers=dn)
        return p @ w.transpose(2, 0, 1, 3).reshape(cin * kh * kw, cout)  # patches are (cin, kh, kw)-ordered

    def slices(x, w):
        kh, kw, cin, cout = w.shape
        h, wd = x.shape[1] - kh + 1, x.shape[2] - kw + 1
        cols = jnp.concatenate([x[:, i:i + h, j:j + wd, :] for i in range(kh) for j in range(kw)], axis=-1)
        return cols @ w.reshape(kh * kw * cin, cout)

    def model(conv_fn):
        def loss(ws, x):
            h = jax.nn.relu(conv_fn(jax.nn.relu(conv_fn(x, ws[0])), ws[1]))
            b, hh, ww, c = h.shape
            h = h.reshape(b, hh // 2, 2, ww // 2, 2, c).max(axis=(2, 4)).reshape(b, -1)
            return jnp.mean(jax.nn.relu(h @ ws[2]) @ ws[3])

        return jax.jit(jax.value_and_grad(loss))

    _, reference = model(xla_conv)(weights, x)
    for name, fn in (("XLA conv", xla_conv), ("im2col slices + matmul", slices), ("conv patches + matmul", patches)):
        step = model(fn)
        _, grads = step(weights, x)
        diff = max(float(jnp.max(jnp.abs(g - r) / (jnp.abs(r) + 1e-6)))
                   for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True))
        print(f"{name}: {timed_ms(step, weights, x, reps=10):.1f} ms fwd+bwd at batch 128, "
              f"max relative gradient difference {diff:.1e}")


def gpt() -> None:
    """The GPT of configs/shakespeare_char_cpu.py (4 layers, 4 heads, width 128) at its batch of 12 x 64 tokens,
    with tiny_shakespeare's 65 symbols: fwd+bwd with jax.nn.gelu (erfc form) and with jdp's gelu (PyTorch's
    erf form), interleaved, then the top operations of a profile of each."""
    import collections
    import importlib
    import re
    import tempfile

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from profile_gpt import xla_thread_time  # benchmarks/, the script's folder

    gpt_module = importlib.import_module("jdp.models.gpt")  # jdp.models.gpt the attribute is the builder
    tokens = np.random.default_rng(0).integers(0, 65, (12, 65)).astype(np.int32)
    x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    gelus = {"jax.nn.gelu(approximate=False)": lambda v: jax.nn.gelu(v, approximate=False),
             "jdp.models.gpt.gelu": gpt_module.gelu}
    steps = {}
    for name, gelu in gelus.items():
        gpt_module.gelu = gelu  # read when the MLP is traced
        model = gpt_module.GPT(65, 64, num_layers=4, num_heads=4, embed_dim=128, bias=False, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params, x, y, graphdef=graphdef, rest=rest):
            logits = nnx.merge(graphdef, params, rest)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        steps[name] = (jax.jit(jax.value_and_grad(loss)), params)
        jax.block_until_ready(steps[name][0](params, x, y))
    gpt_module.gelu = gelus["jdp.models.gpt.gelu"]
    times = collections.defaultdict(list)
    for _ in range(5):
        for name, (step, params) in steps.items():
            times[name].append(timed_ms(step, params, x, y, reps=10))
    for name, (step, params) in steps.items():
        print(f"{name}: fwd+bwd {statistics.median(times[name]):.1f} ms (median of 5 x 10 steps)")
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace):
                for _ in range(10):
                    jax.block_until_ready(step(params, x, y))
            total = xla_thread_time(trace, 10)
        hlo = step.lower(params, x, y).compile().as_text()
        print(f"  XLA thread time per step {sum(total.values()) / 1e6:.1f} ms; top operations:")
        for op, ns in total.most_common(6):
            found = re.search(rf"^  %{re.escape(op)} = (\S+) .*?op_name=\"([^\"]+)\"", hlo, re.M)
            shape, origin = found.groups() if found else ("", "")
            print(f"  {ns / 1e6:6.2f} ms  {op:24s} {shape:22s} {origin}")


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 2)
    {"allreduce": allreduce, "matmul": matmul, "conv": conv, "gpt": gpt}[sys.argv[1]]()
