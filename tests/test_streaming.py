"""Streaming DiLoCo (`jdp.sync.StreamingDiLoCo`): with one fragment it is DiLoCo bit for bit; with several, each
fragment's global parameters change at its own steps only; its state is whole at every step, so a run resumes
bitwise from a checkpoint in the middle of a round; it sends DiLoCo's bytes, spread over the round."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp.errors import FitError
from jdp.sync import DiLoCo, StreamingDiLoCo
from jdp.sync.streaming import fragments_of
from jdp.trainer import FitOptions, prepare
from tests.test_diloco import INNER
from tests.test_powersgd import BATCH, N, Net, _data, mse


def _fit(sync, steps=8, devices=N, **options):
    return jdp.fit(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=INNER, steps=steps, global_batch_size=BATCH,
                   num_devices=devices, sync=sync, eval_every=0, **options)


def _same(a, b) -> bool:
    return a.losses == b.losses and all(np.array_equal(x, y) for x, y in zip(
        jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True))


def test_one_fragment_is_diloco_bit_for_bit():
    assert _same(_fit(StreamingDiLoCo(every=4, fragments=1)), _fit(DiLoCo(every=4)))


def test_each_fragment_changes_at_its_own_steps():
    """H = 4, F = 2: fragment 0 (the first leaves) is synced after steps 4 and 8, fragment 1 after steps 2 and 6,
    and the global parameters a callback sees change nowhere else. Breaks if every fragment syncs at once or a
    fragment's outer step leaks into the others' leaves."""
    seen = []

    class Params:
        every = 1

        def on_step(self, step, metrics, state):
            seen.append(jax.tree.map(np.asarray, jax.tree.leaves(state.params)))

        def on_end(self, result):
            pass

    _fit(StreamingDiLoCo(every=4, fragments=2), callbacks=[Params()])
    abstract = [np.zeros(x.shape) for x in seen[0]]
    fragments = fragments_of(abstract, 2)
    assert all(fragments) and sorted(sum(fragments, [])) == list(range(len(abstract)))
    engine = prepare(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=INNER, global_batch_size=BATCH,
                     options=FitOptions(num_devices=N, sync=StreamingDiLoCo(every=4, fragments=2), eval_every=0))
    before = [np.asarray(x) for x in jax.tree.leaves(engine.parallel.to_host(engine.init_state()).params)]
    history = [before, *seen]  # history[s]: the global parameters after step s
    for step in range(1, 9):
        changed = {i for i, (a, b) in enumerate(zip(history[step - 1], history[step], strict=True))
                   if not np.array_equal(a, b)}
        expected = set(fragments[0]) if step % 4 == 0 else set(fragments[1]) if step % 4 == 2 else set()
        assert changed == expected, step


def test_a_checkpoint_in_the_middle_of_a_round_resumes_bitwise(tmp_path):
    strategy = StreamingDiLoCo(every=4, fragments=2)
    straight = _fit(strategy)
    _fit(strategy, steps=4, workdir=tmp_path, checkpoint_every=3)  # saves at step 3, mid-round, and at 4
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # resume from step 3
    resumed = _fit(strategy, workdir=tmp_path, checkpoint_every=3)
    assert resumed.losses == straight.losses[3:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params),
                                                    jax.tree.leaves(straight.params), strict=True))


def test_on_another_device_count_every_device_restarts_from_the_global_parameters(tmp_path, capsys):
    """Breaks if the per-device parameters restarted from the run's initial ones: the resumed run would train from
    scratch (its first loss back at the initial one)."""
    strategy = StreamingDiLoCo(every=4, fragments=2)
    first = _fit(strategy, steps=4, workdir=tmp_path, checkpoint_every=4)
    resumed = _fit(strategy, devices=2, workdir=tmp_path, checkpoint_every=4)
    assert "was saved on another device count: it starts afresh" in capsys.readouterr().out
    assert resumed.losses[0] < first.losses[0] - 0.5 * (first.losses[0] - first.losses[-1])


def test_it_sends_dilocos_bytes_spread_over_the_round():
    def sent(sync):
        engine = prepare(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(0.1), global_batch_size=BATCH,
                         options=FitOptions(num_devices=N, sync=sync, eval_every=0))
        state = engine.parallel.to_devices(engine.init_state())
        return engine.parallel.read_collectives(state, engine.parallel.shard_batch(engine.source.train_batch(0)))

    assert sent(StreamingDiLoCo(every=4, fragments=2)) == pytest.approx(sent(DiLoCo(every=4)))


def test_it_is_refused_under_jit_in_one_line():
    with pytest.raises(FitError, match="keeps each device's own parameters; use backend='shard_map'"):
        FitOptions(sync=StreamingDiLoCo(every=4), backend="jit")
