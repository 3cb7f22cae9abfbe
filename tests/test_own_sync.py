"""`fit(sync=...)`: every built-in strategy as a public object gives the run its flags give, bit for bit, and a
strategy written outside jdp (tests/sign_ef.py, the one docs/communication.md prints) plugs in with no edit to jdp:
it trains, checkpoints its per-device state and resumes bitwise, reports what its compiled program sends, and is
refused where its own check says; the resume guard compares its record."""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import sync
from jdp.cli import config as config_lib
from jdp.errors import FitError
from jdp.trainer import FitOptions, prepare
from tests.helpers import small_config
from tests.sign_ef import SignEF
from tests.test_fit import Regressor, mse, regression_data

REPO = Path(__file__).resolve().parents[1]


def _fit(**options):
    options = {"steps": 4, "global_batch_size": 32, "optimizer": optax.sgd(0.1), "log_every": 1,
               "num_devices": 4, **options}
    return jdp.fit(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), **options)


BUILT_INS = {
    "allreduce": ({}, sync.AllReduce()),
    "bf16": ({"allreduce_dtype": "bf16"}, sync.AllReduce(dtype="bf16")),
    "zero1": ({"shard_optimizer": True}, sync.ZeRO1()),
    "zero3": ({"shard_params": True}, sync.ZeRO3()),
    "local_sgd": ({"sync_every": 2}, sync.LocalSGD(every=2)),
    "diloco": ({"sync_every": 2, "outer_optimizer": "nesterov", "outer_lr": 0.5},
               sync.DiLoCo(every=2, outer_lr=0.5, outer_momentum=0.9)),
    "powersgd": ({"sync": "powersgd", "powersgd_rank": 1, "powersgd_start_step": 1},
                 sync.PowerSGD(rank=1, start_step=1)),
    "int8": ({"allreduce_dtype": "int8"}, sync.QuantizedAllReduce(bits=8)),
    "diloco_int4": ({"sync_every": 2, "outer_optimizer": "nesterov", "allreduce_dtype": "int4"},
                    sync.DiLoCo(every=2, bits=4)),
    "int4": ({"allreduce_dtype": "int4"}, sync.QuantizedAllReduce(bits=4)),
    "diloco_across_groups": ({"sync_every": 2, "outer_optimizer": "nesterov", "shard_group": 2},
                             sync.DiLoCo(every=2, group_size=2)),
}


@pytest.mark.parametrize("name", list(BUILT_INS))
def test_a_built_in_object_runs_as_its_flags(name):
    flags, strategy = BUILT_INS[name]
    by_flags, by_object = _fit(**flags), _fit(sync=strategy)
    assert by_flags.losses == by_object.losses
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(by_flags.params),
                                                    jax.tree.leaves(by_object.params), strict=True))


@pytest.mark.parametrize("options, message", [
    (dict(sync=sync.ZeRO3(), sync_every=2), r"sync=ZeRO3\(\) is a strategy object, and sync_every=2 is a strategy "
                                            "setting"),
    (dict(shard_params=True, shard_optimizer=True), "already shards the optimizer state; set shard_optimizer=False"),
    (dict(sync="zero9"), "sync='zero9' is unknown; choose one of allreduce, zero1, zero3, local_sgd, diloco, "
                         "powersgd"),
    (dict(sync="local_sgd"), "sync=local_sgd averages every sync_every steps; set sync_every > 1"),
    (dict(sync="zero1", allreduce_dtype="int8"), "sync=zero1 reduce-scatters the gradient in fp32 or bf16, not int8"),
    (dict(sync="zero3", allreduce_dtype="bf16"), "sync=zero3 reduce-scatters the gradient in the parameters' dtype"),
    # each names a setting the user gave, in the order the rules stand
    (dict(shard_params=True, sync="zero3", allreduce_dtype="bf16"), "sync=zero3 reduce-scatters the gradient in the "
                                                                    "parameters' dtype"),
    (dict(shard_params=True, sync_every=2, allreduce_dtype="bf16"), "cannot be combined with sync_every > 1"),
    (dict(shard_params=True, allreduce_dtype="bf16"), "shard_params=True reduce-scatters the gradient in the "
                                                      "parameters' dtype"),
])
def test_strategies_that_cannot_be_are_refused_in_one_line(options, message):
    with pytest.raises(FitError, match=message):
        FitOptions(**options)


