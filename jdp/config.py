"""Config files: load, override from the command line, validate with one-line errors, save."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import re
import sys
from pathlib import Path

import ml_collections

from jdp import configs
from jdp.errors import UsageError
from jdp.parallel import BACKENDS
from jdp.step import ALLREDUCE_DTYPES, COMPUTE_DTYPES, NONFINITE_POLICIES

DEFAULT_CONFIG = Path(configs.__file__).parent / "mnist1d_cnn.py"

SCHEDULES = ("cosine", "linear", "constant")
OPEN_SECTIONS = ("model.kwargs.",)  # keys a config may add: a user model's own settings
# Settings a checkpoint's state depends on: changing them under a workdir is refused by default.
STATE_DEFINING = ("model.", "optim.", "data.name", "data.shape", "data.num_classes", "data.image_size",
                  "data.block_size", "data.tokenizer")


class ConfigError(UsageError):
    """A bad config or command line: the message is one line naming the field and the fix."""


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in DEFAULT_CONFIG.parent.glob("[!_]*.py") if p.stem != "base")


def load_config_file(path: str | Path) -> ml_collections.ConfigDict:
    """A config file by path, or a shipped config by name (`mnist1d_cnn`). The file's folder becomes
    importable, so a config beside the user's code can name it (`model.name = "nets:ViT"`)."""
    path = Path(path)
    if not path.is_file() and (DEFAULT_CONFIG.parent / path.with_suffix(".py").name).is_file() \
            and path.parent == Path():
        path = DEFAULT_CONFIG.parent / path.with_suffix(".py").name
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass --config PATH.py or the name of a shipped config "
                          f"({', '.join(shipped_configs())})")
    _importable(str(path.parent.absolute()))
    spec = importlib.util.spec_from_file_location(f"jdp_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config(); it must return an ml_collections.ConfigDict")
    cfg = module.get_config()
    if "code_dir" in cfg and not cfg.code_dir:
        cfg.code_dir = str(path.parent.absolute())
    return cfg


def _importable(folder: str) -> None:
    """User code in `folder` (a config's `code_dir`) can be named by import path."""
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)


