"""WORKDIR/run.json, the run record `jdp.fit` writes at each run segment's start (docs/api.md, "The run record and
resume"), and its comparison for `jdp.guard`: floats rounded or to a tolerance, so a run resumes on another machine."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pkgutil
import platform
import subprocess
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jdp import sync
from jdp.data.batching import optional
from jdp.errors import FitError, one_line
from jdp.files import write_atomic
from jdp.mesh import DATA_AXIS
from jdp.options import DEFAULTS

RECORD_FILE = "run.json"
FORMAT = 1  # of the `fit` section; a run.json without one (written before it) is not guarded
# The other options that change the numerics or the data order; the sync strategy is guarded by its own record.
GUARDED_OPTIONS = ("seed", "precision", "loss_scale", "loss_scale_growth_interval", "keep_fp32", "bn_sync",
                   "grad_accum_steps")
# Optimizer-state step counts probed: the first update shows the optimizer, the later ones its schedule (which
# moves with `steps`, so it is not compared when `steps` changed).
PROBE_COUNTS = {"optimizer": (0,), "schedule": (1, 10, 100, 1000, 10000)}


def import_path(obj: Any) -> dict[str, Any] | None:
    """{"path": "module:qualname", "kwargs": {...}} of an importable function, class or JSON-kwargs partial; or None."""
    kwargs: dict[str, Any] = {}
    if isinstance(obj, functools.partial):
        if obj.args:
            return None
        kwargs, obj = dict(obj.keywords), obj.func
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name:
        return None
    try:
        json.dumps(kwargs)
        found = pkgutil.resolve_name(f"{module}:{name}")
    except (TypeError, ValueError, ImportError, AttributeError):  # kwargs not JSON, or a name that does not import
        return None
    return {"path": f"{module}:{name}", "kwargs": kwargs} if found is obj else None


def load(described: Mapping[str, Any]) -> Callable[[], Any]:
    """The zero-argument factory an `import_path` describes."""
    return functools.partial(pkgutil.resolve_name(described["path"]), **described["kwargs"])


def _name(obj: Any) -> str | None:
    """An object's import path if it has one, else its qualified name (informative, not importable)."""
    described = import_path(obj)
    if described is not None:
        return described["path"] + (f" {json.dumps(described['kwargs'], sort_keys=True)}" if described["kwargs"]
                                    else "")
    target = obj.func if isinstance(obj, functools.partial) else obj
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__qualname__)}"


