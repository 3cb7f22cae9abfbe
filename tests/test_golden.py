"""Golden values of two train steps on a fixed tiny model: every metric the step reports and a digest of the
parameters and optimizer state after it, compared with tests/golden_step.json. A changed number shows at once,
with the variant, the step and the metric that moved.

The model is a 2-layer MLP built from a fixed seed, the data fixed numpy arrays, the optimizer SGD with momentum
under a warm-up schedule (so `lr` moves and the optimizer state is not empty), on 2 of the 8 CPU devices, with
`log_grad_norm`. Variants: plain, grad_accum_steps=2, shard_optimizer=True (ZeRO-1), allreduce_dtype="bf16".

Tolerance: rtol 1e-6 (a sum's tolerance is rtol times the sum of its absolute values, as a sum near 0 has no
relative precision). Float32 on XLA:CPU is deterministic from run to run, so on one machine the values repeat
bit for bit; 1e-6 (about 8 float32 ulps) leaves room for XLA reordering a reduction (another jax version or CPU),
while a real change of the step (a gradient scale, a missed all-reduce, an lr off by one step, bf16 rounding
dropped) moves the numbers by far more.

When a change of the numbers is intended, regenerate the golden values, and commit the JSON with the change:

    python tests/test_golden.py --regenerate
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jdp.trainer import FitOptions, prepare

GOLDEN = Path(__file__).with_name("golden_step.json")
RTOL = 1e-6
STEPS = 2
NUM_DEVICES = 2
GLOBAL_BATCH = 16

VARIANTS = {
    "plain": {},
    "grad_accum_2": {"grad_accum_steps": 2},
    "zero1": {"shard_optimizer": True},
    "bf16_all_reduce": {"allreduce_dtype": "bf16"},
}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))[:, 0]


def loss_fn(model, batch):
    """Squared error, weighted per row, with one more loss output."""
    err = model(batch["x"]) - batch["y"]
    return {"loss": err**2, "abs_err": jnp.abs(err), "weight": batch["weight"]}


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    return {"x": x, "y": np.sin(x).sum(1).astype(np.float32),
            "weight": rng.uniform(0.5, 1.5, size=64).astype(np.float32)}


def digest(tree) -> dict[str, dict[str, float]]:
    """Per leaf: the sum, the sum of absolute values and the sum of squares (in float64, of the float32 values)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        x = np.asarray(leaf, np.float64)
        out[jax.tree_util.keystr(path)] = {"sum": float(x.sum()), "abs_sum": float(np.abs(x).sum()),
                                           "sq_sum": float(np.square(x).sum())}
    return out


def run_steps(variant: str) -> dict:
    """The metrics of each step, and the digest of the logical parameters and optimizer state after the last."""
    schedule = optax.linear_schedule(0.05, 0.2, transition_steps=4)
    engine = prepare(lambda: MLP(nnx.Rngs(0)), loss_fn, data(), optimizer=optax.sgd(schedule, momentum=0.9),
                     global_batch_size=GLOBAL_BATCH,
                     options=FitOptions(num_devices=NUM_DEVICES, log_grad_norm=True, schedule=schedule,
                                        **VARIANTS[variant]))
    parallel = engine.parallel
    state = parallel.to_devices(engine.init_state())
    metrics = []
    for step in range(STEPS):
        state, step_metrics = parallel.train_step(state, parallel.shard_batch(engine.source.train_batch(step)))
        metrics.append(parallel.fetch(step_metrics))
    final = parallel.to_host(parallel.to_logical(state))
    return {"metrics": metrics, "params": digest(final.params), "opt_state": digest(final.opt_state)}


def _compare(got, want, where: str, atol: float = 0.0) -> list[str]:
    if isinstance(want, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(got)} != golden {sorted(want)}"]
        scale = want.get("abs_sum", 0.0) if "sum" in want else 0.0
        return [m for k in want for m in _compare(got[k], want[k], f"{where}.{k}", RTOL * scale if k == "sum" else 0)]
    if isinstance(want, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} entries != golden {len(want)}"]
        return [m for i, (g, w) in enumerate(zip(got, want, strict=True)) for m in _compare(g, w, f"{where}[{i}]")]
    if not np.isclose(got, want, rtol=RTOL, atol=atol):
        return [f"{where}: {got!r} != golden {want!r} (rel. diff {abs(got - want) / max(abs(want), 1e-30):.2e})"]
    return []


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_steps_match_the_golden_values(variant):
    golden = json.loads(GOLDEN.read_text())
    assert variant in golden["variants"], f"no golden values for {variant}: python tests/test_golden.py --regenerate"
    got = run_steps(variant)
    assert got["metrics"][0]["lr"] != got["metrics"][1]["lr"]  # the schedule is logged per step
    mismatches = _compare(got, golden["variants"][variant], variant)
    assert not mismatches, (
        f"the train step's numbers changed (golden values from jax {golden['jax']}, this is jax {jax.__version__}); "
        "if intended: python tests/test_golden.py --regenerate\n" + "\n".join(mismatches))


def regenerate() -> None:
    golden = {"about": "tests/test_golden.py; regenerate: python tests/test_golden.py --regenerate",
              "jax": jax.__version__, "rtol": RTOL,
              "variants": {variant: run_steps(variant) for variant in VARIANTS}}
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: python {sys.argv[0]} --regenerate  (the test itself: python -m pytest {sys.argv[0]})")
    jax.config.update("jax_num_cpu_devices", 8)  # as under pytest (tests/conftest.py), before a device is touched
    regenerate()
