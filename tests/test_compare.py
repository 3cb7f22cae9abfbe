"""jdp.compare: the PyTorch twins, weight transfer both ways, parity with DDP, and the speed command."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util

if os.environ.get("CI"):
    import torch  # noqa: F401 - in CI a missing torch (the `compare` extra) fails these tests, never skips them
else:
    torch = pytest.importorskip("torch")

import optax

from jdp import models, params_file
from jdp.cli.train import build
from jdp.compare import parity as parity_lib
from jdp.compare import torch_models, weights
from jdp.modeldef import ModelDef
from tests.helpers import logits_and_state, readme_command, small_config
from tests.test_readme import doc_command

pytestmark = pytest.mark.slow  # PyTorch comparisons and CLI trainings: outside the fast tier

REPO = Path(__file__).resolve().parents[1]

# Small twins of every family; the second ResNet has the ImageNet stem on an even size (SAME max-pool).
CASES = {
    "mlp": small_config("mlp"),
    "cnn1d": small_config("cnn1d"),
    "cnn2d": small_config("mlp", model={"name": "cnn2d", "kwargs": {"channels": (4, 6), "dense_sizes": (16,)}},
                          data={"name": "synthetic", "shape": (11, 13, 2), "num_classes": 10, "num_examples": 64,
                                "num_eval_examples": 32}),
    "resnet": small_config("resnet"),
    "gpt": small_config("gpt"),  # 2 layers, width 16, block 8, characters
    "resnet_imagenet_stem": small_config("resnet", model={"kwargs": {"stem": "imagenet"}},
                                         data={"shape": (16, 16, 3)}),
}


def jdp_to_torch(params, model_state, model):
    """jdp's pure dicts -> a state_dict for the twin `model`."""
    return weights.flat_to_torch({**params_file.flatten(params, "params"),
                                  **params_file.flatten(model_state, "model_state")}, model)


def torch_to_jdp(state_dict, model):
    """A twin's state_dict -> (params, model_state) pure dicts shaped like jdp's (as nnx.to_pure_dict's)."""
    flat = weights.torch_to_flat(state_dict, model)
    return tuple(traverse_util.unflatten_dict({tuple(int(p) if p.isdigit() else p for p in key.split("/")[1:]): value
                                               for key, value in flat.items() if key.startswith(prefix + "/")})
                 for prefix in ("params", "model_state"))


@functools.cache
def _built(name):
    cfg = CASES[name].copy_and_resolve_references()
    cfg.parallel.num_devices = 1
    cfg.parallel.backend = "jit"  # BatchNorm without a device axis, so the model runs outside the step too
    b = build(cfg)
    b.cfg = cfg
    state = b.init_state()
    b.rng_state = jax.tree.map(np.asarray, state.rng_state)  # dropout streams (the GPT's; dropout 0 here)
    return b, jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, state.model_state)


def _jdp_state(name):
    """jdp's initial params and model_state (numpy, fresh copies), with BatchNorm statistics made non-trivial."""
    b, params, model_state = _built(name)
    rng = np.random.default_rng(0)
    model_state = jax.tree.map(lambda x: rng.uniform(0.5, 2.0, np.shape(x)).astype(np.float32), model_state)
    return b, jax.tree.map(np.copy, params), model_state


def _twin(b):
    cfg = b.cfg
    return torch_models.build_twin(cfg.model, b.source.input_shape, cfg.data.num_classes or b.source.num_classes)