def hashed(value: Any) -> str:
    """BLAKE2b (12 bytes, hex) of a JSON-able value, as canonical JSON."""
    return hashlib.blake2b(json.dumps(value, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def describe_model(model: Any, abstract_params: Any) -> dict[str, Any]:
    """The model's factory import path (if importable), class (or factory name), parameter count and shapes."""
    shapes = {jax.tree_util.keystr(path): list(leaf.shape) for path, leaf in jax.tree.leaves_with_path(abstract_params)}
    is_module = isinstance(model, nnx.Module)
    return {"factory": None if is_module else import_path(model), "class": _name(type(model) if is_module else model),
            "parameters": int(sum(np.prod(shape) for shape in shapes.values())), "shapes": shapes}


def describe_data(source: Any, factory: Any = None) -> dict[str, Any]:
    """Keys, per-example shapes and dtypes, length and a hash of fixed rows of a Source: its `sample_rows()` if any
    (a `jdp.Batcher`), else the first row of global batches 0 and 1, which process 0 reads on any process count."""
    first = source.train_batch(0)
    if hasattr(source, "sample_rows"):
        sample = source.sample_rows()
    else:
        second = source.train_batch(1)
        sample = {k: np.stack([first[k][0], second[k][0]]) for k in first}
    # Floats to 5 significant digits, -0.0 as 0.0: equal on any machine for the same computation.
    rows = {k: [float(f"{x:.5g}") + 0.0 for x in np.ravel(np.asarray(v, np.float64))]
            if np.issubdtype(v.dtype, np.floating) else np.asarray(v).tolist() for k, v in sorted(sample.items())}
    return {"keys": sorted(first), "shapes": {k: list(v.shape[1:]) for k, v in first.items()},
            "dtypes": {k: np.dtype(v.dtype).name for k, v in first.items()}, "length": int(source.num_train),
            "sample_hash": hashed(rows), "factory": import_path(factory)}


def describe_optimizer(tx: optax.GradientTransformation, abstract_params: Any) -> dict[str, list[float]]:
    """A fingerprint of what `tx` does: its updates of probe parameters (the model's tree, leaves at most 3 wide) by
    random then zero gradients (weight decay alone), twice (momentum shows), at each of `PROBE_COUNTS`, as (L1 norm,
    random projection) pairs; on a `data` axis of one, for optimizers that reduce over devices."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.standard_normal([min(d, 3) for d in x.shape]).astype(np.float32),
                          abstract_params)
    probes = [jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params),
              jax.tree.map(np.zeros_like, params)]
    directions = jax.tree.map(lambda p: rng.standard_normal(p.shape), params)

    def summary(updates: Any) -> list[float]:
        leaves = [np.asarray(u, np.float64) for u in jax.tree.leaves(updates)]
        return [float(sum(np.abs(u).sum() for u in leaves)),
                float(sum((u * d).sum() for u, d in zip(leaves, jax.tree.leaves(directions), strict=True)))]

    def updates(count: jax.Array) -> list:
        def one_device(params: Any, probes: Any) -> list:
            def counted(state: Any) -> Any:
                counts = optax.tree_utils.tree_get_all_with_path(state, "count")
                return optax.tree_utils.tree_set(state, count=count.astype(counts[0][1].dtype)) if counts else state

            first, state = tx.update(probes[0], counted(tx.init(params)), params)
            return [first, *(tx.update(grads, counted(state), params)[0] for grads in probes)]

        stacked = jax.tree.map(lambda x: x[None], (params, probes))
        return jax.vmap(one_device, axis_name=DATA_AXIS)(*stacked)

    # Every count at once, in one compiled program: eager, an optimizer's few hundred small ops cost seconds.
    counts = [count for part in PROBE_COUNTS.values() for count in part]
    probed = jax.jit(jax.vmap(updates))(jnp.asarray(counts, jnp.int32))
    summaries = {count: [value for u in jax.tree.map(lambda x, i=i: x[i], probed) for value in summary(u)]
                 for i, count in enumerate(counts)}
    return {part: [value for count in part_counts for value in summaries[count]]
            for part, part_counts in PROBE_COUNTS.items()}


def same_fingerprint(a: list[float], b: list[float], rtol: float = 1e-4) -> bool:
    """Fingerprints as (L1 norm, projection) pairs, each equal to `rtol` of its update's norm."""
    if len(a) != len(b):
        return False
    a, b = np.reshape(np.asarray(a, np.float64), (-1, 2)), np.reshape(np.asarray(b, np.float64), (-1, 2))
    return not np.any(np.abs(a - b) > rtol * np.maximum(np.abs(a[:, :1]), np.abs(b[:, :1])))


def options_record(options: Any) -> dict[str, Any]:
    """`fit`'s options as JSON: functions and objects by name, data by its description elsewhere."""
    def recorded(name: str, value: Any) -> Any:
        if name == "callbacks":
            return [_name(type(c)) for c in value]
        if hasattr(value, "record"):  # a sync strategy object: its import path and parameters
            return value.record()
        if callable(value):
            return _name(value)
        return list(value) if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value

    return {field.name: recorded(field.name, getattr(options, field.name)) for field in dataclasses.fields(options)
            if field.name != "eval_data"}


def read(workdir: Path) -> dict[str, Any] | None:
    """The `fit` section of WORKDIR/run.json; None without one of this FORMAT; FitError for an unreadable file."""
    path = workdir / RECORD_FILE
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise FitError(f"{path} cannot be read ({one_line(e)}); restore it, or move it away to resume unchecked") \
            from None
    record = saved.get("fit") if isinstance(saved, dict) else None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def write(workdir: Path, fit_record: dict[str, Any], metadata: dict[str, Any]) -> None:
    write_atomic(workdir / RECORD_FILE, json.dumps({**metadata, "fit": fit_record}, indent=2, default=str) + "\n")


FIRST, LATER = "optimizer (its first update)", "schedule (the optimizer's later updates)"
# The parts of a record a refusal names without their values (fingerprints, shapes, hashes).
_BY_NAME = ("model parameter shapes", "train data (keys, shapes, dtypes, length or sampled rows)", FIRST, LATER)
BY_HASH = " (by fingerprint)"  # ends the name of a part compared by its hash alone (`jdp.guard`)


def guarded(fit_record: dict[str, Any], with_settings: bool = True) -> dict[str, Any]:
    """A record's parts a resume must keep, by the name a refusal gives them: the caller's settings, then fit's."""
    model, data = fit_record["model"], fit_record["data"]["train"]
    settings = (fit_record.get("settings") or {}) if with_settings else {}
    return {**settings, "model": model["class"], "model parameter shapes": model["shapes"],
            "loss_fn": fit_record["loss_fn"], FIRST: fit_record["optimizer"]["optimizer"],
            LATER: fit_record["optimizer"]["schedule"],
            _BY_NAME[1]: {k: data[k] for k in ("keys", "shapes", "dtypes", "length", "sample_hash")},
            "global_batch_size": fit_record["global_batch_size"],
            # A record written before records held the strategy's: the strategy its options name by flags.
            "sync strategy": fit_record.get("strategy") or sync.strategy(types.SimpleNamespace(
                **{name: fit_record["options"].get(name, default) for name, default in DEFAULTS.items()}))[0].record(),
            # An option newer than the record's jdp had its default there.
            **{key: fit_record["options"].get(key, DEFAULTS[key]) for key in GUARDED_OPTIONS}}


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`listed_changes` of two records; the caller's `settings` compared only where both records hold them."""
    both = bool(old.get("settings")) and bool(new.get("settings"))
    if both:  # a key an older jdp guarded and this one does not (the sync flags, now the strategy's record)
        old = {**old, "settings": {k: v for k, v in old["settings"].items() if k in new["settings"]}}
    return listed_changes(guarded(old, both), guarded(new, both), old["steps"] != new["steps"])


def listed_changes(before: dict[str, Any], after: dict[str, Any], steps_changed: bool) -> list[str]:
    """The guarded parts that differ. A schedule is not listed when `steps` changed (extending a run is allowed) or
    the first update differs; every update scaled alike is listed as the learning rate."""
    first_differs = not same_fingerprint(before.get(FIRST) or [], after.get(FIRST) or [])
    listed = []
    for key in dict.fromkeys([*after, *before]):
        fingerprint = key in (FIRST, LATER)
        if (same_fingerprint(before.get(key) or [], after.get(key) or []) if fingerprint
                else before.get(key) == after.get(key)):
            continue
        if key == LATER and (steps_changed or first_differs):
            continue
        if key == FIRST:  # every update scaled alike (optax.adam(1e-3) -> adam(1e-2)): name the learning rate
            parts = (FIRST,) if steps_changed else (FIRST, LATER)
            old, new = [v for p in parts for v in before.get(p) or []], [v for p in parts for v in after[p]]
            k = new[0] / old[0] if len(old) == len(new) and old and old[0] > 0 else 1  # k: the scale, 1 for none
            if 0 < k < np.inf and k != 1 and same_fingerprint([k * v for v in old], new):
                listed.append(f"learning rate: every update is {k:.3g}x the recorded run's")
                continue
        hidden = key in _BY_NAME or key.endswith(BY_HASH)
        listed.append(key if hidden else f"{key}: {_shown(before.get(key))} -> {_shown(after.get(key))}")
    return listed


def _shown(value: Any) -> str:
    """A recorded value as it was given: a list (JSON's tuple) as a tuple."""
    return repr(tuple(value) if isinstance(value, list) else value)


def fit_record(*, model: Any, loss_fn: Callable, optimizer: optax.GradientTransformation, source: Any,
               abstract_params: Any, steps: int, global_batch_size: int, options: Any,
               data_factories: tuple[Any, Any], settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `fit` section of a run's record. `data_factories`: the zero-argument functions the train and eval data
    came from (or None). `settings`: the caller's own {name: JSON-able value} to guard (the CLI's config keys)."""
    train_factory, eval_factory = data_factories
    return {"format": FORMAT, "steps": steps, "global_batch_size": global_batch_size,
            "settings": json.loads(json.dumps(dict(settings), default=list)) if settings else None,
            "options": options_record(options), "strategy": sync.strategy(options)[0].record(),
            "model": describe_model(model, abstract_params),
            "loss_fn": _name(loss_fn),
            "imports": {"loss_fn": import_path(loss_fn), "eval_fn": import_path(options.eval_fn),
                        "eval_derived": import_path(options.eval_derived)},
            "optimizer": describe_optimizer(optimizer, abstract_params),
            "data": {"train": describe_data(source, train_factory),
                     "eval": {"length": int(optional(source, "num_eval")), "factory": import_path(eval_factory)}}}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_metadata(mesh: Mesh) -> dict:
    devices = list(mesh.devices.flat)
    return {
        "versions": {p: _version(p) for p in ("jdp", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")},
        "python": sys.version.split()[0],
        "host": platform.node(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": [str(d) for d in devices],
        "process_count": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_num_cpu_devices": jax.config.jax_num_cpu_devices,
        "git_sha": _git_sha(),
        "command": sys.argv,
    }
