"""Replicas stay identical, eval sees every example once, and the host never runs far ahead."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp import mesh as mesh_lib
from jdp.cli.train import build
from tests.helpers import logits_and_state, small_config


def _train(cfg, steps, with_model=False):
    b = build(cfg)
    state = b.parallel.to_devices(b.init_state())
    for i in range(steps):
        state, metrics = b.parallel.train_step(state, b.parallel.shard_batch(b.source.train_batch(i)))
    jax.block_until_ready(metrics)
    return (b.source, b.parallel, state) + ((b.model,) if with_model else ())


def _copies_differ(tree):
    """Independent of jdp's own guard: compare every device's buffer on the host."""
    for leaf in jax.tree.leaves(tree):
        copies = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        if leaf.sharding.is_fully_replicated and len(set(copies)) > 1:
            return True
        if not leaf.sharding.is_fully_replicated:  # pmap's stacked copies
            stacked = np.asarray(leaf)
            if any(stacked[i].tobytes() != stacked[0].tobytes() for i in range(len(stacked))):
                return True
    return False


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "jit"])
def test_replicas_hold_bitwise_identical_parameters(backend):
    _, parallel, state = _train(small_config("resnet", backend=backend), steps=3)
    assert len(jax.tree.leaves(state.params)[0].addressable_shards) == 8
    assert not _copies_differ(state.params) and not _copies_differ(state.model_state)
    assert parallel.first_differing_leaf(state.params) is None


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "jit"])
def test_the_replica_guard_finds_a_corrupted_copy(backend):
    _, parallel, state = _train(small_config("mlp", backend=backend), steps=1)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state.params)]
    leaves = jax.tree.leaves(state.params)
    target = leaves[2]
    shards = [s.data for s in target.addressable_shards]
    shards[5] = shards[5].at[(0,) * shards[5].ndim].add(1e-3)  # one element of one device's copy
    corrupted = jax.make_array_from_single_device_arrays(target.shape, target.sharding, shards)
    tree = jax.tree.unflatten(jax.tree.structure(state.params),
                              [corrupted if i == 2 else x for i, x in enumerate(leaves)])
    assert _copies_differ(tree)
    assert parallel.first_differing_leaf(tree) == paths[2]


def test_the_replica_guard_compares_every_word_of_an_8_byte_leaf():
    """1.0 and 2.0 in float64 share their low 32 bits: a check of the low word alone calls the copies the same."""
    from jax.sharding import PartitionSpec as P

    from jdp.parallel import _differing_leaves

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    check = jax.jit(jax.shard_map(_differing_leaves, mesh=mesh, in_specs=(P("data"),), out_specs=P(),
                                  check_vma=False))
    copies = jax.sharding.NamedSharding(mesh, P("data"))  # row i is device i's copy, as under pmap
    with jax.enable_x64(True):
        assert bool(check({"w": jax.device_put(np.array([[1.0], [2.0]]), copies)})[0])
        assert not bool(check({"w": jax.device_put(np.array([[2.0], [2.0]]), copies)})[0])


@pytest.mark.parametrize("num_devices", [1, 3, 8])
@pytest.mark.slow
def test_eval_sees_every_example_exactly_once(num_devices):
    """37 eval examples in padded batches of 24: the masked sums must equal an unpadded pass."""
    cfg = small_config("resnet", num_devices=num_devices)
    cfg.data.num_eval_examples = 37
    cfg.train.update(global_batch_size=24, eval_batch_size=24)
    source, parallel, state, model = _train(cfg, steps=1, with_model=True)
    count = sum(parallel.fetch(parallel.eval_step(state, parallel.shard_batch(rows)))["weight"]
                for rows in source.eval_batches())
    assert count == 37
    metrics = parallel.evaluate(state, source.eval_batches())

    # The same model, unpadded, on one device.
    rows = list(source.eval_batches())
    x = np.concatenate([r["x"] for r in rows])[:37]
    y = np.concatenate([r["y"] for r in rows])[:37]
    logical = parallel.to_host(parallel.to_logical(state))
    params, model_state = logical.params, logical.model_state
    logits, _ = logits_and_state(model, params, model_state, jnp.asarray(x), train=False)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(y)).mean()
    np.testing.assert_allclose(metrics["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], float(np.mean(np.argmax(logits, -1) == y)), rtol=1e-6)


@pytest.mark.slow
def test_more_than_100_steps_without_blocking(tmp_path):
    """With 2 devices an unbounded queue of steps aborts XLA:CPU (SIGABRT) after ~32 steps; the
    trainer's one-step-late fetch is the only thing that bounds it here (no logging, no eval)."""
    out = subprocess.run(
        [sys.executable, "-m", "jdp.train", "--cpu_devices", "2", "--workdir", str(tmp_path),
         "--config.model.name=mlp", "--config.model.kwargs.hidden_sizes=(16,)", "--config.train.global_batch_size=16",
         "--config.train.steps=300", "--config.train.log_every=300", "--config.train.eval_every=300"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "JAX_NUM_CPU_DEVICES": "2"})
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_next_batch_is_on_the_devices_before_the_host_waits_for_a_step(tmp_path, monkeypatch):
    """Double buffering: the trainer puts step s+1's batch on the devices (the call of the compiled step s+1
    transfers it) before it waits for step s, so the devices never wait for the input. Breaks if the loop fetched
    a step's metrics before reading on."""
    from jdp.cli.train import run
    from jdp.parallel import DataParallel

    events = []
    train_step, fetch = DataParallel.train_step, DataParallel.fetch
    monkeypatch.setattr(DataParallel, "train_step",
                        lambda self, state, batch: events.append("put") or train_step(self, state, batch))
    monkeypatch.setattr(DataParallel, "fetch", lambda self, tree: events.append("wait") or fetch(self, tree))
    steps = 6
    run(small_config("mlp", num_devices=2, steps=steps), tmp_path)
    waits = [i for i, event in enumerate(events) if event == "wait"]
    for k in range(1, steps):  # the k-th wait is for step k's metrics
        assert events[: waits[k - 1]].count("put") == k + 1, events