def _parse_value(key: str, raw: str, current: object) -> object:
    """Parse `raw` as the type the field already has, so `--config.train.steps=1e3` fails loudly."""
    try:
        if isinstance(current, bool):
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError
            return lowered in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if isinstance(current, tuple):
            value = ast.literal_eval(raw) if raw.strip() else ()
            return tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return raw
    except (ValueError, SyntaxError):
        raise ConfigError(f"--config.{key}={raw} is not a valid {type(current).__name__}; "
                          f"give a value like {current!r}") from None


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--config.a.b=v` or `--config.a.b v` command-line arguments -> {"a.b": "v"}; anything else is refused."""
    args, overrides = list(args), {}
    while args:
        arg = args.pop(0)
        if not arg.startswith("--config."):
            raise ConfigError(f"unrecognised argument {arg}; overrides look like --config.train.steps=500")
        key, sep, value = arg[len("--config."):].partition("=")
        if not sep:
            if not args:
                raise ConfigError(f"{arg} needs a value, e.g. {arg}=VALUE")
            value = args.pop(0)
        overrides[key] = value
    return overrides


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, str]) -> ml_collections.ConfigDict:
    """Apply `--config.a.b=v` overrides; unknown keys are refused with the closest known key."""
    known = list(_flatten(cfg.to_dict()))
    for key, raw in overrides.items():
        is_open = key.startswith(OPEN_SECTIONS) and key.count(".") == 2
        if key not in known and not is_open:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean --config.{close[0]}?" if close else "see configs/base.py for the keys"
            raise ConfigError(f"unknown config key --config.{key}; {hint}")
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = _parse_value(key, raw, node[leaf]) if leaf in node else _literal(raw)
    return cfg


def _literal(raw: str) -> object:
    """A new key's value: a Python literal (number, tuple, bool, ...) if it is one, else the string."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: ml_collections.ConfigDict, *, num_devices: int | None = None) -> None:
    """Check the config before anything compiles. `num_devices` is the device count the run will use."""
    def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
        _require(value in choices, f"{key}={value!r} is unknown; choose one of {', '.join(choices)}")

    choice("optim.schedule", cfg.optim.schedule, SCHEDULES)
    choice("parallel.backend", cfg.parallel.backend, tuple(BACKENDS))
    choice("train.on_nonfinite", cfg.train.on_nonfinite, NONFINITE_POLICIES)
    choice("precision", cfg.precision, tuple(COMPUTE_DTYPES))
    choice("parallel.allreduce_dtype", cfg.parallel.allreduce_dtype, ALLREDUCE_DTYPES)
    per_device_step = cfg.parallel.backend in ("shard_map", "pmap")
    _require(per_device_step or cfg.parallel.allreduce_dtype == "fp32",
             "parallel.allreduce_dtype=bf16 needs an explicit collective; use --config.parallel.backend=shard_map")
    _validate_local_sgd(cfg, per_device_step)
    profile_steps(cfg.profile.steps)
    if cfg.parallel.shard_optimizer:
        _require(cfg.parallel.backend == "shard_map", "parallel.shard_optimizer=True needs "
                                                      "--config.parallel.backend=shard_map")
        _require(cfg.optim.name not in ("lamb", "lars"), f"optim.name={cfg.optim.name} needs whole-leaf norms "
                 "(trust ratios); parallel.shard_optimizer=True supports sgd, momentum, nesterov and adamw")
        _require(cfg.parallel.sync_every == 1, "parallel.shard_optimizer=True and parallel.sync_every > 1 "
                                               "(local SGD) cannot be combined")
    _require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep} must be at least 1")
    for key in ("train.steps", "train.global_batch_size", "train.log_every", "train.eval_every", "optim.lr",
                "train.grad_accum_steps", "parallel.sync_every"):
        value = cfg[key]
        _require(value > 0, f"{key}={value} must be positive; set --config.{key} to a value > 0")
    _require(cfg.optim.min_lr <= cfg.optim.lr, f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; "
             "the schedule decays to min_lr: lower it")
    _require(cfg.sample.temperature > 0, f"sample.temperature={cfg.sample.temperature} must be positive")
    _require(0 <= cfg.optim.b2 < 1, f"optim.b2={cfg.optim.b2} must be in [0, 1); nanoGPT uses 0.99 or 0.95")
    for key in ("train.eval_batch_size", "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip_norm",
                "optim.min_lr", "sample.tokens", "sample.top_k",
                "parallel.cpu_devices", "parallel.num_devices", "parallel.check_replicas_every",
                "checkpoint.every_steps"):
        value = cfg[key]
        _require(value >= 0, f"{key}={value} must not be negative")
    _require(cfg.optim.warmup_steps < cfg.train.steps,
             f"optim.warmup_steps={cfg.optim.warmup_steps} is not shorter than train.steps={cfg.train.steps}; "
             "lower --config.optim.warmup_steps or raise --config.train.steps")
    if num_devices is not None:
        for key in ("train.global_batch_size", "train.eval_batch_size"):
            value = cfg[key]
            _require(value % num_devices == 0,
                     f"{key}={value} is not divisible by the {num_devices} devices; use a multiple of "
                     f"{num_devices} or set --config.parallel.num_devices")
        k = cfg.train.grad_accum_steps
        _require(cfg.train.global_batch_size % (num_devices * k) == 0,
                 f"train.global_batch_size={cfg.train.global_batch_size} does not split into {k} micro-batches "
                 f"on each of {num_devices} devices; use a multiple of {num_devices * k}")


def profile_steps(spec: str) -> tuple[int, int] | None:
    """`profile.steps="A:B"` -> (A, B); "A" -> (A, A); "" -> None."""
    if not spec:
        return None
    match = re.fullmatch(r"(\d+)(?::(\d+))?", spec)
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= first <= last:
        raise ConfigError(f"profile.steps={spec!r} is not a step range; give A:B with 1 <= A <= B, e.g. 10:20")
    return first, last


def _validate_local_sgd(cfg: ml_collections.ConfigDict, per_device_step: bool) -> None:
    """Between syncs the replicas differ on purpose: checks, checkpoints and eval happen at sync points."""
    h = cfg.parallel.sync_every
    if h == 1:
        return
    _require(per_device_step, "parallel.sync_every > 1 (local SGD) needs a per-device step; use "
                              "--config.parallel.backend=shard_map or pmap")
    for key in ("train.steps", "train.eval_every", "checkpoint.every_steps", "parallel.check_replicas_every"):
        value = cfg[key]
        _require(value % h == 0, f"{key}={value} is not a multiple of parallel.sync_every={h}: with local SGD "
                                 "the replicas agree only at sync points; use a multiple")


def save_config(cfg: ml_collections.ConfigDict, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True, default=list) + "\n")


def load_saved_config(path: Path) -> ml_collections.ConfigDict:
    """A workdir's config.json back as a ConfigDict with the field types of configs/base.py."""
    from jdp.configs import base

    cfg = base.get_config()
    flat = _flatten(json.loads(path.read_text()))
    cfg = apply_overrides(cfg, {k: repr(tuple(v)) if isinstance(v, list) else str(v) for k, v in flat.items()})
    _importable(cfg.code_dir)
    return cfg


def state_changes(old: ml_collections.ConfigDict, new: ml_collections.ConfigDict) -> list[str]:
    """`key: old -> new` for each setting that changes the model or the optimizer."""
    return [f"{k}: {before!r} -> {after!r}" for k, before, after in differences(old.to_dict(), new.to_dict())
            if k.startswith(STATE_DEFINING)]


def differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted key, value in a, value in b) for each leaf of two nested dicts that differs (None if absent)."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    return [(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b))
            if flat_a.get(k) != flat_b.get(k)]


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in tree.items():
        flat.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return flat
