"""`python -m jdp.plot RUN_DIR [RUN_DIR ...] --out curves.png`: the metrics curves of several runs in one PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure  # not pyplot: no display, no backend to choose

from jdp.errors import UsageError
from jdp.metrics import read_metrics
from jdp.storage import check_output_file


def plot_runs(run_dirs: list[Path], out: Path) -> None:
    """One panel for the loss and one for each other eval metric; UsageError for a bad `out` or nothing to plot."""
    check_output_file(out, "curves.png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        raise UsageError(f"--out {out}: matplotlib writes no {out.suffix or 'suffix-less'} file; end it with one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    runs = [(run_dir, read_metrics(run_dir)) for run_dir in run_dirs]
    if not any(isinstance(r.get("loss"), (int, float)) for _, records in runs for r in records):
        raise UsageError(f"no loss to plot in the metrics.jsonl of {', '.join(map(str, run_dirs))}; pass run "
                         "directories that have trained at least one logged step")
    keys = ["loss", *sorted({k for _, records in runs for r in records if r.get("split") == "eval" for k in r}
                            - {"step", "split", "wall_time", "loss"})]
    fig = Figure(figsize=(5.5 * len(keys), 4), layout="tight")
    (axes,) = fig.subplots(1, len(keys), squeeze=False)
    for i, (run_dir, records) in enumerate(runs):
        for split, style in (("train", "-"), ("eval", "o--")):
            rows = [r for r in records if r.get("split") == split]
            for ax, key in zip(axes, keys, strict=True):
                points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]  # null: not a number
                if points:
                    ax.plot(*zip(*points, strict=True), style, color=f"C{i}", markersize=3,
                            label=f"{run_dir.name} {split}")
    for ax, key in zip(axes, keys, strict=True):
        ax.set(xlabel="step", ylabel=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_yscale("log")
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    args = parser.parse_args(argv)
    try:
        plot_runs(args.run_dirs, args.out)
    except (FileNotFoundError, UsageError) as e:
        print(f"jdp.plot: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the write failed where the folder looked writable
        print(f"jdp.plot: cannot write {args.out}: {e.strerror or e}; give another --out", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0

