#!/usr/bin/env bash
# "Making a model fit" (docs/benchmarks.md): GPT-2 small's config (ZeRO-3 on scanned blocks with full remat) runs 3
# steps on 8 simulated devices, and plain data parallelism runs the same global batches; both runs' losses, wall
# time and peak host RSS. Plain runs on 1 device, scanned and rematerialised: the plain unrolled model on 8 would
# need 8 x 4.5 GB, more than a 24 GB machine has (N devices give one device's numbers to float tolerance,
# tests/test_remat_scan.py), and one device has no rendezvous for a loaded machine to starve.
#     benchmarks/fit_real_run.sh [OUT]        (SKIP_ZERO3=1: keep OUT/zero3 from an earlier run, run plain only)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/fit_real_run}
[ -n "${SKIP_ZERO3:-}" ] || rm -rf "$out"
mkdir -p "$out" && rm -rf "$out/plain"
common=(--config configs/gpt2_small.py --config.train.steps=3 --config.train.log_every=1
        --config.data.eval_windows=8 --config.compile_cache_dir=)
[ -n "${SKIP_ZERO3:-}" ] || /usr/bin/time -v python -m jdp.train "${common[@]}" --cpu_devices 8 --workdir "$out/zero3" \
    2> "$out/zero3.time"
/usr/bin/time -v python -m jdp.train "${common[@]}" --cpu_devices 1 --config.parallel.shard_params=False \
    --workdir "$out/plain" 2> "$out/plain.time"
python - "$out" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
losses = {}
for run in ("zero3", "plain"):
    lines = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    losses[run] = [r["loss"] for r in lines if r.get("split") == "train"]
    timing = (out / f"{run}.time").read_text()
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", timing)[1]
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timing)[1]) / 2**20
    summary = next(r for r in lines if r.get("split") == "summary")
    print(f"{run}: losses {losses[run]}, wall {wall}, peak host RSS {rss:.1f} GB, compiled step peak "
          f"{summary['peak_bytes_per_device'] / 2**20:,.0f} MB/device")
worst = max(abs(a - b) / abs(b) for a, b in zip(losses["zero3"], losses["plain"], strict=True))
print(f"largest relative loss difference: {worst:.1e}")
PY
