"""PowerSGD (`jdp.sync.powersgd`): at full rank it is the mean all-reduce; at rank r it is a hand-written reference
of the paper's algorithm on N learners, step by step; its state resumes bitwise; which leaves it compresses; its
bytes on the wire, read from the lowered step; and where it is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.errors import FitError
from jdp.metrics import read_metrics
from jdp.sync import powersgd
from jdp.trainer import FitOptions, prepare

N, BATCH, LR = 4, 32, 0.1


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def mse(model, batch):
    return {"loss": jnp.mean((model(batch["x"]) - batch["y"]) ** 2, axis=-1)}


def _data(rows: int = 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, :4] * 2 - x[:, 4:]).astype(np.float32)}


def _engine(backend: str = "shard_map", **options):
    return prepare(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(LR), global_batch_size=BATCH,
                   options=FitOptions(num_devices=N, backend=backend, **options))


def _train(engine, steps: int):
    state = engine.parallel.to_devices(engine.init_state())
    losses = []
    for step in range(steps):
        state, metrics = engine.parallel.train_step(state, engine.parallel.shard_batch(engine.source.train_batch(step)))
        losses.append(engine.parallel.fetch(metrics)["loss"])
    return losses, engine.parallel.to_host(engine.parallel.to_logical(state))


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_full_rank_compression_of_every_matrix_is_the_mean_all_reduce(backend):
    """At rank min(n, m) the power iteration spans each mean gradient exactly, and the devices' error buffers sum to
    zero: the update is the all-reduced one. Breaks if P or Q is not all-reduced, P is not orthonormalised, or the
    error feedback is added on one side only."""
    class FullRank(powersgd.PowerSGD):  # a strategy of the test's own, on the public seam
        def bind(self, model, seed):
            bound = super().bind(model, seed)
            bound.matrices = {"l1.kernel": powersgd.Matrix(1, 8, 16, 8), "l2.kernel": powersgd.Matrix(1, 16, 4, 4)}
            return bound

    model = Net(nnx.Rngs(0))
    assert powersgd.matrices(model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), 99) == {}  # forced here
    plain_losses, plain = _train(_engine(backend), 5)
    losses, state = _train(_engine(backend, sync=FullRank(rank=1, start_step=0)), 5)
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    error = state.sync["error"]["l1.kernel"]
    assert np.abs(error.sum(0)).max() < 1e-2 * np.abs(error).max()  # the devices' own errors cancel in their sum


def _reference(params0: dict, q0: dict, batches: list[dict], rank_start: int) -> list[dict]:
    """The paper's algorithm on N learners in numpy (plain SGD): M_i = grad_i + e_i; P = mean M_i Q;
    P = orthonormal(P) (QR, signs fixed); Q = mean M_i^T P; e_i = M_i - P Q^T; update with P Q^T."""
    def loss(p, x, y):
        h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
        return jnp.mean(jnp.mean((h @ p["l2"]["kernel"] + p["l2"]["bias"] - y) ** 2, axis=-1))

    grad = jax.jit(jax.grad(loss))
    params = jax.tree.map(np.float64, params0)
    q = {k: np.float64(v[0]) for k, v in q0.items()}  # one layer per matrix here
    error = {k: np.zeros((N, *params[k.split(".")[0]]["kernel"].shape)) for k in q}
    out = []
    for step, batch in enumerate(batches):
        rows = np.split(np.arange(BATCH), N)
        grads = [jax.tree.map(np.float64, grad(jax.tree.map(np.float32, params), batch["x"][r], batch["y"][r]))
                 for r in rows]
        mean = jax.tree.map(lambda *g: np.mean(g, axis=0), *grads)
        if step >= rank_start:
            for name in q:
                layer = name.split(".")[0]
                m = [grads[i][layer]["kernel"] + error[name][i] for i in range(N)]
                p, r = np.linalg.qr(np.mean([mi @ q[name] for mi in m], axis=0))
                p = p * np.sign(np.diag(r))  # Gram-Schmidt's orthonormal basis, column signs as it gives them
                q[name] = np.mean([mi.T @ p for mi in m], axis=0)
                approx = p @ q[name].T
                error[name] = np.stack([mi - approx for mi in m])
                mean[layer]["kernel"] = approx
        params = jax.tree.map(lambda w, g: w - LR * g, params, mean)
        out.append(params)
    return out


def test_rank_r_is_the_papers_algorithm_on_n_learners():
    """Rank 2, compressed from step 1 (step 0 all-reduced whole), 4 steps, against `_reference`. Breaks without the
    error feedback, without the warm start of Q, or with the compression starting a step early or late."""
    engine = _engine(sync="powersgd", powersgd_rank=2, powersgd_start_step=1)
    assert set(engine.parallel.sync.matrices) == {"l1.kernel", "l2.kernel"}
    first = engine.parallel.to_host(engine.init_state())
    batches = [engine.source.train_batch(step) for step in range(4)]
    state = engine.parallel.to_devices(engine.init_state())
    expected = _reference(first.params, first.sync["q"], batches, rank_start=1)
    for step in range(4):
        state, _ = engine.parallel.train_step(state, engine.parallel.shard_batch(batches[step]))
        got = engine.parallel.to_host(engine.parallel.to_logical(state)).params
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected[step]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"step {step}")


def test_a_resume_after_the_start_step_is_bitwise(tmp_path):
    """The error buffers (per device) and Q (replicated) are checkpointed: 3 steps, then 3 more from the
    checkpoint, give the bits of 6 straight. Breaks if either is left out of the checkpoint or reset on restore."""
    options = {"sync": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 1, "num_devices": N}

    def run(workdir, steps):
        return jdp.fit(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(LR, momentum=0.9), steps=steps,
                       global_batch_size=BATCH, workdir=workdir, checkpoint_every=3, **options)

    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "b", 6)
    assert resumed.losses == straight.losses[3:]
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params), strict=True):
        np.testing.assert_array_equal(a, b)
    lines = read_metrics(tmp_path / "a")  # the strategy's bytes, in the train lines and the summary
    sent = {line["comm_bytes_per_step"] for line in lines if line["split"] in ("train", "summary")}
    assert len(sent) == 1 and 0 < sent.pop() - (2 * (8 + 16) + 2 * (16 + 4) + 16 + 4) * 4 <= 8 * 4  # and the sums


class Stack(nnx.Module):
    """A conv, a scanned pair of layers (stacked with nnx.vmap), a norm and a tiny matrix."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(3, 32, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)

        @nnx.split_rngs(splits=5)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def layers(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(32, 32, rngs=rngs)

        self.layers = layers(rngs)
        self.head = nnx.Linear(32, 2, rngs=rngs)


def test_which_leaves_are_compressed():
    """The rule of the module docstring: a conv kernel HWIO as (H W I, O); scanned layers one by one; biases and
    norms whole, also when stacked; the rank clamped; r (n + m) >= n m left whole."""
    model = Stack(nnx.Rngs(0))
    found = powersgd.matrices(model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), 4)
    assert found == {"conv.kernel": powersgd.Matrix(1, 27, 32, 4), "layers.kernel": powersgd.Matrix(5, 32, 32, 4)}
    assert powersgd.matrices(model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), 1)["head.kernel"] == \
        powersgd.Matrix(1, 32, 2, 1)  # 1 (32 + 2) < 64
    # torch's min_compression_rate: the conv kernel shrinks 864 / 236 = 3.7 times, the layers' 1024 / 256 = 4.
    assert list(powersgd.matrices(model, nnx.to_pure_dict(nnx.state(model, nnx.Param)), 4, 3.8)) == ["layers.kernel"]
    assert powersgd.PowerSGD(4, 10, 3.8).ddp_twin().settings["min_compression_rate"] == 3.8
    p = powersgd.orthonormal(jnp.zeros((1, 5, 2)))
    assert bool(jnp.isfinite(p).all())  # a rank-deficient P divides by no zero