@pytest.mark.parametrize("name", list(CASES))
def test_weights_round_trip_exactly(name):
    b, params, model_state = _jdp_state(name)
    twin = _twin(b)
    twin.load_state_dict(jdp_to_torch(params, model_state, twin), strict=True)
    back_params, back_state = torch_to_jdp(twin.state_dict(), twin)
    abstract = b.abstract_state
    assert jax.tree.structure(back_params) == jax.tree.structure(abstract.params)
    assert jax.tree.structure(back_state) == jax.tree.structure(abstract.model_state)
    for want, got in ((params, back_params), (model_state, back_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            assert x.dtype == y.dtype and np.array_equal(x, y)
    if name.startswith("resnet"):
        assert params_file.flatten(back_state, "model_state")  # the BN buffers took part

    # torch -> jdp -> torch, from arbitrary torch values (every parameter and buffer)
    generator = torch.Generator().manual_seed(1)
    original = {k: (torch.rand(v.shape, generator=generator) if v.is_floating_point() else v + 7)
                for k, v in twin.state_dict().items()}
    twin.load_state_dict(original)
    again = jdp_to_torch(*torch_to_jdp(twin.state_dict(), twin), twin)
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)


@pytest.mark.parametrize("name", list(CASES))
def test_twin_computes_what_jdp_computes(name):
    """Same logits from the same weights, in eval and in train mode, and the same BatchNorm statistics after
    a train-mode forward (momentum and biased variance conventions)."""
    b, params, model_state = _jdp_state(name)
    twin = _twin(b)
    twin.load_state_dict(jdp_to_torch(params, model_state, twin))
    x = b.source.train_batch(0)["x"][:8]
    for train in (False, True):
        logits, new_state = logits_and_state(b.model, params, model_state, x, train=train, rng_state=b.rng_state)
        twin.train(train)
        with torch.no_grad():
            twin_logits = twin(torch_models.prepare_input(twin, x)).numpy()
        np.testing.assert_allclose(twin_logits, np.asarray(logits), rtol=1e-4, atol=1e-5 * np.abs(twin_logits).max())
        _, twin_state = torch_to_jdp(twin.state_dict(), twin)
        for want, got in zip(jax.tree.leaves(new_state), jax.tree.leaves(twin_state), strict=True):
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_resnet_gradients_agree_in_float64():
    """In float64 the twin's ResNet gradient (per-device BatchNorm, two devices' rows) is jdp's to ~1e-8
    (jdp's loss is float32), so the float32 drift in ResNet parity runs is round-off, not a mismatch."""
    b, params, model_state = _jdp_state("resnet")
    cfg = b.cfg
    rows = b.source.train_batch(0)
    with jax.enable_x64(True):
        model = ModelDef.of(nnx.eval_shape(lambda: models.ResNet(
            cfg.model.kwargs.stage_sizes, "basic", cfg.model.kwargs.width, "cifar", 3, 10, dtype=jax.numpy.float64,
            rngs=nnx.Rngs(0))), bn_axis=None)
        as64 = lambda tree: jax.tree.map(lambda a: jax.numpy.asarray(a, jax.numpy.float64), tree)  # noqa: E731

        def loss(p):
            logits, _ = logits_and_state(model, p, as64(model_state), as64(rows["x"]), train=True, groups=2)
            return optax.softmax_cross_entropy_with_integer_labels(logits, rows["y"]).mean()

        grads = params_file.flatten(jax.grad(loss)(as64(params)), "params")
    twin = _twin(b)
    twin.load_state_dict(jdp_to_torch(params, model_state, twin))
    twin.double()
    half = len(rows["y"]) // 2
    for rows_slice in (slice(0, half), slice(half, None)):  # DDP: each rank's mean loss, gradients averaged
        x = torch_models.prepare_input(twin, rows["x"][rows_slice]).double()
        (torch.nn.functional.cross_entropy(twin(x), torch.from_numpy(rows["y"][rows_slice]).long()) / 2).backward()
    state = dict(twin.state_dict())
    state.update({name: p.grad for name, p in twin.named_parameters()})
    twin_grads = weights.torch_to_flat(state, twin)
    difference = np.sqrt(sum(np.sum((grads[k] - twin_grads[k]) ** 2) for k in grads))
    assert difference / np.sqrt(sum(np.sum(g**2) for g in grads.values())) < 1e-6


def test_weights_name_what_does_not_fit():
    b, params, model_state = _jdp_state("mlp")
    twin = _twin(b)
    del params["layers"][1]["bias"]
    with pytest.raises(ValueError, match="params/layers/1/bias"):
        jdp_to_torch(params, model_state, twin)


# MNIST-1D-shaped synthetic data: the same inputs as MNIST-1D without generating it in every process.
SYNTHETIC_1D = {"name": "synthetic", "shape": (40,), "num_classes": 10, "num_examples": 1024, "num_eval_examples": 64}


def test_parity_mlp_cli(tmp_path):
    """The README's command as printed (2 workers each side, 20 steps), on a smaller MLP, synthetic data and
    plain SGD (loss tolerance 1e-6): exit 0 and the verdict on the last line."""
    printed = readme_command("python -m jdp.compare parity --config configs/mnist1d_mlp.py")
    cmd = [sys.executable, *printed[1:], "--workdir", str(tmp_path),
           "--config.model.kwargs.hidden_sizes=(32,32)", "--config.optim.name=sgd", "--config.optim.lr=0.1",
           "--config.train.global_batch_size=32", *[f"--config.data.{k}={v}" for k, v in SYNTHETIC_1D.items()]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert "worst loss difference" in last and "tolerance 1e-06)" in last and last.endswith("PASS"), last
    for name in ("parity.md", "parity.json", "parity_steps.csv", "parity_loss.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "parity_steps.csv").read_text().count("\n") == 21


def test_parity_cnn1d(tmp_path):
    cfg = small_config("cnn1d", data=SYNTHETIC_1D,
                       optim={"name": "sgd", "lr": 0.1, "weight_decay": 1e-3, "schedule": "cosine", "warmup_steps": 3})
    result = parity_lib.parity(cfg, name="cnn1d", workers=2, steps=20, workdir=tmp_path, timeout_s=120)
    assert len(result.steps) == 20
    assert result.passed, result.last_line()
    assert result.tolerance.loss == 1e-6 and result.worst_loss[0] <= 1e-6 and result.first_step <= 1e-6
    assert result.final_params_rel < 1e-5
    assert result.steps[-1]["loss_jdp"] < result.steps[0]["loss_jdp"]  # it trained


def test_parity_powersgd_against_ddps_hook(tmp_path):
    """docs/compare.md's PowerSGD command as printed, on a smaller MLP, synthetic data, 8 steps and rank 2 from step
    3 (DDP: powerSGD_hook at the same rank, start step and compression rule): the steps before the start are the
    plain all-reduce and agree to round-off, and both sides send the same gradient bytes. Breaks if the hook is not
    registered (DDP then sends the whole gradient) or if the two rules pick other matrices."""
    printed = doc_command("python -m jdp.compare parity --config configs/mnist1d_mlp.py --workers 2 --steps 30 "
                          "--config.parallel.sync=powersgd")
    cmd = [sys.executable, *printed[1:], "--workdir", str(tmp_path), "--steps", "8",
           "--config.parallel.powersgd_rank=2", "--config.parallel.powersgd_start_step=3",
           "--config.model.kwargs.hidden_sizes=(32,32)", "--config.optim.name=sgd", "--config.optim.lr=0.1",
           "--config.train.global_batch_size=32", *[f"--config.data.{k}={v}" for k, v in SYNTHETIC_1D.items()]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "parity.json").read_text())
    assert max(max(r["loss_rel"], r["grad_rel"]) for r in result["steps"][:3]) < 1e-5
    jdp_bytes, ddp_bytes = result["meta"]["comm_bytes_jdp"], result["meta"]["comm_bytes_ddp"]
    assert 0 < jdp_bytes - ddp_bytes <= 8 * 4 and ddp_bytes > 0  # jdp's compiled step also sends its loss sums
    assert "Sync: low-rank compression on both sides (DDP: `powerSGD_hook`)" in (tmp_path / "parity.md").read_text()


def test_parity_gpt(tmp_path):
    """The README's GPT parity command (AdamW, per-token cross-entropy), shortened to a 2-layer GPT of width
    32 and 10 steps: the per-step losses agree far inside the Adam tolerance (measured at full size: 3.8e-7)."""
    command = "python -m jdp.compare parity --config configs/shakespeare_char_cpu.py --workers 2 --steps 50"
    assert command in (REPO / "README.md").read_text()
    args = command.split()[1:]
    args[args.index("--steps") + 1] = "10"
    short = ["--config.model.num_layers=2", "--config.model.embed_dim=32",
             "--config.model.num_heads=2", "--config.data.eval_windows=32", "--config.train.eval_batch_size=32",
             "--workdir", str(tmp_path)]
    done = subprocess.run([sys.executable, *args, *short], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    result = parity_lib.report_workdir(tmp_path)
    assert result.passed and result.worst_loss[0] < 1e-5 and result.first_step < 1e-6, result.last_line()
    assert result.steps[-1]["loss_jdp"] < result.steps[0]["loss_jdp"]  # it trained


@pytest.mark.parametrize("optim", [
    {"name": "sgd", "weight_decay": 0.1},
    {"name": "momentum", "weight_decay": 0.1, "grad_clip_norm": 0.3},
    {"name": "nesterov", "weight_decay": 0.1},
    {"name": "adamw", "weight_decay": 0.1, "warmup_steps": 2, "schedule": "linear"},
])
def test_optimizers_follow_optax(optim):
    """The twin's torch optimizer (masked weight decay, optax's clipping rule, jdp's schedule) makes the
    same updates as jdp's optax transform from the same gradients."""
    import inspect

    import optax

    from jdp.cli import optim as optim_lib
    from jdp.compare import ddp

    cfg = small_config("mlp", optim={"lr": 0.05, **optim}, train={"steps": 6})
    _, params, model_state = _jdp_state("mlp")
    extra = {"params": params} if "params" in inspect.signature(optim_lib.build_optimizer).parameters else {}
    tx, schedule = optim_lib.build_optimizer(cfg.optim, cfg.train.global_batch_size, cfg.train.steps, **extra)
    twin = _twin(_built("mlp")[0])
    twin.load_state_dict(jdp_to_torch(params, model_state, twin))
    optimizer = ddp.make_optimizer(cfg.optim, twin)
    opt_state, rng = tx.init(params), np.random.default_rng(0)
    for step_index in range(5):
        grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32) * 0.1, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(np.asarray, optax.apply_updates(params, updates))
        torch_grads = jdp_to_torch(grads, {}, twin)
        for name, p in twin.named_parameters():
            p.grad = torch_grads[name].clone()
        if cfg.optim.grad_clip_norm:
            ddp._clip_like_optax([p.grad for p in twin.parameters()], cfg.optim.grad_clip_norm)
        for group in optimizer.param_groups:
            group["lr"] = float(schedule(step_index))
        optimizer.step()
        twin_params, _ = torch_to_jdp(twin.state_dict(), twin)
        for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(twin_params), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_parity_verdict_and_last_line():
    jdp = {"losses": [2.0, 1.0], "grad_norms": [1.0, 1.0], "eval_loss": 1.0, "eval_accuracy": 0.5}
    ddp = {**jdp, "losses": [2.0, 1.001]}
    final = {"params/w": np.ones(3, np.float32)}
    tight = parity_lib.Tolerance(loss=1e-6, grad_norm=1e-6, step1=1e-6)
    result = parity_lib.compare("x", jdp, ddp, final, final, tight)
    assert not result.passed and result.worst_loss == pytest.approx((1e-3, 2))
    assert "tolerance 1e-06" in result.last_line() and result.last_line().endswith("FAIL")
    assert parity_lib.compare("x", jdp, jdp, final, final, tight).passed
    # loose bounds for the later steps still hold step 1 to its own
    first_off = {**jdp, "grad_norms": [1.001, 1.0]}
    assert not parity_lib.compare("x", jdp, first_off, final, final, parity_lib.Tolerance(1e-2, 1e-2, 1e-4)).passed
    assert parity_lib.compare("x", jdp, first_off, final, final, parity_lib.Tolerance(1e-2, 1e-2, 1e-2)).passed


def test_unsupported_settings_are_refused():
    with pytest.raises(ValueError, match="optim.name='lamb'"):
        parity_lib.check_supported(small_config("mlp", optim={"name": "lamb"}), 2)
    with pytest.raises(ValueError, match="precision"):
        cfg = small_config("mlp")
        cfg.precision = "bf16"
        parity_lib.check_supported(cfg, 2)


@pytest.mark.parametrize("command", ["parity", "speed"])
def test_a_value_out_of_range_is_one_line_before_any_side_starts(command, tmp_path, capsys):
    """Without the check in jdp.compare's main, the jdp side's subprocess failed with a traceback (exit 3)."""
    from jdp.compare.__main__ import EXIT_USAGE, main

    code = main([command, "--config", "configs/synthetic_mlp.py", "--workers", "1", "--workdir", str(tmp_path),
                 "--config.optim.lr=-1"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "optim.lr=-1.0 must be positive" in err and "Traceback" not in err
    assert not (tmp_path / "logs").exists()


def test_a_config_the_jdp_side_refuses_is_one_line_and_exit_2(tmp_path, capsys):
    """A check that needs the data (an eval batch past the eval split) runs in the jdp side's process: it was
    reported as a failed side, exit 3, with the side's traceback."""
    from jdp.compare.__main__ import EXIT_USAGE, main

    code = main(["parity", "--config", "configs/synthetic_mlp.py", "--workers", "1", "--workdir", str(tmp_path),
                 "--config.train.eval_batch_size=100000"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("jdp.compare: the jdp side refused the config: train.eval_batch_size=100000 is larger "
                          "than the eval split needs"), err


@pytest.mark.parametrize("command, flag", [("parity", "--steps"), ("speed", "--steps"), ("speed", "--repeats")])
def test_a_step_or_repeat_count_below_1_is_refused_by_the_parser(command, flag, tmp_path, capsys):
    """parity --steps 0 was the jdp side's traceback (exit 3), speed --steps 0 ran the config's steps, and
    speed --repeats 0 was "max() arg is an empty sequence"."""
    from jdp.compare.__main__ import EXIT_USAGE, main

    with pytest.raises(SystemExit) as exited:
        main([command, "--config", "configs/synthetic_mlp.py", "--workdir", str(tmp_path), flag, "0"])
    assert exited.value.code == EXIT_USAGE
    assert f"error: argument {flag}: '0' is not a positive integer" in capsys.readouterr().err


def test_speed_cli(tmp_path):
    """The README's command as printed, on a smaller MLP, synthetic data, 4 steps and one repeat; with two torch
    threads per rank and one jdp device, which reach the two sides."""
    cmd = [sys.executable, *readme_command("python -m jdp.compare speed")[1:], "--workdir", str(tmp_path),
           "--steps", "4", "--repeats", "1", "--backends", "shard_map,jit", "--compile_cache", "--timeout", "120",
           "--torch_threads", "2", "--jdp_devices", "1",
           "--config.model.kwargs.hidden_sizes=(32,32)", "--config.train.global_batch_size=32",
           *[f"--config.data.{k}={v}" for k, v in SYNTHETIC_1D.items()]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "speed.json").read_text())["rows"]
    assert [row["run"] for row in rows] == ["ddp", "shard_map", "jit"]
    for row in rows:
        assert row["examples_per_sec"] > 0 and row["time_to_first_step_s"] > 0
        assert row["peak_rss_mib_per_worker"] > 50
    assert rows[0]["ratio_vs_ddp"] == 1.0
    for name in ("speed.md", "speed.json", "speed.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| shard_map |" in (tmp_path / "speed.md").read_text()
    stored = json.loads((tmp_path / "speed.json").read_text())
    assert [r["torch_threads"] for r in stored["runs"] if r["run"] == "ddp"] == [2]
    assert json.loads((tmp_path / "runs" / "jit-0" / "config.json").read_text())["parallel"]["cpu_devices"] == 1
    assert "DDP: 2 rank(s), 2 torch threads each; jdp: one process, 1 device(s)." in (tmp_path / "speed.md").read_text()


def test_the_twin_of_a_scanned_gpt_loads_its_stacked_weights():
    """A scanned GPT's stacked layers (`params/blocks/layers/...`, one array per leaf with a layer axis) load into
    the twin's unrolled blocks (`weights.unstacked`): the same logits from the same weights."""
    cfg = small_config("gpt", model={"kwargs": {"scan_layers": True, "remat": "full"}})
    cfg.parallel.update(num_devices=1, backend="jit")
    b = build(cfg)
    state = b.init_state()
    params, model_state = jax.tree.map(np.asarray, (state.params, state.model_state))
    assert params["blocks"]["layers"]["attn"]["qkv"]["kernel"].shape[0] == 2
    twin = torch_models.build_twin(cfg.model, b.source.input_shape, b.source.num_classes)
    twin.load_state_dict(jdp_to_torch(params, model_state, twin), strict=True)
    x = b.source.train_batch(0)["x"][:8]
    logits, _ = logits_and_state(b.model, params, model_state, x, train=False,
                                 rng_state=jax.tree.map(np.asarray, state.rng_state))
    twin.eval()
    with torch.no_grad():
        twin_logits = twin(torch_models.prepare_input(twin, x)).numpy()
    np.testing.assert_allclose(twin_logits, np.asarray(logits), rtol=1e-4, atol=1e-5 * np.abs(twin_logits).max())
