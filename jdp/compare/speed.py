"""`python -m jdp.compare speed` (docs/compare.md), each run a fresh process from the same init.npz. Repeat r runs
[ddp, *backends] rotated by r, so that a slow period of the machine does not fall on one side only.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

from jdp.cli import config as config_lib
from jdp.compare import procs
from jdp.compare.parity import both_sides, run_ddp
from jdp.compare.report import write_speed
from jdp.data.text import is_text
from jdp.metrics import read_metrics
from jdp.options import BACKENDS


def _run_jdp(cfg, backend: str, run_dir: Path, timeout_s: float, compile_cache: bool) -> dict:
    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.backend = backend
    config_lib.save_config(cfg, run_dir / "config.json")  # `--workdir` without `--config` trains this config
    cache_env = () if compile_cache else ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    finished = procs.run(["-m", "jdp.train", "--workdir", str(run_dir)], f"jdp ({backend})", log=run_dir / "log.txt",
                         timeout_s=timeout_s, env=procs.child_env(drop=cache_env))
    lines = read_metrics(run_dir)
    summary = next(r for r in lines if r["split"] == "summary")
    return {"examples_per_sec": summary["examples_per_sec"], "compile_time_s": summary["compile_time_s"],
            "time_to_first_step_s": summary["first_step_end_unix"] - finished.launch_time,
            "peak_rss_mib_per_worker": finished.peak_rss_mib, "peak_rss_mib_total": finished.peak_rss_mib,
            "final_loss": [r["loss"] for r in lines if r["split"] == "train"][-1], "wall_s": finished.seconds}


def _run_ddp(cfg, run_dir: Path, workdir: Path, workers: int, timeout_s: float, device: str,
             torch_compile: bool = False, threads: int = 1) -> dict:
    config_lib.save_config(cfg, run_dir / "config.json")
    finished = run_ddp(run_dir, workdir, run_dir / "log.txt", "DDP", timeout_s, mode="speed", workers=workers,
                       device=device, threads=threads, compile=torch_compile)
    result = json.loads((run_dir / "ddp_result.json").read_text())
    rss = result["peak_rss_mib_per_worker"]
    return {"examples_per_sec": result["examples_per_sec"],
            "time_to_first_step_s": result["time_to_first_step_s"],
            "peak_rss_mib_per_worker": max(rss), "peak_rss_mib_total": sum(rss) + finished.peak_rss_mib,
            "final_loss": result["losses"][-1], "wall_s": finished.seconds, "torch_threads": result["threads"]}


def speed(cfg, *, name: str, workers: int, workdir: Path, steps: int | None = None, repeats: int = 3,
          backends: tuple[str, ...] = tuple(BACKENDS), timeout_s: float = 600, compile_cache: bool = False,
          device: str = "cpu", command: str = "", torch_compile: bool = False, torch_threads: int = 1,
          jdp_devices: int | None = None) -> dict:
    """Runs everything into `workdir`; writes speed.md, speed.json and speed.png. On cuda with bf16 the twin runs
    under autocast; on a CPU jdp simulates `jdp_devices` devices (default `workers`) in its one process."""
    if unknown := set(backends) - set(BACKENDS):
        raise ValueError(f"unknown backend(s) {', '.join(sorted(unknown))}; use {','.join(BACKENDS)}")
    steps = steps or cfg.train.steps
    if steps < 2:
        raise ValueError("--steps must be at least 2: the first step is left out of the throughput")
    cfg = both_sides(cfg, workers=workers, steps=steps, device=device, bf16=device == "cuda")
    cfg.train.update(eval_every=steps, log_every=min(cfg.train.log_every, steps))
    if not compile_cache:
        cfg.compile_cache_dir = ""
    if device != "cuda" and jdp_devices:
        cfg.parallel.cpu_devices = jdp_devices
    workdir = Path(workdir).resolve()
    shutil.rmtree(workdir / "runs", ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    config_lib.save_config(cfg, workdir / "config.json")
    procs.run(["-m", "jdp.compare.jdp_side", "init", str(workdir / "config.json"), str(workdir)], "jdp init",
              log=workdir / "logs" / "init.log", timeout_s=timeout_s)
    cfg.init_from = str(workdir / "init.npz")

    plan = ["ddp", *backends]
    runs = []
    for rep in range(repeats):
        for kind in plan[rep % len(plan):] + plan[:rep % len(plan)]:
            run_dir = workdir / "runs" / f"{kind}-{rep}"
            run_dir.mkdir(parents=True)
            load_before = os.getloadavg()[0]
            if kind == "ddp":
                figures = _run_ddp(cfg, run_dir, workdir, workers, timeout_s, device, torch_compile, torch_threads)
            else:
                figures = _run_jdp(cfg, kind, run_dir, timeout_s, compile_cache)
            runs.append({"run": kind, "repeat": rep, **figures, "load_avg_1min": [load_before, os.getloadavg()[0]]})
            print(f"{kind:>9} repeat {rep}: {figures['examples_per_sec']:,.0f} examples/s, first step after "
                 f"{figures['time_to_first_step_s']:.1f} s, peak RSS {figures['peak_rss_mib_per_worker']:,.0f} MiB")

    batch = cfg.train.global_batch_size
    tokens = cfg.data.block_size if is_text(cfg.data.name) else 0  # a language model's tokens per example
    rate = {kind: statistics.median([r["examples_per_sec"] for r in runs if r["run"] == kind]) for kind in plan}
    rows = []
    for kind in plan:
        mine = [r for r in runs if r["run"] == kind]
        rows.append({"run": kind, "examples_per_sec": rate[kind], "ratio_vs_ddp": rate[kind] / rate["ddp"],
                     **({"tokens_per_sec": rate[kind] * tokens} if tokens else {}),
                     "step_time_ms": 1000 * batch / rate[kind],
                     **{key: statistics.median([r[key] for r in mine])
                        for key in ("time_to_first_step_s", "peak_rss_mib_per_worker", "peak_rss_mib_total")}})
    loads = [load for r in runs for load in r["load_avg_1min"]]
    meta = {"config": name, "model": cfg.model.name, "workers": workers, "steps": cfg.train.steps,
            "torch_threads": torch_threads, "jdp_devices": cfg.parallel.cpu_devices or cfg.parallel.num_devices,
            "load_avg_1min_median": statistics.median(loads), "load_avg_1min_max": max(loads),
            "repeats": repeats, "global_batch_size": batch, "tokens_per_example": tokens, "device": device,
            "compile_cache": compile_cache, "precision": cfg.precision, "torch_compile": torch_compile,
            "command": command}
    result = {"name": name, "rows": rows, "runs": runs, "meta": meta}
    write_speed(result, workdir)
    return result


def report_workdir(workdir: Path) -> dict:
    """Writes the report of the speed.json a run left in `workdir` again; returns it."""
    write_speed(stored := json.loads((Path(workdir) / "speed.json").read_text()), Path(workdir))
    return stored
