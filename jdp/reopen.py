"""A run reopened from Python: `jdp.restore`, `jdp.evaluate` and `jdp.export_params` (docs/api.md, "Reopening a
run")."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jdp import preemption, storage, trainer
from jdp import record as record_lib
from jdp.checkpoint import CheckpointError, read_arrays
from jdp.data.batching import as_dataset
from jdp.errors import DiskError, FitError, UsageError, one_line
from jdp.files import write_atomic
from jdp.mesh import mesh_devices
from jdp.modeldef import LossFn, ModelDef, state_groups
from jdp.params_file import flatten


def imported(described: dict[str, Any], what: str) -> Callable[[], Any]:
    """`jdp.record.load`, failing in one line."""
    try:
        return record_lib.load(described)
    except Exception as e:  # noqa: BLE001 - the recorded code is gone or moved: say so
        raise FitError(f"the run's {what} {described['path']} cannot be imported here ({one_line(e)}); make it "
                       "importable (install its package, or run from its folder)") from None


def restore(workdir: str | Path, model: nnx.Module | Callable[[], nnx.Module] | None = None, *,
            step: int | None = None) -> nnx.Module:
    """The run's model with the parameters and state of its latest checkpoint (or of `step`): `model` (a module,
    filled in place, or a factory), else built from the run's record. FitError names what is missing or does not fit."""
    preemption.install_excepthook()  # an uncaught FitError: one line and exit 2
    return _restored(Path(workdir), model, step)[1]


def _restored(workdir: Path, model: nnx.Module | Callable[[], nnx.Module] | None, step: int | None,
              call: str = "jdp.restore(workdir, model)") -> tuple[int, nnx.Module]:
    """The step and the model of the run's checkpoint; `call`: how the caller passes a model, for messages."""
    if not workdir.is_dir():
        raise FitError(f"workdir {workdir} {'is not a directory' if workdir.exists() else 'does not exist'}; pass "
                       "the workdir of a run")
    if model is None:
        fit_record = record_lib.read(workdir)
        if fit_record is None and not (workdir / "checkpoints").is_dir():
            raise FitError(f"{workdir} holds no run (neither {record_lib.RECORD_FILE} nor checkpoints); pass the "
                           "workdir of a jdp.train or jdp.fit run")
        if fit_record is None:
            raise FitError(f"{workdir / record_lib.RECORD_FILE} holds no jdp.fit record (a run of an earlier jdp); "
                           f"pass the model: {call}")
        if fit_record["model"]["factory"] is None:
            raise FitError(f"{workdir}'s model ({fit_record['model']['class']}) cannot be rebuilt: fit was given an "
                           f"instance, or a function that cannot be imported; pass it: {call}")
        model = imported(fit_record["model"]["factory"], "model")
    if not isinstance(model, nnx.Module):
        model = model()
    if not (workdir / "checkpoints").is_dir():
        raise FitError(f"{workdir / 'checkpoints'} not found; pass the workdir of a run that saved a checkpoint")
    try:
        step, arrays = read_arrays(workdir / "checkpoints", step)
    except CheckpointError as e:  # said as any refusal of this call ("jdp: error:"), not as a training resume's
        raise FitError(str(e)) from None
    params, model_state = state_groups(model)
    for name, have, saved in (("parameters", params, arrays["params"]), ("state", model_state, arrays["model_state"])):
        shapes = jax.tree.map(np.shape, have), jax.tree.map(np.shape, saved)
        if shapes[0] != shapes[1]:
            raise FitError(f"the model's {name} do not match the checkpoint's in {workdir} (model {shapes[0]}, "
                           f"checkpoint {shapes[1]}); pass the model the run trained")
    ModelDef.of(model, None).load_into(model, arrays["params"], arrays["model_state"], arrays["rng_state"])
    return step, model


