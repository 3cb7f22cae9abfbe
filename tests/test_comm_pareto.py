"""benchmarks/comm_pareto.py, as docs/communication.md prints it, shortened to fp32 alone for 20 steps: its three
seeds run, and the CSV and the plot are written with the figures of the runs' own summaries."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_pareto_harness_runs_and_writes_its_table_and_plot(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/comm_pareto.py", "--only", "fp32", "--steps", "20",
                           "--out", str(tmp_path / "pareto"), "--runs", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr
    (row,) = list(csv.DictReader(open(tmp_path / "pareto.csv")))
    summaries = [[json.loads(line) for line in open(tmp_path / "runs" / f"fp32-s{seed}" / "metrics.jsonl")][-1]
                 for seed in range(3)]
    losses = [s["eval_loss"] for s in summaries]
    assert row["seeds"] == "3" and float(row["val_loss_mean"]) == pytest.approx(sum(losses) / 3, abs=1e-4)
    assert int(row["cross_group_bytes_per_step"]) == round(summaries[0]["comm_bytes_per_step"]) > 0
    assert float(row["cross_group_vs_fp32"]) == 1.0 and (tmp_path / "pareto.png").stat().st_size > 10_000
