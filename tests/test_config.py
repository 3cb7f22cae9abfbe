"""Bad input exits 2 with one clear line, before anything compiles; configs load from any directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from jdp import record as record_lib
from jdp.cli import config as config_lib
from jdp.cli.build import abstract_model, check_names, model_maker
from jdp.cli.resume import record_config
from jdp.cli.train import main, parse_command_line

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.py") if p.stem not in ("__init__", "base"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads_and_validates(path):
    cfg = config_lib.load_config_file(path)
    config_lib.validate(cfg)
    check_names(cfg)


def test_a_shipped_config_by_name_and_model_kwargs_overrides():
    command = parse_command_line(["--config", "digits_mlp", "--config.model.kwargs.hidden_sizes=(8,)",
                                  "--config.model.kwargs.new_setting=0.5"])
    assert command.cfg.data.name == "digits" and command.workdir == Path("runs/digits_mlp")
    assert command.cfg.model.kwargs.to_dict() == {"hidden_sizes": (8,), "new_setting": 0.5}
    with pytest.raises(config_lib.ConfigError, match="did you mean --config.model.kwargs"):
        parse_command_line(["--config", "digits_mlp", "--config.model.kwarg.hidden_sizes=(1,)"])


def test_model_x_is_short_for_model_kwargs_x(tmp_path):
    """The GPT's settings as the language-model issue names them (`model.num_layers`), in a config file and on
    the command line, land in model.kwargs, where the model is built from; both forms at odds are refused, in a file
    and on the command line (where the last would otherwise win without a word)."""
    from jdp.configs import base

    assert set(base.get_config().model) == set(config_lib.MODEL_FIELDS)
    command = parse_command_line(["--config", "shakespeare_char_cpu", "--config.model.num_layers=2",
                                  "--config.model.kwargs.num_heads=2"])
    model = command.cfg.model
    assert (model.kwargs.num_layers, model.kwargs.num_heads, model.kwargs.embed_dim) == (2, 2, 128)
    assert set(model) == set(config_lib.MODEL_FIELDS) and isinstance(model.kwargs.num_layers, int)
    both = tmp_path / "both.py"
    both.write_text("from jdp.configs import shakespeare_char_cpu\ndef get_config():\n"
                    "    c = shakespeare_char_cpu.get_config()\n    c.model.kwargs.num_layers = 3\n    return c\n")
    with pytest.raises(config_lib.ConfigError, match=r"sets model.num_layers=4 and model.kwargs.num_layers=3, the "
                                                     r"same setting; keep one"):
        parse_command_line(["--config", str(both)])
    with pytest.raises(config_lib.ConfigError, match=r"--config.model.kwargs.num_layers=3 and --config.model.num_layers"
                                                     r"=2 are the same setting; keep one"):
        parse_command_line(["--config", "shakespeare_char_cpu", "--config.model.kwargs.num_layers=3",
                            "--config.model.num_layers=2"])
    with pytest.raises(config_lib.ConfigError, match=r"did you mean --config.model.bn_sync\?"):
        parse_command_line(["--config.model.bn_synk=false"])


def test_switching_the_model_drops_the_files_model_kwargs(capsys):
    """The file's model.kwargs were its own model's settings: `--config.model.name` set to another model drops
    them with a one-line warning (digits_mlp's hidden_sizes would make cnn1d fail to build), keeps those given
    on the command line, and a model.name equal to the file's keeps them all; an unknown one warns of nothing."""
    command = parse_command_line(["--config", "digits_mlp", "--config.model.name=cnn1d"])
    assert command.cfg.model.kwargs.to_dict() == {}
    assert isinstance(abstract_model(model_maker(command.cfg, (40,), 10)), nnx.Module)
    assert capsys.readouterr().err == ("jdp: warning: --config.model.name=cnn1d replaces the config file's mlp, so "
                                       "the file's model.kwargs for it (hidden_sizes) are dropped; give the new "
                                       "model's as --config.model.kwargs.KEY=VALUE\n")
    command = parse_command_line(["--config", "cifar10_resnet18", "--config.model.name=cnn2d",
                                  "--config.model.channels=(8,)", "--config.model.kwargs.dense_sizes=(16,)"])
    assert command.cfg.model.kwargs.to_dict() == {"channels": (8,), "dense_sizes": (16,)}
    assert "model.kwargs for it (stem) are dropped" in capsys.readouterr().err
    command = parse_command_line(["--config", "cifar10_resnet18", "--config.model.name=cnn2d",  # the whole dict
                                  '--config.model.kwargs={"channels": (8,), "dense_sizes": (16,)}'])  # was dropped
    assert command.cfg.model.kwargs.to_dict() == {"channels": (8,), "dense_sizes": (16,)}
    assert capsys.readouterr().err == ""
    command = parse_command_line(["--config", "digits_mlp", "--config.model.name=mlp"])
    assert command.cfg.model.kwargs.to_dict() == {"hidden_sizes": (128,)}
    assert capsys.readouterr().err == ""
    parse_command_line(["--config", "digits_mlp", "--config.model.name=nosuch"])  # refused later, in one line
    assert capsys.readouterr().err == ""


def test_steps_below_the_files_warmup_shorten_it_with_a_warning(capsys, tmp_path):
    """A shipped recipe shortened for a smoke test runs: its warmup (from the file) becomes a tenth of the steps,
    with a one-line warning, and the config records it (config.json, and the settings jdp.fit's resume guard
    compares). A warmup given on the command line is the user's, and is refused."""
    command = parse_command_line(["--config", "shakespeare_char_cpu", "--config.train.steps=100"])
    config_lib.validate(command.cfg)
    assert command.cfg.optim.warmup_steps == 10
    assert capsys.readouterr().err == (
        "jdp: warning: optim.warmup_steps=100 from the config file is not shorter than train.steps=100: using 10, "
        "a tenth of the steps (recorded in config.json; set --config.optim.warmup_steps to choose)\n")
    record_config(command.cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["warmup_steps"] == 10
    guarded = config_lib.guarded_settings  # what jdp.fit's resume guard compares of the config
    elsewhere = parse_command_line(["--config", "shakespeare_char_cpu", "--config.train.steps=2000",
                                    "--workdir", str(tmp_path / "new")])
    assert "optim.warmup_steps: 10 -> 100" in record_lib.listed_changes(guarded(command.cfg), guarded(elsewhere.cfg),
                                                                         steps_changed=True)
    # The same command with more steps on the run's workdir extends it: the recorded cut is kept.
    longer = parse_command_line(["--config", "shakespeare_char_cpu", "--config.train.steps=2000",
                                 "--workdir", str(tmp_path)])
    assert longer.cfg.optim.warmup_steps == 10
    assert "keeping the workdir's 10, the tenth of its train.steps=100" in capsys.readouterr().err
    assert record_lib.listed_changes(guarded(command.cfg), guarded(longer.cfg), steps_changed=True) == []
    assert main(["--config", "shakespeare_char_cpu", "--config.train.steps=100", "--config.optim.warmup_steps=100",
                 "--workdir", str(tmp_path / "given")]) == 2
    assert capsys.readouterr().err == ("jdp: config error: optim.warmup_steps=100 is not shorter than "
                                       "train.steps=100; lower --config.optim.warmup_steps or raise "
                                       "--config.train.steps\n")


def test_overrides_parse_as_the_fields_type():
    command = parse_command_line(["--config.train.steps=7", "--config.optim.lr", "0.5",
                                  "--config.model.bn_sync=false", "--config.model.kwargs.hidden_sizes=(8, 4)",
                                  "--cpu_devices", "3"])
    cfg, workdir = command.cfg, command.workdir
    assert (cfg.train.steps, cfg.optim.lr, cfg.model.bn_sync, cfg.model.kwargs.hidden_sizes) == (7, 0.5, False, (8, 4))
    assert cfg.parallel.cpu_devices == 3 and workdir == Path("runs/mnist1d_cnn")


BAD = {
    "batch not divisible": (["--config.train.global_batch_size=30"], "not divisible by the 8 devices"),
    "unknown model": (["--config.model.name=vgg"], "model.name='vgg' is unknown"),
    "unknown dataset": (["--config.data.name=cifar"], "data.name='cifar' is unknown"),
    "unknown optimizer": (["--config.optim.name=adam"], "optim.name='adam' is unknown"),
    "zero steps": (["--config.train.steps=0"], "train.steps=0 must be in [1, 2147483647]"),  # an int32 counter
    "negative lr": (["--config.optim.lr=-0.1"], "optim.lr=-0.1 must be positive"),
    "missing file": (["--config", "no/such/config.py"], "config file no/such/config.py not found"),
    "mistyped key": (["--config.optim.lrr=1"],
                     "unknown config key --config.optim.lrr; did you mean --config.optim.lr?"),
    "key in the wrong section": (["--config.train.lr=1"],  # the closest spelling would be train.log_every
                                 "unknown config key --config.train.lr; did you mean --config.optim.lr?"),
    "wrong type": (["--config.train.steps=ten"], "--config.train.steps=ten is not a valid int"),
    "long warmup": (["--config.optim.warmup_steps=99999"], "optim.warmup_steps=99999 is not shorter than train.steps"),
    "stray argument": (["--steps=5"], "unrecognised argument --steps=5"),
    "ZeRO-3 under pmap": (["--config.parallel.shard_params=True", "--config.parallel.backend=pmap"],
                          "parallel.shard_params=True needs --config.parallel.backend=shard_map or jit"),
    "ZeRO-3 with LAMB": (["--config.parallel.shard_params=True", "--config.optim.name=lamb"],
                         "optim.name=lamb needs whole-leaf norms (trust ratios); parallel.shard_params=True"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_exits_2_with_one_line(case, capsys, tmp_path):
    argv, expected = BAD[case]
    assert main([*argv, "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "config.json").exists()  # refused before the run started


@pytest.mark.slow
def test_bad_config_in_a_subprocess_has_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jdp.train", "--config.optim.lrr=1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == ["jdp: config error: unknown config key --config.optim.lrr; "
                                               "did you mean --config.optim.lr?"]


@pytest.mark.slow
def test_runs_from_any_directory_with_and_without_config(tmp_path):
    """Config files import their base, and the default config is found, outside the repo root."""
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2"}
    short = ["--config.train.steps=3", "--config.train.eval_every=3", "--config.train.log_every=1"]
    for args in ([], ["--config", str(REPO / "configs" / "mnist1d_mlp.py")]):
        out = subprocess.run([sys.executable, "-m", "jdp.train", *short, *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr
    written = json.loads((tmp_path / "runs" / "mnist1d_cnn" / "config.json").read_text())
    assert written["model"]["name"] == "cnn1d" and written["train"]["steps"] == 3
    meta = json.loads((tmp_path / "runs" / "mnist1d_mlp" / "run.json").read_text())
    assert meta["versions"]["jax"] and len(meta["devices"]) == 2 and meta["command"]
