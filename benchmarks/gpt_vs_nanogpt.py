"""The CPU GPT recipe (configs/shakespeare_char_cpu.py: 4 layers, 4 heads, width 128, block 64, batch 12) in jdp
and in nanoGPT's own train.py (../shared/bench/nanogpt, unchanged), on the same text, one process each, interleaved:
tokens/s after warm-up, medians over repeats, and their ratio (docs/benchmarks.md, "jdp against nanoGPT").

    python benchmarks/gpt_vs_nanogpt.py [--steps 300] [--repeats 3] [--nanogpt ../shared/bench/nanogpt]
        [--jdp "NAME=FLAGS" ...]   (default: "1 device=--cpu_devices 1" and "2 devices=--cpu_devices 2")
        [--checkout "NAME=PATH" ...]   (variant NAME runs the jdp of another checkout, e.g. a `git worktree`)

jdp: `python -m jdp.train` with each variant's flags, no eval, checkpoint or sample; its summary's tokens_per_sec
(the steady state: the first steps and the compilation left out). The variants run the same global batch.
nanoGPT: its README's CPU recipe (--device=cpu --compile=False, dropout 0), evaluating only at iteration 0;
12 x 64 tokens over the median of its `iter N` times, the first 20 iterations left out. Both use every core of
the machine (torch's default thread count, XLA's pool).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 12 * 64
NANOGPT_ARGS = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0",
                "--always_save_checkpoint=False"]
ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def nanogpt_dir(source: Path, text: Path, into: Path) -> Path:
    into.mkdir()
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(source / name, into / name)
    (into / "config").mkdir()
    shutil.copy(source / "train_shakespeare_char.py", into / "config" / "train_shakespeare_char.py")
    subprocess.run([sys.executable, str((source / "prepare_text.py").resolve()), str(text),
                    str(into / "data" / "shakespeare_char")], check=True, capture_output=True, cwd=into)
    return into


def run_nanogpt(where: Path, steps: int) -> float:
    done = subprocess.run([sys.executable, "train.py", "config/train_shakespeare_char.py", *NANOGPT_ARGS,
                           f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps * 10}"],
                          cwd=where, capture_output=True, text=True, timeout=1800, check=True)
    times = [float(m[2]) / 1e3 for line in done.stdout.splitlines() if (m := ITER.match(line)) and int(m[1]) >= 20]
    return TOKENS_PER_STEP / statistics.median(times)


def run_jdp(workdir: Path, steps: int, flags: list[str], checkout: Path = ROOT) -> float:
    shutil.rmtree(workdir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "jdp.train", "--config", str(checkout / "configs/shakespeare_char_cpu.py"),
                    "--workdir", str(workdir), f"--config.train.steps={steps}", "--config.train.eval_every=0",
                    "--config.checkpoint.every_steps=0", "--config.sample.tokens=0", "--config.train.log_every=50",
                    *flags], capture_output=True, text=True, timeout=1800, check=True, cwd=checkout)
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return next(line for line in reversed(lines) if line.get("split") == "summary")["tokens_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nanogpt", type=Path, default=ROOT.parent / "shared/bench/nanogpt")
    parser.add_argument("--jdp", action="append", help="NAME=FLAGS: a jdp variant, FLAGS for python -m jdp.train")
    parser.add_argument("--checkout", action="append", default=[], help="NAME=PATH: variant NAME's jdp checkout")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.jdp or ["1 device=--cpu_devices 1", "2 devices=--cpu_devices 2"])
    checkouts = {name: Path(path).resolve() for name, path in (c.split("=", 1) for c in args.checkout)}
    from jdp.data.text import shakespeare_path  # the text jdp's recipe trains on, given to nanoGPT too

    with tempfile.TemporaryDirectory() as tmp:
        where = nanogpt_dir(args.nanogpt, shakespeare_path(), Path(tmp) / "nanogpt")
        rates: dict[str, list[float]] = {name: [] for name in [*variants, "nanoGPT"]}
        for repeat in range(args.repeats):
            for name, flags in variants.items():
                rates[name].append(run_jdp(Path(tmp) / "jdp", args.steps, flags.split(), checkouts.get(name, ROOT)))
            rates["nanoGPT"].append(run_nanogpt(where, args.steps))
            print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()) + " tokens/s",
                  flush=True)
    nano = statistics.median(rates["nanoGPT"])
    print(f"medians of {args.repeats} (load average {os.getloadavg()[0]:.1f} at the end):")
    print("| run | tokens/s | / nanoGPT |\n|---|---:|---:|")
    for name, values in rates.items():
        flags = f" (`{variants[name]}`)" if name in variants else ""
        print(f"| {'jdp, ' + name if flags else name}{flags} | {statistics.median(values):,.0f} | "
              f"{statistics.median(values) / nano:.2f} |")


if __name__ == "__main__":
    main()
