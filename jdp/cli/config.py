"""Config files: load, override from the command line, validate with one-line errors, save."""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import json
import operator
import re
import runpy
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_collections

from jdp import loggers, models
from jdp.configs import base
from jdp.distributed import check_bind_address, flatten
from jdp.environment import MAX_CPU_DEVICES
from jdp.errors import UsageError, one_line, warn
from jdp.files import write_atomic
from jdp.loggers.base import installed
from jdp.loggers.mlflow_logger import tracking_uri_problem
from jdp.options import AT_LEAST_1, BY_NAME, CONFIG_KEYS, CONFIG_NAMES, NON_NEGATIVE, POSITIVE, Range, check

DEFAULT_CONFIG = Path(base.__file__).parent / "mnist1d_cnn.py"

SCHEDULES = ("cosine", "linear", "constant")
# Keys a config may add: a user model's own settings, a user sync strategy's.
OPEN_SECTIONS = ("model.kwargs.", "parallel.sync_kwargs.")
MODEL_FIELDS = ("name", "kwargs", "bn_sync")  # configs/base.py's model section; any other model.X is model.kwargs.X
# Settings that change what a run computes (its data order or its numerics): changing them when resuming a
# workdir is refused by default. Not paths, caches, lengths, periods, nor `parallel.` (fit guards its strategy).
STATE_DEFINING = ("model.", "optim.", "task.", "loss_scale.", "seed", "precision", "train.global_batch_size",
                  "train.grad_accum_steps", "data.name", "data.shape", "data.num_classes", "data.num_examples",
                  "data.normalize", "data.augment", "data.image_size", "data.train_split", "data.block_size",
                  "data.tokenizer")


