"""The critical batch size, measured, against the gradient noise scale jdp logs while training.

    python benchmarks/critical_batch.py --lrs 1,2,4,8 --target 0.3 --max_steps 8000 --out docs/critical_batch  # docs
    python benchmarks/critical_batch.py --batches 16,64 --lrs 1 --max_steps 300 --target 1.6 --out /tmp/cb  # smoke

For each global batch B (16 to 2048 by default) and each learning rate of a small sweep around a square-root
scaling rule, train the synthetic task (an MLP on 200,000 Gaussian examples labelled by a linear teacher) with
Adam on 2 devices until the train loss, averaged over the last `--window` examples, reaches `--target`. The
step of a run is the window's middle step then; the best learning rate gives S(B) steps and E(B) = B S(B)
examples. McCandlish et al. (2018) find (S/S_min - 1)(E/E_min - 1) = 1, that is S = S_min (1 + B_crit / B)
with B_crit = E_min / S_min: fitted here by least squares on log S. Every run also logs the gradient noise
scale (`log_noise_scale`); its value when the run reaches the target is the prediction B_simple, to compare
with the fitted B_crit. Writes critical_batch.json and critical_batch.png (steps against examples, the
Pareto front) into --out, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jdp.mesh import simulate_cpu_devices  # noqa: E402

DEVICES = 2


class TargetReached(Exception):
    """Raised by the watcher to end a run early: it has what it came for."""


class Watcher:
    """Every step: the moving window of train losses and the noise scale's moving averages."""

    every = 1

    def __init__(self, batch: int, window_examples: int, target: float) -> None:
        from jdp.noise_scale import NoiseScale

        self.window = max(1, window_examples // batch)
        self.target = target
        self.losses: list[float] = []
        self.noise = NoiseScale()
        self.reached: tuple[float, float] | None = None  # (step at the window's middle, noise scale)

    def on_step(self, step: int, metrics: dict[str, float], state: object) -> None:
        self.losses.append(metrics["loss"])
        self.noise.update(metrics)
        recent = self.losses[-self.window:]
        if len(recent) == self.window and statistics.fmean(recent) <= self.target:
            self.reached = (step - (self.window - 1) / 2, self.noise.value)
            raise TargetReached

    def on_end(self, result: object) -> None:
        pass


def train_to_target(batch: int, lr: float, args: argparse.Namespace) -> dict:
    import optax

    from jdp import trainer
    from jdp.cli import build as build_lib
    from jdp.configs import base

    cfg = base.get_config()
    cfg.data.update(name="synthetic", shape=(32,), num_classes=10, num_examples=200_000, num_eval_examples=1000)
    cfg.model.name = "mlp"
    cfg.model.kwargs.hidden_sizes = (128, 128)
    cfg.train.update(global_batch_size=batch, steps=args.max_steps, log_every=10**9, eval_every=10**9)
    cfg.parallel.num_devices = DEVICES
    task = build_lib.build_task(cfg)
    watcher = Watcher(batch, args.window, args.target)
    options = dataclasses.replace(task.options, log_noise_scale=True, callbacks=(watcher,), eval_every=0,
                                  description="")
    try:
        trainer.run(task.make_model, task.loss_fn, task.source, optimizer=optax.adam(lr), steps=args.max_steps,
                    global_batch_size=batch, options=options)
    except TargetReached:
        pass
    steps, noise = watcher.reached or (math.nan, math.nan)
    return {"batch": batch, "lr": lr, "steps": steps, "examples": steps * batch, "noise_scale": noise}


def fit_pareto(best: list[dict]) -> tuple[float, float]:
    """(S_min, B_crit) of S = S_min (1 + B_crit / B), least squares on log S over a grid of B_crit (S_min then
    has a closed form)."""
    batches = [r["batch"] for r in best]
    log_steps = [math.log(r["steps"]) for r in best]
    best_fit = (math.inf, math.nan, math.nan)
    for i in range(2001):  # B_crit from 1 to 10^6, log-spaced
        b_crit = 10 ** (6 * i / 2000)
        shape = [math.log(1 + b_crit / b) for b in batches]
        log_s_min = statistics.fmean(s - h for s, h in zip(log_steps, shape, strict=True))
        error = sum((s - log_s_min - h) ** 2 for s, h in zip(log_steps, shape, strict=True))
        if error < best_fit[0]:
            best_fit = (error, math.exp(log_s_min), b_crit)
    return best_fit[1], best_fit[2]


def plot(runs: list[dict], best: list[dict], s_min: float, b_crit: float, b_simple: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter([r["examples"] for r in runs], [r["steps"] for r in runs], s=12, color="0.7", label="every lr")
    ax.scatter([r["examples"] for r in best], [r["steps"] for r in best], color="C0", label="best lr per batch")
    for r in best:
        ax.annotate(str(r["batch"]), (r["examples"], r["steps"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    if math.isfinite(b_crit):
        batches = [2 ** (k / 8) for k in range(0, 8 * 13)]
        ax.plot([s_min * (1 + b_crit / b) * b for b in batches], [s_min * (1 + b_crit / b) for b in batches],
                color="C1", label=f"fit: (S/S_min-1)(E/E_min-1)=1, B_crit={b_crit:,.0f}")
        for b, name, color in ((b_crit, "B_crit (fit)", "C1"), (b_simple, "B_simple (jdp)", "C3")):
            if math.isfinite(b):
                ax.scatter([s_min * (1 + b_crit / b) * b], [s_min * (1 + b_crit / b)], marker="*", s=150,
                           color=color, zorder=3, label=f"{name} = {b:,.0f}, on the fitted front")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("examples to reach the target loss (E)")
    ax.set_ylabel("steps to reach the target loss (S)")
    ax.set_title(f"B_crit (fit) {b_crit:,.0f}  vs  B_simple (jdp, at the target) {b_simple:,.0f}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--lrs", default="0.5,1,2", help="multiples of the square-root rule 2e-3 * sqrt(B / 64)")
    parser.add_argument("--target", type=float, default=0.5, help="train loss to reach")
    parser.add_argument("--window", type=int, default=4096, help="examples the train loss is averaged over")
    parser.add_argument("--max_steps", type=int, default=6000)
    parser.add_argument("--out", type=Path, default=Path("critical_batch"))
    args = parser.parse_args()
    simulate_cpu_devices(DEVICES)

    runs = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for multiple in [float(m) for m in args.lrs.split(",")]:
            lr = min(3e-2, 2e-3 * math.sqrt(batch / 64)) * multiple
            runs.append(train_to_target(batch, lr, args))
            print(json.dumps(runs[-1]), flush=True)
    best = []
    for batch in sorted({r["batch"] for r in runs}):
        reached = [r for r in runs if r["batch"] == batch and math.isfinite(r["steps"])]
        if reached:
            best.append(min(reached, key=lambda r: r["steps"]))
    s_min, b_crit = fit_pareto(best) if len(best) >= 2 else (math.nan, math.nan)
    b_simple = statistics.median(r["noise_scale"] for r in best) if best else math.nan
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "critical_batch.json").write_text(json.dumps(
        {"runs": runs, "best": best, "s_min": s_min, "e_min": s_min * b_crit, "b_crit": b_crit,
         "b_simple": b_simple, "target": args.target, "window": args.window}, indent=1))
    plot(runs, best, s_min, b_crit, b_simple, args.out / "critical_batch.png")
    print("| batch | best lr | steps S | examples E | noise scale at target |\n|---|---|---|---|---|")
    for r in best:
        print(f"| {r['batch']} | {r['lr']:.2g} | {r['steps']:,.0f} | {r['examples']:,.0f} | {r['noise_scale']:,.0f} |")
    print(f"\nfit: S_min {s_min:,.0f}, E_min {s_min * b_crit:,.0f}, B_crit {b_crit:,.0f}; B_simple (median at the "
          f"target) {b_simple:,.0f}; ratio B_simple / B_crit {b_simple / b_crit:.2f}")
    return 0 if len(best) >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
