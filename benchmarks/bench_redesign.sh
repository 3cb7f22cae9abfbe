#!/usr/bin/env bash
# One checkout's training step against another's, in interleaved rounds of `python -m jdp.bench` (the MNIST-1D
# CNN and the synthetic MLP on 1 and 2 simulated devices, 3 repeats each); prints each round's table rows.
#   benchmarks/bench_redesign.sh BEFORE_DIR [AFTER_DIR] [OUT_DIR]
# BEFORE_DIR and AFTER_DIR are jdp checkouts (AFTER_DIR defaults to this one); each side runs its own jdp and
# configs. OUT_DIR (default: a new temporary folder) receives the bench folders and logs. docs/benchmarks.md's
# "The jdp.fit step against the step before it" is BEFORE_DIR = the commit before the redesign:
#   git worktree add ../jdp-6eaefb3 6eaefb3 && benchmarks/bench_redesign.sh ../jdp-6eaefb3
set -euo pipefail
if (($# < 1 || $# > 3)); then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
before=$(cd "$1" && pwd)
after=$(cd "${2:-$(dirname "$0")/..}" && pwd)
out=${3:-$(mktemp -d /tmp/bench_redesign.XXXXXX)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

bench() {  # SIDE DIR NAME BENCH_ARGS...
  local side=$1 dir=$2 name=$3
  shift 3
  if ! (cd "$dir" && PYTHONPATH=$dir python -m jdp.bench "$@" --out "$out/$name" >"$out/$name.log" 2>&1); then
    echo "$side ($dir): jdp.bench $* failed; see $out/$name.log" >&2
    exit 1
  fi
}

for round in 1 2; do
  for side in before after; do
    if [[ $side == before ]]; then dir=$before; else dir=$after; fi
    bench $side "$dir" "cnn_$side$round" --config configs/mnist1d_cnn.py --devices 1,2 --repeats 3 --steps 100
    bench $side "$dir" "mlp_$side$round" --config configs/synthetic_mlp.py --devices 1,2 --repeats 3
  done
done
cd "$out" && grep -H "^| [12] " cnn_*.log mlp_*.log
