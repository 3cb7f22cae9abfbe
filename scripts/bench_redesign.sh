#!/bin/bash
# The step before the jdp.fit redesign (commit 6eaefb3) against this checkout, in interleaved rounds of
# `python -m jdp.bench`. Needs the old commit in a worktree: git worktree add /tmp/oldjdp 6eaefb3
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then dir=/tmp/oldjdp; else dir=$here; fi
    (cd $dir && PYTHONPATH=$dir python -m jdp.bench --config configs/mnist1d_cnn.py --devices 1,2 --repeats 3 --steps 100 --out /tmp/bench_$side$round > /tmp/bench_$side$round.log 2>&1)
    (cd $dir && PYTHONPATH=$dir python -m jdp.bench --config configs/synthetic_mlp.py --devices 1,2 --repeats 3 --out /tmp/benchmlp_$side$round > /tmp/benchmlp_$side$round.log 2>&1)
  done
done
grep -H "^| [12] " /tmp/bench_*.log /tmp/benchmlp_*.log