class ConfigError(UsageError):
    """A bad config or command line: the message is one line naming the field and the fix."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other usage error
        raise ConfigError(f"{message}; see {self.prog} --help")


def positive(kind: type[int] | type[float], *, zero: bool = False) -> Callable[[str], int | float]:
    """An argparse `type`: a positive finite int or float (or 0, with `zero`), refused by its text otherwise."""
    def parse(text: str) -> int | float:
        with contextlib.suppress(ValueError):
            if (value := kind(text)) in (NON_NEGATIVE if zero else POSITIVE):
                return value
        raise argparse.ArgumentTypeError(f"{text!r} is not a {'non-negative' if zero else 'positive'} "
                                         f"{'integer' if kind is int else 'finite number'}")
    return parse


def counts(text: str) -> list[int]:
    """An argparse `type`: comma-separated positive integers (`--devices 1,2,4`)."""
    try:
        return [positive(int)(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers, e.g. "
                                         "1,2,4") from None


# The valid range of every numeric field of configs/base.py (a test checks the two match); fit's from jdp.options.
RANGES: dict[str, Range] = {
    "data.num_classes": NON_NEGATIVE,  # 0 = from the data
    "data.num_examples": AT_LEAST_1,
    "data.num_eval_examples": AT_LEAST_1,
    "data.image_size": AT_LEAST_1,
    "data.cache_decoded_mb": NON_NEGATIVE,
    "data.block_size": AT_LEAST_1,
    "data.eval_windows": NON_NEGATIVE,  # 0 = every validation window
    "train.global_batch_size": POSITIVE,
    "train.steps": Range(1, 2**31 - 1, high_open=False),  # the step counter is an int32
    "optim.lr": POSITIVE,
    "optim.momentum": Range(0, 1),
    "optim.weight_decay": NON_NEGATIVE,
    "optim.warmup_steps": NON_NEGATIVE,
    "optim.grad_clip_norm": NON_NEGATIVE,
    "optim.b2": Range(0, 1),
    "optim.min_lr": NON_NEGATIVE,  # and at most optim.lr
    "sample.tokens": NON_NEGATIVE,  # 0 = no sample
    "sample.temperature": POSITIVE,
    "sample.top_k": NON_NEGATIVE,  # 0 = every token
    "parallel.cpu_devices": Range(0, MAX_CPU_DEVICES, high_open=False),  # see jdp.environment
    "parallel.allreduce_combine_threshold_bytes": NON_NEGATIVE,
    "distributed.init_timeout_s": POSITIVE,
    "distributed.heartbeat_timeout_s": POSITIVE,
    **{key: option.valid for key, option in CONFIG_KEYS.items() if isinstance(option.valid, Range)},
}


def check_ranges(cfg: ml_collections.ConfigDict) -> None:
    """Every numeric field within its `RANGES` entry, and `data.shape` a tuple of positive sizes."""
    for key, valid in RANGES.items():
        value = cfg[key]
        if value not in valid:
            raise ConfigError(f"{key}={value} {valid.phrase(value)}; set --config.{key} to a value {valid.condition()}")
    shape = cfg.data.shape
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise ConfigError(f"data.shape={tuple(shape)} must be a tuple of positive sizes; set e.g. "
                          "--config.data.shape=(28,28,1)")


def load_config_file(path: str | Path) -> ml_collections.ConfigDict:
    """A config file by path, or a shipped config by name; its folder becomes importable (`model.name="nets:ViT"`)."""
    path, shipped = Path(path), DEFAULT_CONFIG.parent / Path(path).with_suffix(".py").name
    if not path.is_file() and shipped.is_file() and path.parent == Path():
        path = shipped
    if path.exists() and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file (a device or a pipe)"
        raise ConfigError(f"config file {path} is {what}; pass --config PATH.py, a Python file defining get_config(), "
                          "or the name of a shipped config")
    if not path.is_file():
        names = sorted(p.stem for p in DEFAULT_CONFIG.parent.glob("[!_]*.py") if p.stem != "base")
        raise ConfigError(f"config file {path} not found; pass --config PATH.py or the name of a shipped config "
                          f"({', '.join(names)})")
    if path.stat().st_size == 0:
        raise ConfigError(f"config file {path} is empty; it must define get_config() returning an "
                          "ml_collections.ConfigDict (start from jdp.configs.base.get_config())")
    _importable(folder := str(path.parent.absolute()))
    module = _run_user_code(lambda: runpy.run_path(str(path), run_name=f"jdp_config_{path.stem}"), path)
    if "get_config" not in module:
        raise ConfigError(f"config file {path} defines no get_config(); it must return an ml_collections.ConfigDict")
    cfg = _run_user_code(module["get_config"], path, "get_config()")
    if not isinstance(cfg, ml_collections.ConfigDict):
        raise ConfigError(f"config file {path}: get_config() returned a {type(cfg).__name__}; it must return an "
                          "ml_collections.ConfigDict (start from jdp.configs.base.get_config())")
    _fold_model_settings(cfg, f"config file {path}")
    check_fields(cfg, f"config file {path}")
    cfg.code_dir = cfg.code_dir or folder
    return cfg


def _run_user_code(fn: Callable[[], Any], path: Path, caller: str = "") -> Any:
    """`fn()`, code of the config file at `path` (`caller` names it), any failure of it one ConfigError line."""
    try:
        return fn()
    except SystemExit as e:  # sys.exit(0) would end the run with exit 0, a success to a scheduler
        raise ConfigError(f"config file {path}{_where(e, path)} exited while loading ({caller and caller + ' called '}"
                          f"sys.exit({e.code!r})); a config file must define get_config() and return, not exit: "
                          "fix the file") from None
    except Exception as e:  # noqa: BLE001 - the user's file failed: say where, in one line
        if isinstance(e, SyntaxError) and not caller:  # the file does not parse
            raise ConfigError(f"config file {path} line {e.lineno}: {e.msg}; fix the file") from None
        raise ConfigError(f"config file {path}{_where(e, path)}: {caller and caller + ' raised '}{one_line(e)}; "
                          "fix the file") from None


def _where(error: BaseException, path: Path) -> str:
    """` line N`: the last line of `path` in the error's traceback, if any."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if Path(frame.filename).resolve() == path.resolve()]
    return f" line {lines[-1]}" if lines else ""


def check_fields(cfg: ml_collections.ConfigDict, where: str) -> None:
    """configs/base.py's keys and value types exactly (OPEN_SECTIONS aside); ints for floats, lists for tuples ok."""
    known, given = flatten(base.get_config().to_dict()), flatten(cfg.to_dict())
    for key, value in given.items():
        if key.startswith(OPEN_SECTIONS):
            continue
        if key not in known:
            raise ConfigError(f"{where} sets an unknown key {key}; {_hint(key, known, '')}")
        default = known[key]
        node, leaf = _parent(cfg, key)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        if type(value) is not type(default):
            raise ConfigError(f"{where}: {key}={value!r} is a {type(value).__name__}; it must be a "
                              f"{type(default).__name__}, like {default!r}")
        with node.ignore_type():
            node[leaf] = value
    missing = [key for key in known if key not in given and not key.startswith(OPEN_SECTIONS)]
    if missing:
        raise ConfigError(f"{where} lacks {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; "
                          "build the config from jdp.configs.base.get_config(), which sets every key")