def test_simulated_devices_that_fill_the_cores_run_one_thread_each(monkeypatch):
    """With as many simulated devices as cores, XLA's intra-op threads are turned off so that the devices
    compute side by side (without it the GPT's 2-device step waited 17.5 ms in its all-reduce, not 2.3 ms);
    fewer devices than cores keep XLA's thread pool, and a setting of the user's in XLA_FLAGS wins."""
    asked = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: asked.append((name, value)))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    one_thread = mesh_lib.ONE_THREAD_PER_DEVICE
    user_choice = "--xla_cpu_multi_thread_eigen=true"
    for count, flags, expected in [(0, "", ""), (1, "", ""), (2, "", one_thread),
                                   (8, "--xla_a=1", f"--xla_a=1 {one_thread}"), (2, user_choice, user_choice)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        mesh_lib.simulate_cpu_devices(count)
        assert os.environ["XLA_FLAGS"] == expected, (count, flags)
    assert asked == [("jax_num_cpu_devices", n) for n in (1, 2, 8, 2)]


def test_a_step_hands_the_host_one_metrics_vector_and_takes_host_rows():
    """The host's per-step work is one transfer each way: the batch goes from numpy straight into the compiled
    step, whose input sharding splits it on `data`, and the metrics come back as one float32 vector (`fetch`
    names them). Breaks if either goes back to one transfer per array."""
    b = build(small_config("mlp", num_devices=2, steps=2))
    state, rows = b.parallel.to_devices(b.init_state()), b.source.train_batch(0)
    batch = b.parallel.shard_batch(rows)
    assert all(isinstance(v, np.ndarray) for v in batch.values())
    compiled = b.parallel.lower_train(state, batch).compile()
    assert all(s.spec == jax.sharding.PartitionSpec("data") for s in jax.tree.leaves(compiled.input_shardings[0][1]))
    _, metrics = b.parallel.train_step(state, batch)
    fetched = b.parallel.fetch(metrics)
    assert isinstance(metrics, jax.Array) and metrics.shape == (len(fetched),) and metrics.dtype == jnp.float32
    assert {"loss", "accuracy", "skipped_steps"} <= set(fetched) and fetched["skipped_steps"] == 0
