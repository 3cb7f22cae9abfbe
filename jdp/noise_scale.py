"""The gradient noise scale from numbers a data-parallel step already has (McCandlish et al., "An Empirical Model
of Large-Batch Training", 2018, appendix A): each device's small-batch gradient (b) and the all-reduced one (B)
give unbiased estimates of the true gradient's squared norm and of the per-example gradient covariance's trace:

    |G|^2 ~= (B |G_B|^2 - b |G_b|^2) / (B - b)        tr(S) ~= (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

B_simple = tr(S) / |G|^2; one step's |G|^2 may come out negative, hence the moving averages (docs/batch_size.md).
"""

from __future__ import annotations

import math

EMA_DECAY = 0.95  # per step; ~20 steps of memory. Both averages share it, so their bias cancels in the ratio.


def estimate(small_sq: float, big_sq: float, b: float, big_b: float) -> tuple[float, float]:
    """(tr(S), |G|^2) from the mean squared norm of the small-batch gradients and the big-batch one."""
    return (small_sq - big_sq) / (1.0 / b - 1.0 / big_b), (big_b * big_sq - b * small_sq) / (big_b - b)


class NoiseScale:
    """Moving averages of tr(S) and |G|^2 over the steps whose update was kept."""

    def __init__(self) -> None:
        self.trace = self.true_sq = 0.0
        self.global_batch = math.nan  # the latest step's, in the same weight units as the noise scale

    def update(self, metrics: dict[str, float]) -> None:
        """One step's `noise_small_sq`, `noise_big_sq`, `noise_small_batch` and `weight` (the global batch)."""
        trace, true_sq = estimate(metrics["noise_small_sq"], metrics["noise_big_sq"], metrics["noise_small_batch"],
                                  metrics["weight"])
        self.trace = EMA_DECAY * self.trace + (1 - EMA_DECAY) * trace
        self.true_sq = EMA_DECAY * self.true_sq + (1 - EMA_DECAY) * true_sq
        self.global_batch = metrics["weight"]

    @property
    def value(self) -> float:
        """B_simple, in the loss's weight units (examples, or tokens); NaN before an estimate is positive."""
        return self.trace / self.true_sq if self.true_sq > 0 and self.trace > 0 else math.nan


def advice(global_batch: float, b_simple: float) -> str:
    """One sentence on the global batch against the noise scale (the paper's steps-vs-examples trade-off:
    steps S = S_min (1 + B_simple / B), so doubling B cuts the steps by B_simple / (2 (B + B_simple)))."""
    if not math.isfinite(b_simple):
        return "the gradient noise scale did not settle to a positive estimate; train longer to measure it"
    saving = b_simple / (2 * (global_batch + b_simple))
    where = (f"global batch {global_batch:,.0f} against a gradient noise scale of {b_simple:,.0f} "
             f"(the critical batch size it predicts)")
    if global_batch < b_simple / 4:
        return f"{where}: doubling the global batch would cut the steps by about {saving:.0%}"
    if global_batch > 4 * b_simple:
        return (f"{where}: doubling the global batch would save only {saving:.0%} of the steps and mostly "
                "add cost")
    return f"{where}: near the critical batch; doubling it would cut the steps by about {saving:.0%}"
