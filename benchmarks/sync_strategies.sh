#!/usr/bin/env bash
# The sync strategies on the CPU GPT recipe: validation loss at the end, bytes per step and their ratio to fp32,
# on simulated CPU devices (docs/benchmarks.md, "Sync strategies on the CPU GPT recipe").
#   benchmarks/sync_strategies.sh [DEVICES] [H]     (defaults: 4 devices, H = 50)
set -euo pipefail
devices=${1:-4}
h=${2:-50}
declare -A variants=(
  [fp32]=""
  [bf16]="--config.parallel.allreduce_dtype=bf16"
  [powersgd_r4]="--config.parallel.sync=powersgd --config.parallel.powersgd_rank=4"
  [local_sgd_h$h]="--config.parallel.sync_every=$h"
  [diloco_h$h]="--config.parallel.sync_every=$h --config.parallel.outer_optimizer=nesterov"
)
for name in fp32 bf16 powersgd_r4 "local_sgd_h$h" "diloco_h$h"; do
  workdir=runs/sync-$name
  rm -rf "$workdir"
  # shellcheck disable=SC2086 - the variant's flags split on spaces
  python -m jdp.train --config configs/shakespeare_char_cpu.py --cpu_devices "$devices" --workdir "$workdir" \
    --config.checkpoint.every_steps=0 --config.sample.tokens=0 ${variants[$name]} >/dev/null
done
python - "$h" <<'PY'
import json, sys
h = sys.argv[1]
names = ["fp32", "bf16", "powersgd_r4", f"local_sgd_h{h}", f"diloco_h{h}"]
summaries = {n: [json.loads(line) for line in open(f"runs/sync-{n}/metrics.jsonl")][-1] for n in names}
base = summaries["fp32"]["comm_bytes_per_step"]
print("| strategy | validation loss | bytes per step | / fp32 | examples/s |")
print("|---|---|---|---|---|")
for n, s in summaries.items():
    print(f"| {n} | {s['eval_loss']:.4f} | {s['comm_bytes_per_step']:,.0f} | {s['comm_bytes_per_step'] / base:.3f} | "
          f"{s['examples_per_sec']:,.0f} |")
PY