def _fold_model_settings(cfg: ml_collections.ConfigDict, where: str) -> None:
    """Moves each `model.X` not in MODEL_FIELDS to `model.kwargs.X`: a model's settings may be written either way."""
    model = cfg.get("model")
    section = ml_collections.ConfigDict
    if not (isinstance(model, section) and isinstance(model.get("kwargs"), section)):
        return  # check_fields names what is missing
    for name in [k for k in model if k not in MODEL_FIELDS]:
        value = model[name]
        if name in model.kwargs and model.kwargs[name] != value:
            raise ConfigError(f"{where} sets model.{name}={value!r} and model.kwargs.{name}={model.kwargs[name]!r}, "
                              "the same setting; keep one")
        del model[name]
        model.kwargs[name] = value


def _model_setting(key: str) -> str:
    """Command-line `model.X` -> `model.kwargs.X`; a near miss of MODEL_FIELDS (`model.bn_synk`) is refused."""
    section, _, name = key.partition(".")
    if section != "model" or "." in name or name in MODEL_FIELDS:
        return key
    close = difflib.get_close_matches(name, MODEL_FIELDS, n=1, cutoff=0.8)
    if close:
        raise ConfigError(f"unknown config key --config.{key}; did you mean --config.model.{close[0]}?")
    return f"model.kwargs.{name}"


def _parent(cfg: ml_collections.ConfigDict, key: str) -> tuple[ml_collections.ConfigDict, str]:
    *parents, leaf = key.split(".")
    return functools.reduce(operator.getitem, parents, cfg), leaf


def _importable(folder: str) -> None:
    """User code in `folder` (a config's `code_dir`) can be named by import path."""
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)


def _parse_value(key: str, raw: str, current: object) -> object:
    """Parse `raw` as the type the field already has, so `--config.train.steps=1e3` fails loudly."""
    try:
        if isinstance(current, bool):
            return {"true": True, "1": True, "false": False, "0": False}[raw.lower()]
        if isinstance(current, (int, float)):
            return type(current)(raw)
        if isinstance(current, tuple):
            value = ast.literal_eval(raw) if raw.strip() else ()
            return tuple(value) if isinstance(value, (tuple, list)) else (value,)
        return raw
    except (KeyError, ValueError, SyntaxError):
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
    known, spelled = list(flatten(cfg.to_dict())), {}
    for given, raw in overrides.items():
        key = _model_setting(given)
        if key in spelled and overrides[spelled[key]] != raw:
            raise ConfigError(f"--config.{spelled[key]}={overrides[spelled[key]]} and --config.{given}={raw} are "
                              "the same setting; keep one")
        spelled[key] = given
        whole = f"{key}." in OPEN_SECTIONS  # the section as one dict: --config.parallel.sync_kwargs='{"k": 4}'
        if key not in known and not whole and not (key.startswith(OPEN_SECTIONS) and key.count(".") == 2):
            raise ConfigError(f"unknown config key --config.{key}; {_hint(key, known, '--config.')}")
        node, leaf = _parent(cfg, key)
        value = _parse_value(key, raw, node[leaf]) if leaf in node and not whole else _literal(raw)
        _require(not whole or isinstance(value, dict) and all(isinstance(k, str) for k in value),
                 f"--config.{key} takes a dict of settings, e.g. '{{\"rank\": 4}}', not {raw!r}; or give "
                 f"each as --config.{key}.NAME=VALUE")
        node[leaf] = ml_collections.ConfigDict(value) if whole else value
    return cfg


