"""Markdown tables, JSON/CSV and PNG plots (matplotlib) for the parity and speed commands."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
from pathlib import Path

from matplotlib.figure import Figure  # files only: no pyplot, no display


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Relative (|jdp - ddp| / |jdp|) bounds on the per-step differences."""

    loss: float  # every step's train loss
    grad_norm: float  # every step's gradient norm
    step1: float  # step 1's loss and gradient norm: same weights, same batch, nothing compounded yet


@dataclasses.dataclass
class Parity:
    name: str
    steps: list[dict]  # step, loss_jdp, loss_ddp, loss_rel, grad_norm_jdp, grad_norm_ddp, grad_rel
    worst_loss: tuple[float, int]  # (relative difference, step)
    worst_grad: tuple[float, int]
    final_params_rel: float  # max over tensors of max|a - b| / max|a|
    final_worst_tensor: str
    eval: dict  # loss/accuracy of both sides
    tolerance: Tolerance
    first_step: float  # the larger of step 1's loss and gradient-norm differences
    passed: bool
    meta: dict

    def last_line(self) -> str:
        t = self.tolerance
        return (f"parity {self.name}: worst loss difference {self.worst_loss[0]:.2e} relative (step "
                f"{self.worst_loss[1]}; tolerance {t.loss:.0e}), worst gradient-norm difference "
                f"{self.worst_grad[0]:.2e} (step {self.worst_grad[1]}; tolerance {t.grad_norm:.0e}), step 1 "
                f"{self.first_step:.1e} (tolerance {t.step1:.0e}): {'PASS' if self.passed else 'FAIL'}")


def machine_info() -> dict:
    """CPU model, cores, memory and library versions of this machine (read without importing torch or jax)."""
    from importlib.metadata import distributions

    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    versions = {package: next((d.version for d in distributions(name=package)), "not installed")
                for package in ("jax", "flax", "optax", "torch")}
    return {"cpu": cpu or platform.processor() or "unknown CPU",
            "cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "os": f"{platform.system()} {platform.release()}", **versions}


def _machine_line(info: dict) -> str:
    return (f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB; Python {info['python']}, jax "
            f"{info['jax']}, flax {info['flax']}, optax {info['optax']}, torch {info['torch']}")


def write_parity(p: Parity, workdir: Path) -> None:
    m = p.meta
    info = machine_info()
    table = ["| step | loss jdp | loss DDP | rel. diff | grad norm jdp | grad norm DDP | rel. diff |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             *(f"| {r['step']} | {r['loss_jdp']:.7f} | {r['loss_ddp']:.7f} | {r['loss_rel']:.1e} | "
               f"{r['grad_norm_jdp']:.6f} | {r['grad_norm_ddp']:.6f} | {r['grad_rel']:.1e} |" for r in p.steps)]
    paragraphs = [  # separated by blank lines
        f"# Parity: jdp vs PyTorch DDP, {p.name}",
        f"{m['model']}, {m['optimizer']} (lr {m.get('lr', '?')}), global batch {m['global_batch_size']}, "
        f"{m['workers']} workers, "
        f"{m['steps']} steps, float32 on {m['device']}; jdp backend {m['jdp_backend']} on {m['workers']} "
        f"simulated devices in one process, DDP on {m['workers']} processes ({m['ddp_backend']}, 1 thread "
        f"each); BatchNorm sync: {m['bn_sync']}.",
        f"Machine: {_machine_line(info)}.",
        f"**{'PASS' if p.passed else 'FAIL'}**. {p.last_line()}. Differences are relative, |jdp - ddp| / |jdp|; step 1 "
        "has the same weights and batch on both sides; why these tolerances: jdp/compare/parity.py, TOLERANCES.",
        f"After the last step: largest parameter / BatchNorm-statistic difference {p.final_params_rel:.2e} "
        f"relative to the tensor's largest value (`{p.final_worst_tensor}`); eval loss jdp "
        f"{p.eval['loss_jdp']:.6f} vs DDP {p.eval['loss_ddp']:.6f} ({p.eval['loss_rel']:.1e} relative), "
        f"accuracy {p.eval['accuracy_jdp']:.4f} vs {p.eval['accuracy_ddp']:.4f}.",
        *([f"Sync: low-rank compression on both sides (DDP: `powerSGD_hook`); bytes per step after the start: jdp "
           f"{m['comm_bytes_jdp']:,.0f} (its compiled step's collectives, the loss sums included), DDP "
           f"{m['comm_bytes_ddp']:,.0f} (the hook's gradient payload)."]
          if m.get("hook") == "powerSGD_hook" else []),
        "Loss: mean cross-entropy over the global batch at each step (jdp: metrics.jsonl; DDP: all-reduced). "
        "Gradient norm: global L2 norm of the gradient averaged over workers, before clipping (jdp: the "
        "train step's own grad_norm, train.log_grad_norm=True; DDP: the .grad tensors after backward). "
        "In the plot, differences of exactly 0 are drawn at 1e-10.",
        "![loss curves](parity_loss.png)",
        "\n".join(table),
    ]
    (workdir / "parity.md").write_text("\n\n".join(paragraphs) + "\n")
    (workdir / "parity.json").write_text(json.dumps({**dataclasses.asdict(p), "machine": info}, indent=1))
    (workdir / "parity_steps.csv").write_text("\n".join(  # the columns of `compare`'s rows, in their order
        [",".join(p.steps[0])] + [",".join(map(repr, r.values())) for r in p.steps]) + "\n")
    plot_parity(p, workdir / "parity_loss.png")


