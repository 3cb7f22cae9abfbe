"""`python -m jdp.compare parity` (docs/compare.md): jdp (`jdp_side parity`) and its DDP twin (`jdp.compare.ddp`),
each a subprocess, trained from the same init.npz on the same batches and compared step by step. It fails (exit 1)
when a step's loss or gradient-norm difference, |jdp - ddp| / |jdp|, exceeds its tolerance, or step 1's exceeds the
step-1 one (`TOLERANCES`); final weights and eval are reported, not judged (they accumulate every step's rounding).
"""

from __future__ import annotations

import copy
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

# Float32 on CPU, by (model family, optimizer family): measured on a 2-core CPU over 50 steps, rounded up
# (docs/compare_example/README.md has the runs).
# - Step 1 checks model, loss and backward alone: round-off (~1e-7), but up to ~3e-5 in the norm for the deep
#   BatchNorm ResNet, whose float32 gradient (as a vector) is ~3e-3 from the float64 one in either framework (the
#   two agree to ~1e-8 in float64: tests/test_compare.py).
# - Plain SGD, MLP and CNNs: losses stay at round-off (<= 3e-7), gradient norms up to ~1e-4: a pre-activation
#   within round-off of 0 switches its ReLU on one side only (first order for the gradient, second for the loss).
# - Momentum carries a switch on (usually <= 2e-7; one MNIST-1D CNN run: 1.2e-4 loss after step 15). Under Adam
#   (division by each element's running RMS) and in a BatchNorm ResNet (chaotic at these rates) two correct float32
#   implementations drift apart: ~1e-3 loss, ~1e-2 gradient norm in 50 Adam steps; ResNet-18 at lr 0.1 up to
#   0.15 / 0.65 in 20 steps. Those bounds measure drift; step 1 and plain-SGD losses are the tight checks.
_SGD, _MOMENTUM, _ADAM = Tolerance(1e-6, 1e-3, 1e-5), Tolerance(1e-3, 1e-2, 1e-5), Tolerance(1e-2, 5e-2, 1e-5)
_RESNET = Tolerance(0.5, 1.0, 1e-4)
TOLERANCES = {(model, optimizer): _RESNET if model == "resnet" else tolerance
              for model in ("mlp", "cnn1d", "cnn2d", "resnet", "gpt")
              for optimizer, tolerance in (("sgd", _SGD), ("momentum", _MOMENTUM), ("adamw", _ADAM))}


# Low-rank compression: each side draws its own Q's and bases, so only the steps before the start agree to
# round-off; after it the bound is on the loss curves' distance (docs/compare.md).
_LOW_RANK = Tolerance(0.05, 1.0, 1e-5)


def default_tolerance(cfg) -> Tolerance:
    from jdp.compare.ddp import ddp_twin

    if ddp_twin(cfg).hook == "powerSGD_hook":
        return _LOW_RANK
    model = "resnet" if cfg.model.name.startswith("resnet") else cfg.model.name
    optimizer = {"nesterov": "momentum"}.get(cfg.optim.name, cfg.optim.name)
    return TOLERANCES[(model, optimizer)]


# Settings the twin does not mirror, and the value it needs (absent keys are fine: an older config).
_FP32_PLAIN = {"precision": "fp32", "train.grad_accum_steps": 1}


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
    for key, wanted in _FP32_PLAIN.items():
        if bf16 and key == "precision" and cfg.precision == "bf16":
            continue
        node = cfg
        for part in key.split("."):
            node = node[part] if part in node else wanted
        if node != wanted:
            raise ValueError(f"{key}={node!r}: the DDP twin is plain float32 data parallelism; set "
                             f"--config.{key}={wanted}")
    ddp_twin(cfg)
    if cfg.train.global_batch_size % workers:
        raise ValueError(f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
                         f"--workers {workers}")


def both_sides(cfg, *, workers: int, steps: int, device: str, bf16: bool = False):
    """A copy of `cfg` both sides can train: `steps` steps on `workers`, no checkpoint, no closing sample."""
    cfg = copy.deepcopy(cfg)
    check_supported(cfg, workers, bf16=bf16)
    cfg.train.steps = steps
    cfg.optim.warmup_steps = min(cfg.optim.warmup_steps, steps - 1)
    cfg.checkpoint.every_steps = 0
    cfg.parallel.update(cpu_devices=0 if device == "cuda" else workers, num_devices=workers if device == "cuda" else 0,
                        check_replicas_every=0)
    cfg.sample.tokens = 0  # a language model's closing sample is not part of the comparison
    return cfg


