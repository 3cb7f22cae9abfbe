#!/usr/bin/env bash
# Train one config under each backend on simulated CPU devices and overlay the curves:
#   scripts/compare_backends.sh [CONFIG] [DEVICES]   (defaults: configs/mnist1d_cnn.py, 8)
set -euo pipefail
config=${1:-configs/mnist1d_cnn.py}
devices=${2:-8}
name=$(basename "$config" .py)
for backend in shard_map pmap jit; do
  python -m jdp.train --config "$config" --cpu_devices "$devices" --workdir "runs/$name-$backend" \
    --config.parallel.backend="$backend"
done
python -m jdp.plot "runs/$name-shard_map" "runs/$name-pmap" "runs/$name-jit" --out "runs/$name-backends.png"
