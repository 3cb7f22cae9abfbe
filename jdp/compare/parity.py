"""`python -m jdp.compare parity` (docs/compare.md): jdp (`jdp_side parity`) and its DDP twin (`jdp.compare.ddp`),
each a subprocess, trained from the same init.npz on the same batches and compared step by step against
`TOLERANCES`; final weights and eval are reported, not judged (they accumulate every step's rounding).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np

from jdp.cli import config as config_lib
from jdp.compare import procs
from jdp.compare.report import Parity, Tolerance, write_parity
from jdp.data.text import is_text

# Float32 on CPU, by optimizer family, any ResNet's apart: measured over 50 steps, rounded up (the runs:
# docs/compare_example/README.md). Step 1 and plain-SGD losses are round-off (the deep BatchNorm ResNet's step-1 norm
# ~3e-5: float32 vs float64 in either framework); a ReLU switched on one side only moves gradient norms ~1e-4, and
# momentum carries it on. Under Adam and in a BatchNorm ResNet two correct float32 implementations drift apart.
# Under low-rank compression each side draws its own Q's and bases, so only the steps before the start agree to
# round-off; after it the bound is on the loss curves' distance (docs/compare.md).
TOLERANCES = {"sgd": Tolerance(1e-6, 1e-3, 1e-5), "momentum": Tolerance(1e-3, 1e-2, 1e-5),
              "adamw": Tolerance(1e-2, 5e-2, 1e-5), "resnet": Tolerance(0.5, 1.0, 1e-4),
              "powersgd": Tolerance(0.05, 1.0, 1e-5)}


def check_supported(cfg, workers: int, *, bf16: bool = False) -> None:
    """ValueError naming the first setting the twin cannot reproduce; `bf16`: allows precision=bf16 (GPU speed)."""
    from jdp.compare.ddp import OPTIMIZERS, ddp_twin
    from jdp.compare.torch_models import MODEL_NAMES

    if cfg.optim.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.optim.name!r}: the DDP twin supports {', '.join(OPTIMIZERS)}")
    if cfg.model.name not in MODEL_NAMES:
        raise ValueError(f"model.name={cfg.model.name!r}: the PyTorch twin has no such model; it has "
                         f"{', '.join(MODEL_NAMES)}")
    if cfg.data.name not in ("mnist1d", "digits", "synthetic") and not is_text(cfg.data.name):
        raise ValueError(f"data.name={cfg.data.name!r}: the comparison uses jdp's in-memory sources only")
    # Settings the twin does not mirror, and the value it needs (absent keys are fine: an older config).
    for key, value, wanted in (("precision", cfg.get("precision", "fp32"), "fp32"),
                               ("train.grad_accum_steps", cfg.train.get("grad_accum_steps", 1), 1)):
        if value != wanted and not (bf16 and value == "bf16"):
            raise ValueError(f"{key}={value!r}: the DDP twin is plain float32 data parallelism; set "
                             f"--config.{key}={wanted}")
    ddp_twin(cfg)
    if cfg.train.global_batch_size % workers:
        raise ValueError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
                         f"--workers {workers}")


def both_sides(cfg, *, workers: int, steps: int, device: str, bf16: bool = False):
    """A copy of `cfg` both sides can train: `steps` steps on `workers`, no checkpoint, no closing sample."""
    cfg = cfg.copy_and_resolve_references()
    check_supported(cfg, workers, bf16=bf16)
    cfg.train.steps = steps
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, steps - 1)
    cfg.checkpoint.every_steps = 0
    cfg.parallel.update(cpu_devices=0 if device == "cuda" else workers, num_devices=workers if device == "cuda" else 0,
                        check_replicas_every=0)
    cfg.sample.tokens = 0  # a language model's closing sample is not part of the comparison
    return cfg


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def compare(name: str, jdp: dict, ddp: dict, jdp_final: dict, ddp_final: dict, tolerance: Tolerance,
            meta: dict | None = None) -> Parity:
    """Per-step differences and the verdict: every step within `tolerance`, step 1 within `tolerance.step1`."""
    sides = zip(jdp["losses"], ddp["losses"], jdp["grad_norms"], ddp["grad_norms"], strict=True)
    rows = [{"step": step, "loss_jdp": lj, "loss_ddp": ld, "loss_rel": _rel(lj, ld),
             "grad_norm_jdp": gj, "grad_norm_ddp": gd, "grad_rel": _rel(gj, gd)}
            for step, (lj, ld, gj, gd) in enumerate(sides, 1)]
    worst_loss = max((r["loss_rel"], r["step"]) for r in rows)
    worst_grad = max((r["grad_rel"], r["step"]) for r in rows)
    finals = {k: float(np.max(np.abs(jdp_final[k] - ddp_final[k]))) / max(float(np.max(np.abs(jdp_final[k]))), 1e-30)
              for k in jdp_final}
    worst_tensor = max(finals, key=finals.get)
    evaluation = {"loss_jdp": jdp["eval_loss"], "loss_ddp": ddp["eval_loss"],
                  "loss_rel": _rel(jdp["eval_loss"], ddp["eval_loss"]),
                  "accuracy_jdp": jdp["eval_accuracy"], "accuracy_ddp": ddp["eval_accuracy"]}
    first = max(rows[0]["loss_rel"], rows[0]["grad_rel"])
    finite = all(math.isfinite(r[k]) for r in rows for k in ("loss_rel", "grad_rel"))
    passed = (finite and worst_loss[0] <= tolerance.loss and worst_grad[0] <= tolerance.grad_norm
              and first <= tolerance.step1)
    return Parity(name, rows, worst_loss, worst_grad, finals[worst_tensor], worst_tensor, evaluation, tolerance,
                  first, passed, meta or {})


def parity(cfg, *, name: str, workers: int, steps: int, workdir: Path, tolerance: dict | None = None,
           timeout_s: float = 900, device: str = "cpu") -> Parity:
    """Runs both sides into `workdir` and reports there (`report_workdir`, which takes `tolerance`)."""
    cfg = both_sides(cfg, workers=workers, steps=steps, device=device)  # every loss logged, eval only at the end
    if cfg.model.kwargs.get("dropout", 0.0):
        raise ValueError(f"model.dropout={cfg.model.kwargs.dropout}: the two sides draw different dropout "
                         "masks; compare with --config.model.dropout=0")
    cfg.train.update(log_every=1, eval_every=steps, log_grad_norm=True)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("jdp_result.json", "ddp_result.json", "jdp_final.npz", "ddp_final.npz", "sides.json"):
        (workdir / stale).unlink(missing_ok=True)
    shutil.rmtree(workdir / "jdp_run", ignore_errors=True)  # jdp would resume from an old run's checkpoints
    config_lib.save_config(cfg, workdir / "config.json")

    jdp_run = procs.run(["-m", "jdp.compare.jdp_side", "parity", str(workdir / "config.json"), str(workdir)],
                        "the jdp side", log=workdir / "logs" / "jdp.log", timeout_s=timeout_s)
    ddp_run = run_ddp(workdir, workdir, workdir / "logs" / "ddp.log", "the DDP side", timeout_s, mode="parity",
                      workers=workers, device=device, threads=1)
    (workdir / "sides.json").write_text(json.dumps({"name": name, "workers": workers, "device": device,
                                                    "jdp_seconds": jdp_run.seconds, "ddp_seconds": ddp_run.seconds}))
    return report_workdir(workdir, tolerance)


def run_ddp(out: Path, init: Path, log: Path, what: str, timeout_s: float, **spec) -> procs.Finished:
    """The DDP side (`jdp.compare.ddp`) on OUT/config.json, from the jdp side's files in `init`; `spec`: its mode,
    workers, threads, device and compile, beside the paths, lrs and deadline this adds."""
    spec |= {"config": str(out / "config.json"), "out": str(out), "init": str(init / "init.npz"),
             "lrs": json.loads((init / "lrs.json").read_text()), "timeout_s": timeout_s, "launch_time": time.time()}
    (out / "ddp_spec.json").write_text(json.dumps(spec))
    return procs.run(["-m", "jdp.compare.ddp", str(out / "ddp_spec.json")], what, log=log, timeout_s=timeout_s)


def report_workdir(workdir: Path, tolerance: dict | None = None) -> Parity:
    """Compares the results a parity run left in `workdir` and writes its report (`--report_only`); `tolerance`:
    Tolerance fields that override the config's entry of `TOLERANCES`."""
    from jdp.compare.ddp import ddp_twin
    from jdp.compare.weights import unstacked  # torch: imported only where parity is reported

    workdir = Path(workdir)
    cfg = config_lib.load_saved_config(workdir / "config.json")
    sides = json.loads((workdir / "sides.json").read_text())
    hook = ddp_twin(cfg).hook
    family = ("powersgd" if hook == "powerSGD_hook" else "resnet" if cfg.model.name.startswith("resnet")
              else {"nesterov": "momentum"}.get(cfg.optim.name, cfg.optim.name))
    tolerance = dataclasses.replace(TOLERANCES[family], **(tolerance or {}))
    jdp = json.loads((workdir / "jdp_result.json").read_text())
    ddp = json.loads((workdir / "ddp_result.json").read_text())

    with np.load(workdir / "jdp_final.npz") as a, np.load(workdir / "ddp_final.npz") as b:
        jdp_final, ddp_final = unstacked(dict(a)), dict(b)  # a scanned model's layers named as the twin's
    meta = {"config": sides["name"], "model": cfg.model.name, "optimizer": cfg.optim.name, "lr": cfg.optim.lr,
            "workers": sides["workers"], "steps": cfg.train.steps, "global_batch_size": cfg.train.global_batch_size,
            "bn_sync": cfg.model.bn_sync, "jdp_backend": cfg.parallel.backend, "ddp_backend": ddp["backend"],
            "device": sides["device"], "jdp_seconds": sides["jdp_seconds"], "ddp_seconds": sides["ddp_seconds"],
            "torch": ddp["torch"], "hook": hook,
            "comm_bytes_jdp": jdp.get("comm_bytes_per_step"), "comm_bytes_ddp": ddp.get("comm_bytes_per_step")}
    result = compare(sides["name"], jdp, ddp, jdp_final, ddp_final, tolerance, meta)
    write_parity(result, workdir)
    return result