def test_a_powersgd_rank_that_compresses_nothing_is_refused():
    """Each matrix is compressed at min(rank, n, m); a rank at which no matrix sends less than it whole is refused,
    naming the largest rank that compresses (the regression model's 6 x 16 kernel: 4; at a minimum compression
    rate of 2, 2: the hint ignored the rate)."""
    with pytest.raises(FitError, match="compresses none of this model's gradient matrices.*at most 4"):
        _fit(sync="powersgd", powersgd_rank=1_000_000_000)
    with pytest.raises(FitError, match="compresses none of this model's gradient matrices.*at most 2$"):
        _fit(sync=sync.PowerSGD(rank=3, min_compression_rate=2))


def test_the_start_up_line_names_the_strategy_and_done_its_bytes(capsys):
    _fit(sync=sync.PowerSGD(rank=1, start_step=1))
    out = capsys.readouterr().out
    assert "sync PowerSGD(rank=1, start_step=1)" in out
    assert "comm_bytes_per_step" in next(line for line in out.splitlines() if line.startswith("done:"))


# --- a strategy of one's own ----------------------------------------------------------------------------------------

def test_sign_compression_with_error_feedback_trains():
    result = _fit(sync=SignEF(), steps=40, optimizer=optax.sgd(0.05))
    assert result.losses[-1] < 0.7 * result.losses[0]


def test_its_per_device_error_is_checkpointed_and_resumes_bitwise(tmp_path):
    straight = _fit(sync=SignEF(), steps=6)
    _fit(sync=SignEF(), steps=3, workdir=tmp_path, checkpoint_every=3)
    resumed = _fit(sync=SignEF(), steps=6, workdir=tmp_path, checkpoint_every=3)
    assert resumed.losses == straight.losses[3:]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(straight.params),
                                                    strict=True))


def test_its_bytes_are_read_from_the_compiled_program_and_match_the_hand_count():
    """Per leaf and device: the signs packed 8 to a byte and one float32 scale, all-gathered; plus the one
    all-reduce of the loss's weighted sum and the weight total."""
    engine = prepare(lambda: Regressor(nnx.Rngs(0)), mse, regression_data(), optimizer=optax.sgd(0.1),
                     global_batch_size=32, options=FitOptions(num_devices=4, sync=SignEF()))
    state = engine.parallel.to_devices(engine.init_state())
    engine.parallel.compile_train(state, engine.parallel.shard_batch(engine.source.train_batch(0)))
    sent = engine.parallel.comm_bytes_per_step
    leaves = jax.tree.leaves(engine.abstract_state.params)
    sums = 3 * 4  # the loss's and the abs_err's weighted sums, and the weight total, float32
    assert sent == sum(math.ceil(leaf.size / 8) + 4 for leaf in leaves) + sums


def test_its_own_check_refuses_jit_in_one_line():
    with pytest.raises(FitError, match=r"SignEF\(error_feedback=True\) keeps each device's own error: it needs a "
                                       "per-device step; use backend='shard_map'"):
        FitOptions(sync=SignEF(), backend="jit")


class SignEFWithoutItsCheck(SignEF):
    def check(self, options, view, what, require):
        pass


def test_per_device_state_under_jit_is_refused_in_one_line_when_its_own_check_forgets():
    with pytest.raises(FitError, match=r"SignEFWithoutItsCheck\(error_feedback=True\) keeps per-device state, "
                                       "which needs a per-device step; use backend 'shard_map' or 'pmap', not jit"):
        _fit(sync=SignEFWithoutItsCheck(), backend="jit")


class Misreducing(SignEF):
    """SignEF whose `reduce` breaks its contract by `mistake` (a function of its `Reduced`)."""

    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def reduce(self, local, state, axis_name, collective=True):
        return self.mistake(super().reduce(local, state, axis_name, collective))