def plot_parity(p: Parity, path: Path) -> None:
    steps = [r["step"] for r in p.steps]
    fig = Figure(figsize=(7, 6), layout="tight")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    top.plot(steps, [r["loss_jdp"] for r in p.steps], label=f"jdp ({p.meta['jdp_backend']})", lw=2.5, alpha=0.6)
    top.plot(steps, [r["loss_ddp"] for r in p.steps], label="PyTorch DDP", lw=1, ls="--", color="k")
    top.set(ylabel="train loss", title=f"{p.name}: {p.meta['workers']} workers, {p.meta['optimizer']}")
    top.legend()
    for key, what, bound, color in (("loss_rel", "loss", p.tolerance.loss, "C0"),
                                    ("grad_rel", "gradient norm", p.tolerance.grad_norm, "C1")):  # 0 drawn at 1e-10
        bottom.semilogy(steps, [max(r[key], 1e-10) for r in p.steps], ".-", color=color, label=what)
        bottom.axhline(bound, color=color, lw=1, ls=":", label=f"{what} tolerance {bound:.0e}")
    bottom.set(ylabel="|jdp - DDP| / |jdp|", xlabel="step")
    bottom.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def write_speed(s: dict, workdir: Path) -> None:
    """speed.md, .json and .png of `s`: its name, rows (per run kind, medians), runs (every run) and meta."""
    m = s["meta"]
    info = machine_info()
    tokens = m.get("tokens_per_example", 0)  # language models: tokens/s beside examples/s
    threads = m.get("torch_threads", 1)  # the DDP ranks' torch threads on a CPU (reports before the option: 1)
    threads_each = f", {threads} torch thread{'s' if threads > 1 else ''} each" if m["device"] == "cpu" else ""
    table = [
        "| run | examples/s |" + (" tokens/s |" if tokens else "") + " vs DDP | step time (ms) | time to first "
        "step (s) | peak RSS per worker (MiB) | peak RSS, all processes (MiB) |",
        "|---|---:|" + ("---:|" if tokens else "") + "---:|---:|---:|---:|---:|",
        *(f"| {row['run']} | {row['examples_per_sec']:,.0f} | "
          + (f"{row['tokens_per_sec']:,.0f} | " if tokens else "") + f"{row['ratio_vs_ddp']:.2f}x | "
          f"{row['step_time_ms']:.1f} | {row['time_to_first_step_s']:.1f} | "
          f"{row['peak_rss_mib_per_worker']:,.0f} | {row['peak_rss_mib_total']:,.0f} |" for row in s["rows"])]
    notes = [
        "- examples/s: steady state, leaving out the first step (jdp: the summary line's `examples_per_sec`; "
        "DDP: rank 0's wall time from the end of step 1 to the end of the last step). Step time = global "
        "batch / examples/s." + (f" tokens/s = examples/s x {tokens} tokens per example." if tokens else ""),
        "- time to first step: from launching the process to the end of the first step: interpreter and "
        "library start-up, data, model and (jdp) compilation"
        + (" with the persistent compilation cache on" if m.get("compile_cache") else ", with no compilation cache")
        + ". DDP's includes spawning the workers and the gloo rendezvous.",
        f"- peak RSS: ru_maxrss. jdp is one process driving {m.get('jdp_devices', m['workers'])} devices, so "
        f"both of its figures are that one process; DDP's per-worker figure is the largest of its {m['workers']} "
        "worker processes (each holds its own copy of the model, data and torch), and its total adds every worker's "
        "and the launcher's.",
        f"- per-run figures: speed.json. Command: `{m['command']}`",
    ]
    paragraphs = [  # separated by blank lines
        f"# Speed: jdp vs PyTorch DDP, {s['name']}",
        f"{m['model']}, global batch {m['global_batch_size']}, {m['steps']} steps per run, {m['repeats']} "
        f"interleaved repeats (medians shown); float32 on {m['device']}. DDP: {m['workers']} rank(s)"
        f"{threads_each}; jdp: one process, {m.get('jdp_devices', m['workers'])} device(s).",
        f"Machine: {_machine_line(info)}. Load average (1 min) around the runs: median "
        f"{m['load_avg_1min_median']:.1f}, max {m['load_avg_1min_max']:.1f} on {info['cores']} cores"
        + (" (the machine was shared with other jobs: read the ratios, not the absolute rates)."
           if m["load_avg_1min_median"] > info["cores"] + 0.5 else "."),
        "\n".join(table),
        "\n".join(notes),
        "![throughput](speed.png)",
    ]
    (workdir / "speed.md").write_text("\n\n".join(paragraphs) + "\n")
    (workdir / "speed.json").write_text(json.dumps({**s, "machine": info}, indent=1))
    plot_speed(s, workdir / "speed.png")


def plot_speed(s: dict, path: Path) -> None:
    names = [row["run"] for row in s["rows"]]
    fig = Figure(figsize=(10, 4), layout="tight")
    left, right = fig.subplots(1, 2)
    colors = ["#444444" if n == "ddp" else "#1f77b4" for n in names]
    left.bar(names, [row["examples_per_sec"] for row in s["rows"]], color=colors, alpha=0.8)
    for i, name in enumerate(names):
        runs = [r["examples_per_sec"] for r in s["runs"] if r["run"] == name]
        left.plot([i] * len(runs), runs, "k.", ms=5)
    left.set(ylabel="examples / s (steady state)",
             title=f"{s['name']}: {s['meta']['workers']} workers, batch {s['meta']['global_batch_size']}")
    right.bar(names, [row["time_to_first_step_s"] for row in s["rows"]], color=colors, alpha=0.8)
    right.set(ylabel="time to first step (s)", title="start-up + compile")
    fig.savefig(path, dpi=110)