@pytest.mark.parametrize("start", [0, 2])
def test_bytes_per_step_are_the_compiled_steps(start):
    """r (n + m) floats per compressed matrix, the other leaves whole, read from the compiled step's collectives:
    after the start step (the true branch of its conditional), whatever the start."""
    engine = _engine(sync="powersgd", powersgd_rank=2, powersgd_start_step=start)
    state, batch = engine.parallel.to_devices(engine.init_state()), engine.parallel.shard_batch(
        engine.source.train_batch(0))
    state, _ = engine.parallel.train_step(state, batch)
    scalars = 2 * 4  # the loss's sum and the weight
    expected = (2 * (8 + 16) + 2 * (16 + 4) + 16 + 4) * 4  # P and Q of both kernels, both biases whole
    engine.parallel.compile_train(state, batch)
    assert engine.parallel.comm_bytes_per_step == expected + scalars
    assert expected < 0.6 * (8 * 16 + 16 + 16 * 4 + 4) * 4


@pytest.mark.parametrize("options, named", [
    ({"backend": "jit"}, "per-device step"),
    ({"sync_every": 2}, "sync_every=1"),
    ({"shard_optimizer": True}, "shard_optimizer=False"),
    ({"log_noise_scale": True}, "log_noise_scale=False"),
])
def test_refused_where_it_cannot_run(options, named):
    with pytest.raises(FitError, match=named):
        FitOptions(sync="powersgd", **options)


def test_a_checkpoint_written_before_the_sync_state_restores(tmp_path):
    """Checkpoints of a jdp whose TrainState had no `sync` field restore, with the empty field; breaks if the
    checkpointer asks orbax for the field the checkpoint lacks (then they are damaged, and moved aside)."""
    from typing import Any, NamedTuple

    from jdp.checkpoint import Checkpointer

    class Before(NamedTuple):  # TrainState's fields before `sync`
        step: Any
        params: Any
        model_state: Any
        rng_state: Any
        opt_state: Any
        skipped: Any
        loss_scale: Any
        halted: Any

    engine = _engine()
    state = engine.init_state()
    writer = Checkpointer(tmp_path, keep=2, every_steps=1)
    writer.save(1, Before(state.step + 1, *state[1:8]), {"step": 1})
    writer.wait()
    writer.close()
    reader = Checkpointer(tmp_path, keep=2, every_steps=1)
    step, restored, _ = reader.restore_latest(engine.abstract_state, print)
    reader.close()
    assert step == 1 and restored.sync == {}
    np.testing.assert_array_equal(restored.params["l1"]["kernel"], np.asarray(state.params["l1"]["kernel"]))


def test_a_resume_on_another_device_count_starts_the_error_feedback_afresh(tmp_path, capsys):
    """The error buffers hold one row per device: from 4 devices to 2 they restart at 0, with one warning, and Q
    and the parameters come back. Breaks if the change is taken for damage (the checkpoint moved aside) or for a
    config change (refused)."""
    options = {"sync": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 1}
    first = jdp.fit(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(LR), steps=3, global_batch_size=BATCH,
                    workdir=tmp_path, num_devices=4, **options)
    again = jdp.fit(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(LR), steps=4, global_batch_size=BATCH,
                    workdir=tmp_path, num_devices=2, **options)
    out, err = capsys.readouterr()
    assert "resumed from" in out and "jdp: warning: the per-device state (.sync['error']['l1.kernel'], " in err
    assert len(again.losses) == 1 and not (tmp_path / "rejected").exists()
    assert np.isfinite(again.losses[0]) and first.step == 3 and again.step == 4