GRADIENT_OF = r"reduce returned the gradient of \['hidden'\]\['bias'\] as "
KEEPS = (r"reduce and update, the optimizer, the model\) leaves the train state's "
         r"sync\['error'\]\['hidden'\]\['bias'\] as ")


@pytest.mark.parametrize("mistake, message", [
    (lambda r: r._replace(grads=jax.tree.map(jnp.sum, r.grads)), GRADIENT_OF + r"float32\[\], for a parameter "
                                                                               r"of float32\[16\]"),
    (lambda r: r._replace(grads=jax.tree.map(lambda g: g.astype(jnp.int32), r.grads)), GRADIENT_OF + "int32"),
    (lambda r: r._replace(grads={"out": r.grads["out"]}), GRADIENT_OF + "missing"),
    (lambda r: r._replace(sync_state=jax.tree.map(lambda e: e[..., :1], r.sync_state)),
     KEEPS + r"float32\[1\]; it was float32\[16\]"),
    (lambda r: r._replace(sync_state=jax.tree.map(lambda e: e.astype(jnp.bfloat16), r.sync_state)),
     KEEPS + "bfloat16"),
    (lambda r: r._replace(sync_state={"errors": r.sync_state["error"]}), KEEPS + "missing"),
    (tuple, "reduce returned tuple; it returns a jdp.sync.Reduced"),
    (lambda r: r._replace(grads={**r.grads, "out": {**r.grads["out"], "bias": 0.0}}),
     r"reduce returned the gradient of \['out'\]\['bias'\] as float32\[\]"),
])
def test_a_reduce_that_breaks_its_contract_is_refused_in_one_line_naming_the_leaf(mistake, message):
    """Checked as the step is traced. Breaks without the checks in `jdp.step`: a scalar or int gradient trains
    silently wrong (optax broadcasts and promotes it), as does a state the guard's select broadcasts back to its
    shape or promotes to its dtype; a missing leaf or a tuple is a raw pytree error."""
    with pytest.raises(FitError, match=message):
        _fit(sync=Misreducing(mistake))


class Periodic(sync.LocalSGD):
    """Local SGD whose own check forgets the checkpoint period."""

    def check(self, options, view, what, require):
        pass


@pytest.mark.parametrize("period", ["checkpoint_every", "eval_every", "check_replicas_every"])
def test_a_period_between_sync_points_is_refused_whatever_the_strategys_own_check(period):
    """Breaks if the rule is left to each strategy: this one's checkpoints would fall between sync points, where
    the replicas differ, and the resume would call them damaged; its evals scored a mix of the replicas."""
    with pytest.raises(FitError, match=rf"{period}=3 is not a multiple of the sync period 2 \(Periodic"):
        FitOptions(sync=Periodic(every=2), **{period: 3})
    with pytest.raises(FitError, match=r"checkpoint_every=3 is not a multiple of the sync period 2 \(sync_every=2"):
        FitOptions(sync_every=2, checkpoint_every=3)


@pytest.mark.parametrize("every", [0, "2", True, 1.0])
def test_a_period_that_is_not_a_positive_int_is_refused_in_one_line(every):
    """Breaks without the check: steps % every is a ZeroDivisionError or a TypeError."""
    strategy = sync.AllReduce()
    strategy.every = every
    with pytest.raises(FitError, match=r"AllReduce\(dtype='fp32'\)\.every=.* must be an int of at least 1"):
        FitOptions(sync=strategy)


def test_the_noise_scale_is_refused_in_one_line_unless_a_strategy_says_it_carries_it():
    """A strategy of one's own reports no small batches' squared norms (`Reduced.small_sq`) unless it says so
    (`noise_scale = True`). Breaks if `Sync` claims it by default: the step then fails on the missing norms."""
    with pytest.raises(FitError, match=r"which SignEF\(error_feedback=True\) does not hold on each device"):
        FitOptions(sync=SignEF(), log_noise_scale=True)
    assert _fit(sync=sync.QuantizedAllReduce(), log_noise_scale=True).losses