def prepare_config(cfg, *, workers: int, steps: int, device: str = "cpu"):
    """The config both sides train: `steps` steps, every loss logged, eval only at the end."""
    cfg = both_sides(cfg, workers=workers, steps=steps, device=device)
    if cfg.model.kwargs.get("dropout", 0.0):
        raise ValueError(f"model.dropout={cfg.model.kwargs.dropout}: the two sides draw different dropout "
                         "masks; compare with --config.model.dropout=0")
    cfg.train.update(log_every=1, eval_every=steps, log_grad_norm=True)
    cfg.init_from = ""
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


def parity(cfg, *, name: str, workers: int, steps: int, workdir: Path, tolerance: Tolerance | None = None,
           timeout_s: float = 900, device: str = "cpu") -> Parity:
    """Runs both sides into `workdir` and reports there (`report_workdir`; `tolerance` None: `default_tolerance`)."""
    cfg = prepare_config(cfg, workers=workers, steps=steps, device=device)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in ("jdp_result.json", "ddp_result.json", "jdp_final.npz", "ddp_final.npz", "sides.json"):
        (workdir / stale).unlink(missing_ok=True)
    shutil.rmtree(workdir / "jdp_run", ignore_errors=True)  # jdp would resume from an old run's checkpoints
    config_lib.save_config(cfg, workdir / "config.json")

    jdp_run = procs.run(["-m", "jdp.compare.jdp_side", "parity", "--config", str(workdir / "config.json"),
                         "--out", str(workdir), "--devices", str(cfg.parallel.cpu_devices)],
                        log=workdir / "logs" / "jdp.log", timeout_s=timeout_s)
    procs.check(jdp_run, "the jdp side")
    spec = {"config": str(workdir / "config.json"), "workers": workers, "steps": steps,
            "init": str(workdir / "init.npz"), "lrs": json.loads((workdir / "lrs.json").read_text()),
            "out": str(workdir), "mode": "parity", "device": device, "threads": 1,
            "timeout_s": timeout_s, "launch_time": time.time()}
    (workdir / "ddp_spec.json").write_text(json.dumps(spec))
    ddp_run = procs.run(["-m", "jdp.compare.ddp", str(workdir / "ddp_spec.json")],
                        log=workdir / "logs" / "ddp.log", timeout_s=timeout_s)
    procs.check(ddp_run, "the DDP side")
    (workdir / "sides.json").write_text(json.dumps({"name": name, "workers": workers, "device": device,
                                                    "jdp_seconds": jdp_run.seconds, "ddp_seconds": ddp_run.seconds}))
    return report_workdir(workdir, tolerance)


def report_workdir(workdir: Path, tolerance: Tolerance | None = None) -> Parity:
    """Compares the results a parity run left in `workdir` and writes its report (`--report_only`)."""
    workdir = Path(workdir)
    cfg = config_lib.load_saved_config(workdir / "config.json")
    sides = json.loads((workdir / "sides.json").read_text())
    tolerance = tolerance or default_tolerance(cfg)
    jdp = json.loads((workdir / "jdp_result.json").read_text())
    ddp = json.loads((workdir / "ddp_result.json").read_text())
    from jdp.compare.ddp import ddp_twin
    from jdp.compare.weights import unstacked  # torch: imported only where parity is reported

    with np.load(workdir / "jdp_final.npz") as a, np.load(workdir / "ddp_final.npz") as b:
        jdp_final, ddp_final = unstacked(dict(a)), dict(b)  # a scanned model's layers named as the twin's
    meta = {"config": sides["name"], "model": cfg.model.name, "optimizer": cfg.optim.name, "lr": cfg.optim.lr,
            "workers": sides["workers"], "steps": cfg.train.steps, "global_batch_size": cfg.train.global_batch_size,
            "bn_sync": cfg.model.bn_sync, "jdp_backend": cfg.parallel.backend, "ddp_backend": ddp["backend"],
            "device": sides["device"], "jdp_seconds": sides["jdp_seconds"], "ddp_seconds": sides["ddp_seconds"],
            "torch": ddp["torch"], "hook": ddp_twin(cfg).hook,
            "comm_bytes_jdp": jdp.get("comm_bytes_per_step"), "comm_bytes_ddp": ddp.get("comm_bytes_per_step")}
    result = compare(sides["name"], jdp, ddp, jdp_final, ddp_final, tolerance, meta)
    write_parity(result, workdir)
    return result
