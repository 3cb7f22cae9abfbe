"""Streaming DiLoCo (`jdp.sync.StreamingDiLoCo`): with one fragment it is DiLoCo bit for bit; with several, each
fragment's global parameters change at its own steps only; its state is whole at every step, so a run resumes
bitwise from a checkpoint in the middle of a round; it sends DiLoCo's bytes, spread over the round."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize("overlap", [0, 1])
def test_each_fragment_changes_at_its_own_steps(overlap):
    """H = 4, F = 2: fragment 0 (the first leaves) is synced after steps 4 and 8, fragment 1 after steps 2 and 6,
    and the global parameters a callback sees change nowhere else; with an overlap of one step each sync comes a
    step later (fragment 0's second after the run). Breaks if every fragment syncs at once or a fragment's outer
    step leaks into the others' leaves."""
    seen = []

    class Params:
        every = 1

        def on_step(self, step, metrics, state):
            seen.append(jax.tree.map(np.asarray, jax.tree.leaves(state.params)))

        def on_end(self, result):
            pass

    _fit(StreamingDiLoCo(every=4, fragments=2, overlap=overlap), callbacks=[Params()])
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
        ended = step - overlap
        expected = (set(fragments[0]) if ended % 4 == 0 and ended else set(fragments[1]) if ended % 4 == 2
                    else set())
        assert changed == expected, step


@pytest.mark.parametrize("overlap", [0, 2])
def test_a_checkpoint_in_the_middle_of_a_round_resumes_bitwise(tmp_path, overlap):
    """With tau = 2 the checkpoint at step 3 falls between fragment 1's outer step (after step 3) and its merge
    (after step 4): the new global fragment waits in the global parameters."""
    strategy = StreamingDiLoCo(every=4, fragments=2, overlap=overlap, local_weight=0.5 if overlap else 0.0)
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
    assert "was saved on another device count: it starts afresh" in capsys.readouterr().err
    assert resumed.losses[0] < first.losses[0] - 0.5 * (first.losses[0] - first.losses[-1])


def test_it_sends_dilocos_bytes_spread_over_the_round():
    def sent(sync):
        engine = prepare(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(0.1), global_batch_size=BATCH,
                         options=FitOptions(num_devices=N, sync=sync, eval_every=0))
        state = engine.parallel.to_devices(engine.init_state())
        engine.parallel.compile_train(state, engine.parallel.shard_batch(engine.source.train_batch(0)))
        return engine.parallel.comm_bytes_per_step

    assert sent(StreamingDiLoCo(every=4, fragments=2)) == pytest.approx(sent(DiLoCo(every=4)))


def test_fragments_the_leaves_cannot_fill_are_refused_in_one_line():
    """Net's 4 leaves cannot fill 8 fragments. Breaks if an empty fragment is accepted, its rounds sending
    nothing."""
    with pytest.raises(FitError, match="4 parameter leaves .* leave a fragment with none of them to sync; use fewer"):
        _fit(StreamingDiLoCo(every=8, fragments=8))
    assert _fit(StreamingDiLoCo(every=8, fragments=4)).losses


def test_it_is_refused_under_jit_in_one_line():
    with pytest.raises(FitError, match="keeps each device's own parameters; use backend='shard_map'"):
        FitOptions(sync=StreamingDiLoCo(every=4), backend="jit")


def test_with_an_overlap_the_outer_step_takes_the_rounds_end_a_step_later():
    """F = 1, tau = 1: the outer step after step 5 takes the parameters the step began with, those of the round's
    end, so the global parameters after 8 steps are DiLoCo's after 4, bit for bit (the second round's sync would
    come after step 9). The merge weight changes what the devices train on after the sync, not the global step."""
    overlapped = _fit(StreamingDiLoCo(every=4, fragments=1, overlap=1))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(overlapped.params),
                                                    jax.tree.leaves(_fit(DiLoCo(every=4), steps=4).params),
                                                    strict=True))
    mixed = _fit(StreamingDiLoCo(every=4, fragments=1, overlap=1, local_weight=0.5))
    assert mixed.losses[:5] == overlapped.losses[:5] and mixed.losses[5] != overlapped.losses[5]
    assert mixed.losses[-1] < mixed.losses[0]


def _dot_free(text: str) -> list[bool]:
    """For each conditional of the entry computation whose branches hold a collective: whether no dot (nor a
    fusion, loop or call holding one) lies upstream of its operands, i.e. whether it depends on no part of the
    step's forward and backward."""
    bodies, entry = {}, None  # computation -> {instruction: its line}
    for line in text.splitlines():
        if header := re.match(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{$", line):
            current = bodies[header[2]] = {}
            entry = header[2] if header[1] else entry
        elif instruction := re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$", line):
            current[instruction[1]] = instruction[2].split(", metadata=")[0]

    def refs(line: str, names) -> set[str]:
        return {name for name in re.findall(r"%([\w.\-]+)", line) if name in names}

    def holds(computation: str, ops: tuple[str, ...]) -> bool:
        return any(any(f" {op}(" in line for op in ops) or any(holds(c, ops) for c in refs(line, bodies))
                   for line in bodies[computation].values())

    names = bodies[entry]
    results = []
    for line in names.values():
        if " conditional(" in line and any(holds(c, ("all-reduce", "all-to-all")) for c in refs(line, bodies)):
            reached, todo = set(), list(refs(line, names))
            while todo:
                if (other := todo.pop()) not in reached:
                    reached.add(other)
                    todo += refs(names[other], names)
            results.append(not any(" dot(" in names[r] or " convolution(" in names[r]
                                   or any(holds(c, ("dot", "convolution")) for c in refs(names[r], bodies))
                                   for r in reached))
    return results


@pytest.mark.parametrize("overlap", [0, 1])
def test_with_an_overlap_the_syncs_collectives_depend_on_no_part_of_the_steps_forward_and_backward(overlap):
    """In the compiled step: with tau = 1 each fragment's conditional that holds its collectives takes nothing
    computed by a dot (the forward and backward), so XLA may run it beside them; with tau = 0 it takes the updated
    parameters, downstream of the backward."""
    engine = prepare(lambda: Net(nnx.Rngs(0)), mse, _data(), optimizer=optax.sgd(0.1), global_batch_size=BATCH,
                     options=FitOptions(num_devices=N, sync=StreamingDiLoCo(every=4, fragments=2, overlap=overlap),
                                        eval_every=0))
    state = engine.parallel.to_devices(engine.init_state())
    text = engine.parallel.lower_train(state, engine.parallel.shard_batch(engine.source.train_batch(0))).compile(
        ).as_text()
    free = _dot_free(text)
    assert free == [bool(overlap)] * 2