def test_the_strategies_are_reached_from_import_jdp_alone():
    """`import jdp; jdp.sync.ZeRO3()`, as the docs write it, in a fresh interpreter (the test session has imported
    `jdp.sync` already)."""
    subprocess.run([sys.executable, "-c", "import jdp; jdp.sync.ZeRO3(); jdp.layers.Stack"], check=True, timeout=120)


def test_the_resume_guard_compares_its_parameters(tmp_path):
    _fit(sync=SignEF(), steps=2, workdir=tmp_path)
    with pytest.raises(FitError, match="error_feedback"):
        _fit(sync=SignEF(error_feedback=False), steps=4, workdir=tmp_path)


class Tagged(sync.AllReduce):
    """The mean all-reduce with parameters JSON holds in another form: a numpy scalar, a tuple, a dtype, an
    array, a function, a partial."""

    def __init__(self, rate: np.float32 = np.float32(1.5)) -> None:  # noqa: B008 (the form under test)
        super().__init__()
        self.rate = rate

    def params(self) -> dict:
        return {**super().params(), "rate": self.rate, "shape": (2, 3), "dtype": np.dtype("float32"),
                "weights": np.arange(3.0), "loss": mse, "scaled": functools.partial(mse, scale=2), "kind": np.float32}


def test_parameters_json_holds_in_another_form_resume_as_equal_and_a_change_is_refused(tmp_path):
    """Breaks if the live record is compared with the one read back unnormalized (1.5 against np.float32(1.5),
    a list against a tuple), or holds a function by its `str` (an address each process draws anew): every resume
    would be refused; an array was a raw ValueError."""
    loss = f"{mse.__module__}:mse"
    assert Tagged().record() == {"class": f"{Tagged.__module__}:Tagged", "dtype": "float32", "rate": 1.5,
                                 "shape": [2, 3], "weights": [0.0, 1.0, 2.0], "loss": loss,
                                 "scaled": {"partial": loss, "args": [], "keywords": {"scale": 2}},
                                 "kind": "<class 'numpy.float32'>"}
    assert "weights=float64[3], " in repr(Tagged())  # not the array's lines: a message naming it stays one line
    _fit(sync=Tagged(), steps=2, workdir=tmp_path)
    assert len(_fit(sync=Tagged(), steps=4, workdir=tmp_path).losses) == 2
    with pytest.raises(FitError, match="rate"):
        _fit(sync=Tagged(np.float32(2.5)), steps=6, workdir=tmp_path)


class WithoutSuperInit(sync.AllReduce):
    def __init__(self, scale: float = 1.0) -> None:  # no super().__init__(), as a user may write it
        self.scale = scale

    def params(self) -> dict:
        return {"scale": self.scale}


def test_a_strategy_that_skips_the_base_init_runs_as_the_mean_all_reduce():
    """Breaks if the base class's defaults (what the gradient's collective sends) live only in its `__init__`."""
    assert _fit(sync=WithoutSuperInit()).losses == _fit().losses


@pytest.mark.parametrize("outer_lr", [math.inf, math.nan, 0.0])
def test_an_outer_learning_rate_the_flag_refuses_is_refused_by_the_object_too(outer_lr):
    with pytest.raises(ValueError, match="outer_lr=.* must be positive"):
        sync.DiLoCo(every=2, outer_lr=outer_lr)


def test_the_cli_names_it_by_import_path_with_its_settings():
    cfg = small_config("mlp", num_devices=4)
    cfg.parallel.sync = "tests.sign_ef:SignEF"
    cfg.parallel.sync_kwargs = {"error_feedback": False}
    values = config_lib.fit_values(cfg)
    assert isinstance(values["sync"], SignEF) and values["sync"].error_feedback is False
    cfg.parallel.sync = "tests.sign_ef:Nothing"
    with pytest.raises(config_lib.ConfigError, match="parallel.sync: 'tests.sign_ef:Nothing' cannot be imported"):
        config_lib.fit_values(cfg)