def apply_command_line(cfg: ml_collections.ConfigDict, overrides: dict[str, str],
                       recorded: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
    """`apply_overrides`, then drops the file's `model.kwargs` for another `model.name` and cuts the file's warmup to a
    tenth of a `train.steps` not longer than it, or to the cut a workdir's `recorded` config kept (docs/cli.md)."""
    given = {_model_setting(key) for key in overrides}
    file_model = cfg.model.name
    apply_overrides(cfg, overrides)
    # model.kwargs given whole on the command line are the new model's own: kept.
    if "model.name" in given and cfg.model.name != file_model and "model.kwargs" not in given:
        dropped = sorted(name for name in cfg.model.kwargs if f"model.kwargs.{name}" not in given)
        for name in dropped:
            del cfg.model.kwargs[name]
        if dropped and cfg.model.name in models.MODELS:  # an unknown name is refused in a line of its own
            warn(f"--config.model.name={cfg.model.name} replaces the config file's {file_model}, so the file's "
                 f"model.kwargs for it ({', '.join(dropped)}) are dropped; give the new model's as "
                 "--config.model.kwargs.KEY=VALUE")
    steps, warmup = cfg.train.steps, cfg.optim.warmup_steps
    if "optim.warmup_steps" in given:
        return cfg
    if recorded is not None and recorded.optim.warmup_steps == recorded.train.steps // 10 < warmup and \
            recorded.train.steps <= warmup and recorded.optim.warmup_steps < steps:
        cfg.optim.warmup_steps = recorded.optim.warmup_steps
        warn(f"optim.warmup_steps={warmup} from the config file: keeping the workdir's {cfg.optim.warmup_steps}, the "
             f"tenth of its train.steps={recorded.train.steps} it was cut to (set --config.optim.warmup_steps to "
             "choose)")
    elif 0 < steps <= warmup:
        cfg.optim.warmup_steps = steps // 10
        warn(f"optim.warmup_steps={warmup} from the config file is not shorter than train.steps={steps}: using "
             f"{cfg.optim.warmup_steps}, a tenth of the steps (recorded in config.json; set "
             "--config.optim.warmup_steps to choose)")
    return cfg


def _hint(key: str, known: Iterable[str], prefix: str) -> str:
    """`did you mean KEY?`: the same field name in another section (`train.lr`: `optim.lr`), else the closest."""
    same_name = [k for k in known if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    close = same_name or difflib.get_close_matches(key, list(known), n=1)
    return f"did you mean {prefix}{close[0]}?" if close else "see configs/base.py for the keys"


def _literal(raw: str) -> object:
    """A new key's value: a Python literal if it is one, else JSON (`false`, `{"k": true}`), else the string."""
    for parse in (ast.literal_eval, json.loads):
        with contextlib.suppress(ValueError, SyntaxError):
            return parse(raw)
    return raw


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def fit_values(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """`fit`'s options as the config sets them, `parallel.sync` built (with `parallel.sync_kwargs`)."""
    from jdp.sync import flags  # JAX: once a run is checked

    values = {option.name: cfg[key] for key, option in CONFIG_KEYS.items()}
    try:
        values["sync"] = flags.from_config(values["sync"], cfg.parallel.sync_kwargs.to_dict())
    except ValueError as e:
        raise ConfigError(f"parallel.sync: {e}") from None
    return values


def sync_strategy(values: dict[str, Any]) -> tuple[Any, str]:
    """(the strategy `fit_values` name, how they name it as config keys), checked."""
    return check(values, CONFIG_NAMES, ConfigError)


def with_default_sync(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of `cfg` whose sync strategy is the default mean all-reduce: every strategy key at its default."""
    from jdp.sync.flags import FLAGS

    cfg = cfg.copy_and_resolve_references()
    for name in ("sync", *FLAGS):
        section, key = BY_NAME[name].key.split(".")
        cfg[section][key] = BY_NAME[name].default
    cfg.parallel.sync_kwargs = ml_collections.ConfigDict()
    return cfg


def validate(cfg: ml_collections.ConfigDict, *, num_devices: int | None = None) -> tuple[dict[str, Any], Any]:
    """Checks the config before anything compiles, on the run's `num_devices`; returns (`fit_values`, its strategy)."""
    check_ranges(cfg)
    _require(cfg.optim.schedule in SCHEDULES,
             f"optim.schedule={cfg.optim.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    values = fit_values(cfg)
    strategy, what = sync_strategy(values)
    _require(cfg.train.steps % strategy.every == 0, f"train.steps={cfg.train.steps} is not a multiple of {what}: with "
                                                    "local SGD the replicas agree only at sync points; use a multiple")
    profile_steps(cfg.profile.steps)
    logger_names(cfg.metrics.loggers)
    uri_problem = tracking_uri_problem(cfg.metrics.mlflow_tracking_uri)  # None for "", no MLflow
    _require(uri_problem is None, f"metrics.mlflow_tracking_uri={cfg.metrics.mlflow_tracking_uri!r} {uri_problem}")
    if cfg.distributed.bind_address:  # a single-process run never listens: a typo would wait for the cluster
        check_bind_address(cfg.distributed.bind_address)
    _require(not strategy.shards_optimizer or cfg.optim.name not in ("lamb", "lars"), f"optim.name={cfg.optim.name} "
             f"needs whole-leaf norms (trust ratios); {what} supports sgd, momentum, nesterov and adamw")
    _require(cfg.optim.min_lr <= cfg.optim.lr, f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; "
             "the schedule decays to min_lr: lower it")
    _require(cfg.optim.warmup_steps < cfg.train.steps,
             f"optim.warmup_steps={cfg.optim.warmup_steps} is not shorter than train.steps={cfg.train.steps}; "
             "lower --config.optim.warmup_steps or raise --config.train.steps")
    if num_devices is not None:
        for key in ("train.global_batch_size", "train.eval_batch_size"):
            _require(cfg[key] % num_devices == 0,
                     f"{key}={cfg[key]} is not divisible by the {num_devices} devices; use a multiple of "
                     f"{num_devices} or set --config.parallel.num_devices")
        k = cfg.train.grad_accum_steps
        _require(cfg.train.global_batch_size % (num_devices * k) == 0,
                 f"train.global_batch_size={cfg.train.global_batch_size} does not split into {k} micro-batches "
                 f"on each of {num_devices} devices; use a multiple of {num_devices * k}")
    return values, strategy


def profile_steps(spec: str) -> tuple[int, int] | None:
    """`profile.steps="A:B"` -> (A, B); "A" -> (A, A); "" -> None."""
    if not spec:
        return None
    match = re.fullmatch(r"(\d+)(?::(\d+))?", spec)
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= first <= last:
        raise ConfigError(f"profile.steps={spec!r} is not a step range; give A:B with 1 <= A <= B, e.g. 10:20")
    return first, last


def save_config(cfg: ml_collections.ConfigDict, path: Path) -> None:
    write_atomic(path, json.dumps(cfg.to_dict(), indent=2, sort_keys=True, default=list) + "\n")


def load_saved_config(path: Path, fix: str = "move it away, or pass --config") -> ml_collections.ConfigDict:
    """A workdir's config.json back as a ConfigDict of configs/base.py's types; `fix` ends the line of a bad file."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable jdp config ({one_line(e)}); {fix}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} holds a {type(saved).__name__}, not a jdp config; {fix}")
    try:
        cfg = apply_overrides(base.get_config(),
                              {k: repr(tuple(v)) if isinstance(v, list) else str(v) for k, v in flatten(saved).items()})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}; {fix}") from None
    _importable(cfg.code_dir)
    return cfg


def guarded_settings(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """{dotted key: value} of the STATE_DEFINING settings, which `jdp.fit`'s resume guard keeps (`settings=`)."""
    return {k: v for k, v in sorted(flatten(cfg.to_dict()).items())
            if any(k == key or (key.endswith(".") and k.startswith(key)) for key in STATE_DEFINING)}


def logger_names(spec: str) -> list[str]:
    """`metrics.loggers` ("wandb,mlflow") -> its names, each known (`jdp.loggers.LOGGERS`) and installed."""
    given = [name.strip() for name in spec.split(",") if name.strip()]
    _require(not spec.strip() or len(given) == spec.count(",") + 1,
             f"metrics.loggers={spec!r} has an empty name between its commas; name each logger once, "
             f"comma-separated (e.g. \"wandb,mlflow\"), or give \"\" for none")
    for name in given:
        _require(name in loggers.LOGGERS, f"metrics.loggers={spec!r} names an unknown logger {name!r}; choose from "
                                          f"{', '.join(loggers.LOGGERS)}, comma-separated (e.g. \"wandb,mlflow\")")
        _require(given.count(name) == 1, f"metrics.loggers={spec!r} names {name} twice; name each logger once")
        package = loggers.LOGGERS[name].package
        _require(installed(package), f"metrics.loggers={spec!r}: the {name} logger needs the {package} package, "
                                     f"which is not installed: pip install \"jdp[{name}]\"")
    return given


def make_loggers(metrics: ml_collections.ConfigDict) -> list[loggers.Tracker]:
    """The loggers `metrics.loggers` names, each given its non-empty `metrics.NAME_ARG` keys as ARG=value."""
    return [loggers.LOGGERS[name](**{key[len(name) + 1:]: value for key, value in metrics.items()
                                     if key.startswith(f"{name}_") and value})
            for name in logger_names(metrics.loggers)]