def evaluate(model: nnx.Module, loss_fn: LossFn, data: Any, *, global_batch_size: int | None = None,
             num_devices: int = 0, backend: str = "shard_map",
             derived: Callable[[dict[str, float]], dict[str, float]] | None = None) -> dict[str, float]:
    """Weighted means of every output of `loss_fn` over all of `data` (a dict of arrays, a random-access dataset
    or a factory of one), the model in eval mode, data-parallel over `num_devices` (0 = all): the last batch is
    padded and the padding masked, so nothing is dropped. `global_batch_size`: rows per eval batch (default: the
    data in one batch, up to 1024 rows per device). `derived`: more metrics from the means (e.g. perplexity)."""
    preemption.install_excepthook()  # an uncaught FitError: one line and exit 2
    try:
        n = len(mesh_devices(num_devices))
        data = as_dataset(data() if trainer.is_factory(data) else data, "evaluate's data")
    except UsageError as e:
        raise FitError(str(e)) from None
    rows = len(data)
    if rows < n:
        raise FitError(f"evaluate needs at least one row per device: {rows} row(s), {n} device(s)")
    batch = min(global_batch_size or 1024 * n, trainer.eval_batch_limit(rows, n))
    if batch % n:
        raise FitError(f"evaluate's global_batch_size={global_batch_size} is not divisible by the {n} devices")
    engine = trainer.prepare(model, loss_fn, data, optimizer=optax.set_to_zero(), global_batch_size=n,
                             options=trainer.FitOptions(eval_data=data, eval_batch_size=batch, num_devices=n,
                                                        backend=backend, eval_derived=derived))
    try:
        return engine.parallel.evaluate(engine.parallel.to_devices(engine.init_state()), engine.source.eval_batches())
    finally:
        engine.source.close()


def export_params(workdir: str | Path, path: str | Path,
                  model: nnx.Module | Callable[[], nnx.Module] | None = None, *,
                  step: int | None = None) -> tuple[int, int]:
    """Writes what `python -m jdp.export` writes: the run's parameters and model state (not its RNG streams) as an
    .npz that `init_from` and `jdp.params_file` read; returns (step, number of arrays). `model`: as in `restore`."""
    preemption.install_excepthook()  # an uncaught FitError: one line and exit 2
    path = params_file_path(path)
    step, restored = _restored(Path(workdir), model, step, "jdp.export_params(workdir, path, model)")
    params, model_state = state_groups(restored)
    write_params_file(path, params, model_state, step)
    return step, len(jax.tree.leaves((params, model_state)))


def params_file_path(path: str | Path) -> Path:
    """`path` with ".npz" added as np.savez adds it; FitError where it cannot be written."""
    given = Path(path)
    path = given if given.suffix == ".npz" else given.with_name(given.name + ".npz")
    try:
        storage.check_output_file(given if given.is_dir() else path, "params.npz")
    except UsageError as e:
        raise FitError(str(e)) from None
    return path


def write_params_file(path: Path, params: Any, model_state: Any, step: int) -> None:
    """`params/...`, `model_state/...` and `step` written atomically to `path`."""
    arrays = {**flatten(params, "params"), **flatten(model_state, "model_state"), "step": np.int64(step)}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    try:
        write_atomic(path, buffer.getvalue())
    except OSError as e:
        if failure := storage.disk_failure(e):
            raise DiskError(f"{storage.describe(failure, path)}; {storage.remedy(failure[0])}, or give another "
                            "path") from None
        raise FitError(f"cannot write {path}: {e.strerror or one_line(e)}; give another path") from None


def evaluate_run(workdir: Path) -> tuple[int, dict[str, float]]:
    """`python -m jdp.train --eval_only` of a `jdp.fit` run: the model, loss and eval data its record names."""
    fit_record = record_lib.read(workdir)
    if fit_record is None:
        raise FitError(f"{workdir} holds neither config.json nor a jdp.fit record ({record_lib.RECORD_FILE}); pass "
                       "the workdir of a jdp.train or jdp.fit run")
    imports = fit_record["imports"]
    needed = {"model": fit_record["model"]["factory"], "loss": imports["eval_fn"] or imports["loss_fn"],
              "eval data": fit_record["data"]["eval"]["factory"]}
    missing = [what for what, described in needed.items() if described is None]
    if missing:
        raise FitError(f"{workdir} is a jdp.fit run whose {' and '.join(missing)} cannot be imported (fit was given "
                       "objects, not importable factories); evaluate it in Python: "
                       "jdp.evaluate(jdp.restore(workdir, model), loss_fn, data)")
    step, model = _restored(workdir, None, None)
    options = fit_record["options"]
    batch = options["eval_batch_size"] or fit_record["global_batch_size"]
    available = len(jax.devices())
    n = next(k for k in range(min(options["num_devices"] or available, available), 0, -1) if batch % k == 0)
    derived = imports["eval_derived"]
    return step, evaluate(model, imported(needed["loss"], "loss"), imported(needed["eval data"], "eval data")(),
                          global_batch_size=batch, num_devices=n, backend=options["backend"],
                          derived=None if derived is None else imported(derived, "eval_derived"))