@pytest.mark.parametrize("name", ["allreduce", "powersgd"])
def test_settings_for_an_import_path_beside_a_built_in_name_are_refused(name):
    """Breaks if `parallel.sync_kwargs` are dropped without a word when `parallel.sync` names a built-in."""
    cfg = small_config("mlp", num_devices=4)
    cfg.parallel.sync, cfg.parallel.sync_kwargs = name, {"rank": 4}
    with pytest.raises(config_lib.ConfigError, match=rf"parallel.sync: {name} is built in and takes its settings "
                                                     r"from its own keys, not sync_kwargs \(rank\)"):
        config_lib.fit_values(cfg)


def test_the_command_line_sets_a_strategys_settings_as_one_dict_or_one_by_one():
    cfg = small_config("mlp", num_devices=4)
    config_lib.apply_overrides(cfg, {"parallel.sync": "tests.sign_ef:SignEF",
                                     "parallel.sync_kwargs": '{"error_feedback": False}'})
    assert config_lib.fit_values(cfg)["sync"].error_feedback is False
    config_lib.apply_overrides(cfg, {"parallel.sync_kwargs.error_feedback": "True"})
    assert config_lib.fit_values(cfg)["sync"].error_feedback is True
    # JSON's spelling, as the config's own bool keys take it: 'false' was the string, which counts as true.
    config_lib.apply_overrides(cfg, {"parallel.sync_kwargs.error_feedback": "false"})
    assert config_lib.fit_values(cfg)["sync"].error_feedback is False
    config_lib.apply_overrides(cfg, {"parallel.sync_kwargs": '{"error_feedback": true}'})
    assert config_lib.fit_values(cfg)["sync"].error_feedback is True
    with pytest.raises(config_lib.ConfigError, match="--config.parallel.sync_kwargs takes a dict of settings"):
        config_lib.apply_overrides(cfg, {"parallel.sync_kwargs": "4"})


