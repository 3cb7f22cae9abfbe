#!/usr/bin/env bash
# Local SGD on MNIST-1D: accuracy and throughput for a few sync intervals H, on simulated CPU devices.
#   benchmarks/local_sgd_tradeoff.sh [DEVICES] [H ...]     (defaults: 4 devices, H = 1 2 4 8 16)
set -euo pipefail
devices=${1:-4}
shift || true
intervals=${*:-1 2 4 8 16}
echo "| H | eval accuracy | examples/s |"
echo "|---|---|---|"
for h in $intervals; do
  workdir=runs/local_sgd-h$h
  rm -rf "$workdir"
  python -m jdp.train --config configs/mnist1d_cnn.py --cpu_devices "$devices" --workdir "$workdir" \
    --config.parallel.sync_every="$h" --config.parallel.check_replicas_every=1008 \
    --config.checkpoint.every_steps=0 --config.train.eval_every=6000 >/dev/null
  python - "$workdir" "$h" <<'PY'
import json, sys
summary = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")][-1]
print(f"| {sys.argv[2]} | {summary['eval_accuracy']:.4f} | {summary['examples_per_sec']:,.0f} |")
PY
done