@pytest.mark.slow
def test_the_docs_program_runs_as_printed_with_the_same_class(tmp_path):
    """docs/communication.md's program, run as printed in a fresh process: it trains; its SignEF is this file's."""
    page = (REPO / "docs" / "communication.md").read_text()
    program = page.split("## A strategy of your own", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = (REPO / "tests" / "sign_ef.py").read_text()
    cls = source[source.index("class SignEF"):]
    assert cls.strip() in program
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, last = map(float, out.stdout.strip().splitlines()[-1].split())
    assert last < 0.7 * first


def test_no_module_outside_jdp_sync_names_a_strategy_or_its_flags():
    """A strategy's rules (its checks, record, optimizer rule, period, messages) live in its class, and the flags
    map onto the classes in jdp/sync/flags.py: a module elsewhere that names one has taken a rule back (the
    PyTorch twin asks the strategy for its DDP hook, `Sync.ddp_twin`). Exempt: the Option rows of jdp/options.py
    (the flags' names, ranges and help) and the config files (jdp/configs/), which set the flags."""
    from jdp.sync import flags

    names = [name for name in sync.__all__ if isinstance(getattr(sync, name), type) and issubclass(
        getattr(sync, name), sync.Sync) and name != "Sync"]
    pattern = re.compile(r"\b(" + "|".join((*names, *flags.FLAGS)) + r")\b")
    found = []
    for path in sorted((REPO / "jdp").rglob("*.py")):
        where = path.relative_to(REPO / "jdp").parts
        if where[0] in ("sync", "configs"):
            continue
        text = path.read_text()
        if where == ("options.py",):
            start = text.index("OPTIONS: tuple")
            text = text[:start] + text[text.index("\nBY_NAME", start):]
        found += [f"jdp/{'/'.join(where)}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                  if pattern.search(line)]
    assert not found, "\n".join(found)


class ScaledZeRO1(sync.ZeRO1):
    """ZeRO-1 whose gradient is scaled: a subclass that changes what is computed."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale

    def params(self):
        return {**super().params(), "scale": self.scale}


def test_a_subclass_of_a_sharded_strategy_records_its_own_class_and_parameters():
    """jdp's sharded strategies record the mean all-reduce's numerics (a run resumes sharded or not); breaks if a
    subclass inherits that record, so that a resume with another scale went through unrefused."""
    assert sync.ZeRO1().record() == sync.ZeRO3().record() == sync.HybridShard(2).record() == sync.AllReduce().record()
    assert ScaledZeRO1(3.0).record() == {"class": f"{__name__}:ScaledZeRO1", "dtype": "fp32", "scale": 3.0}


def test_numpy_counts_are_taken_and_a_setting_of_another_type_is_one_line():
    """`sync_every=np.int64(2)` passed fit's own check, then the constructor refused it with a traceback naming
    `every`; a string where a number goes was a bare TypeError of a comparison, and `error_feedback='no'` ran with
    error feedback on."""
    assert FitOptions(sync_every=np.int64(2), powersgd_rank=np.int32(2)).sync_every == 2
    assert [type(x) for x in (sync.LocalSGD(np.int64(3)).every, sync.PowerSGD(np.int32(2)).rank)] == [int, int]
    for make, message in [(lambda: sync.PowerSGD(min_compression_rate="2"), "min_compression_rate='2' must be a "
                                                                           "number"),
                          (lambda: sync.DiLoCo(2, outer_lr="0.5"), "outer_lr='0.5' must be a number"),
                          (lambda: sync.StreamingDiLoCo(4, overlap=1.0), "overlap=1.0 must be an int of at least 0"),
                          (lambda: sync.QuantizedAllReduce(error_feedback="no"), "error_feedback='no' must be True "
                                                                                 "or False"),
                          (lambda: sync.HybridShard(stage=True), "stage=True is not one of 1, 3")]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            make()


class Knobbed(sync.AllReduce):
    """A strategy whose parameter is a plain object, or whose params() is no dict."""

    def __init__(self, params):
        super().__init__()
        self._params = params

    def params(self):
        return self._params


def test_a_parameter_without_a_stable_record_and_params_that_are_no_dict_are_one_line(tmp_path):
    """A plain object was recorded by its str, address and all, so that every resume, settings unchanged, was
    refused as another strategy; a list from params() was an AttributeError deep in the start-up line."""
    with pytest.raises(FitError, match=r"^a strategy parameter, <.*object at 0x.*>, has no record a resume could "
                                       r"compare \(its str holds an address\); give numbers"):
        _fit(sync=Knobbed({"knob": object()}), workdir=tmp_path)
    with pytest.raises(FitError, match=r"^Knobbed.params\(\) returned \[1\]; return a dict"):
        _fit(sync=Knobbed([1]))


class Contract(sync.AllReduce):
    """A strategy that breaks one part of the contract: its per-device state's rows, its layouts, its small_sq."""

    noise_scale = True

    def __init__(self, breach):
        super().__init__()
        self.breach = breach

    def params(self):
        return {"breach": self.breach}

    def init_state(self, params, num_devices):
        return {"e": jnp.zeros((5 if self.breach == "rows" else num_devices, 3))}

    def layouts(self, abstract_state):
        if self.breach == "tree":
            return {"e": "per_device"}
        layout = "bogus" if self.breach == "layout" else sync.base.PER_DEVICE
        return super().layouts(abstract_state)._replace(sync={"e": layout})

    def reduce(self, local, state, axis_name, collective=True):
        return super().reduce(local, state, axis_name, collective)._replace(small_sq=None)


@pytest.mark.parametrize("breach, message", [
    ("rows", r"gives the train state's \.sync\['e'\] a row per device, but its init_state made it of shape \(5, 3\): "
             r"a per-device leaf's first axis is the 4 devices$"),
    ("tree", r"\.layouts returned a tree unlike the train state's \("),
    ("layout", r"gives the train state's \.sync\['e'\] the layout 'bogus'; give 'replicated', 'per_device' or "
               r"'sharded'$"),
    ("small_sq", r"has noise_scale = True, but its reduce returned no small_sq; return averaged_sums"),
])
def test_a_strategy_that_breaks_its_contract_is_named_in_one_line(breach, message):
    """Each was a traceback from inside jax (IndivisibleError, AttributeError, KeyError, a reshape of None)."""
    with pytest.raises(FitError, match=rf"^Contract\(breach='{breach}'\)[^\n]*{message}"):
        _fit(sync=Contract(breach), log_noise_scale=breach == "small_sq")
