#!/usr/bin/env bash
# The one GPU check: under 8 minutes on one H200, offline, run from the repository root (scripts/gpu_check.sh).
# Steps in priority order, so that running out of time loses the least useful ones; each has its own timeout
# (capped by what is left of GPU_CHECK_BUDGET_S, default 450 s) and prints one result. Steps that need a GPU say
# "no GPU" on a machine without one and the check moves on (a CPU dry run takes about a minute).
#   1 versions (jax, flax, optax, torch, NCCL, device)   2 XLA flags: jdp's parse, an unknown one aborts
#   3 ResNet-50 224x224, global batch 256, synthetic: jdp bf16 img/s, MFU, compile time, XLA memory
#   4 torchvision ResNet-50, channels_last + bf16 autocast + cudnn.benchmark: img/s beside jdp's
#   5 jdp fp32 (TF32) img/s: bf16/TF32 shows whether bf16 really runs in bf16
#   6 python -m jdp.train end to end (compile cache, orbax, eval, replica check) vs jdp.bench's examples/sec
#   7 jdp.compare parity on the GPU, JAX_DEFAULT_MATMUL_PRECISION=highest (MLP: torch's float32 matmuls are
#     full float32 by default, its cuDNN convolutions TF32, so a conv model would need TF32's tolerance)
#   8 host JPEG decode + random-resized crop img/s, 1 and 16 threads (about 3,000 img/s per GPU needed)
#   9 the shakespeare_char GPT's tokens/s in jdp bf16 and in its torch.compile + bf16 autocast twin
# Output: $OUT if set, else ./gpu_check/: gpu_check.log (the result lines), gpu_check.json (the figures) and
# gpu_check_full.log (every step's whole output). Scratch (checkpoints, reports) goes to a temporary folder.
# Wheels in .whl/ (scripts/gpu_wheels.sh) are put on PYTHONPATH: nothing is installed.
# GPU_CHECK_ONLY="versions gpt summary" runs the named steps only (scripts/gpu_bench.sh: the GPT against torch).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/gpu_check.XXXXXX)
log=$out/gpu_check.log full=$out/gpu_check_full.log
: >"$log"
: >"$full"
budget=${GPU_CHECK_BUDGET_S:-450}
start=$(date +%s)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
  PYTHONPATH=$PYTHONPATH:$PWD/.whl/unzipped:$(ls "$PWD"/.whl/*.whl | paste -sd:)
fi
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=$work/xla_cache
backend=$(timeout 60 python3 -c "import jax; print(jax.default_backend())" 2>/dev/null | tail -n 1)

say() { echo "$*" | tee -a "$log"; }

# step NAME TIMEOUT_S cpu|gpu RESULT_PATTERN COMMAND...: runs COMMAND, logs the output lines matching the pattern.
step() {
  local name=$1 limit=$2 needs=$3 pattern=$4
  shift 4
  [[ -z ${GPU_CHECK_ONLY:-} || " $GPU_CHECK_ONLY " == *" $name "* ]] || return 0
  local left=$((budget - ($(date +%s) - start)))
  if [[ $needs == gpu && $backend != gpu ]]; then
    say "[$name] no GPU (JAX backend: ${backend:-none})"
    return
  fi
  if ((left < 15)); then
    say "[$name] skipped: the check's ${budget}s are spent"
    return
  fi
  ((limit > left)) && limit=$left
  local t0 rc
  t0=$(date +%s)
  echo "=== $name: $*" >>"$full"
  timeout -k 5 "$limit" "$@" >"$work/$name.txt" 2>&1
  rc=$?
  cat "$work/$name.txt" >>"$full"
  local took=$(($(date +%s) - t0))
  if ((rc == 124 || rc == 137)); then
    say "[$name] timed out after ${limit}s"
  elif ((rc != 0)); then
    say "[$name] failed (exit $rc, ${took}s): $(grep -v '^\s*$' "$work/$name.txt" | tail -n 1)"
  else
    say "[$name] ok (${took}s)"
    grep -E "$pattern" "$work/$name.txt" | sed 's/^/  /' | tee -a "$log"
  fi
}

resnet50=(--config configs/synthetic_resnet18.py --config.model.name=resnet50 --config.model.kwargs.stem=imagenet
          "--config.data.shape=(224, 224, 3)" --config.data.num_classes=1000 --config.data.num_examples=512
          --config.data.num_eval_examples=256 --config.train.global_batch_size=256)
bench=(--devices 1 --steps 20 --repeats 3 --no-baseline)
steps=scripts/gpu_check_steps.py
decode_images=256
[[ $backend == gpu ]] || decode_images=48  # a short dry run

say "gpu_check $(date -u +%FT%TZ), JAX backend ${backend:-none}, budget ${budget}s"
step versions 45 cpu '^versions' python3 $steps versions "$work"
step xla_flags 60 cpu '^xla flags' python3 $steps xla_flags "$work"
step jdp_bf16 130 gpu '^\| 1 \||^precision|^MFU' \
  python3 -m jdp.bench "${resnet50[@]}" --config.precision=bf16 "${bench[@]}" --out "$work/bench-bf16"
step torch_resnet50 70 gpu '^torch' python3 $steps torch_resnet50 "$work"
step jdp_fp32 110 gpu '^\| 1 \||^precision|^MFU' \
  python3 -m jdp.bench "${resnet50[@]}" --config.precision=fp32 "${bench[@]}" --out "$work/bench-fp32"
step train 90 gpu '^done:' \
  python3 -m jdp.train "${resnet50[@]}" --config.precision=bf16 --config.train.steps=60 --config.train.log_every=20 \
  --config.train.eval_every=60 --config.checkpoint.every_steps=30 --config.parallel.check_replicas_every=30 \
  --workdir "$work/train"
[[ -f $work/train/metrics.jsonl && -f $work/bench-bf16/bench.json ]] &&
  step train_vs_bench 30 gpu '^jdp.train' python3 $steps train_vs_bench "$work"
step parity 60 gpu 'worst|tolerance' env JAX_DEFAULT_MATMUL_PRECISION=highest \
  python3 -m jdp.compare parity --config configs/mnist1d_mlp.py --workers 1 --steps 30 --device cuda \
  --workdir "$work/parity"
step decode 60 cpu '^\|' python3 benchmarks/bench_decode.py --threads 1,16 --images $decode_images --repeats 3 \
  --json "$work/decode.json"
step gpt 90 gpu '^gpt' python3 $steps gpt "$work"
budget=$((budget + 30)) step summary 30 cpu '^summary' python3 $steps summary "$work"
[[ -f $work/gpu_check.json ]] && cp "$work/gpu_check.json" "$out/"
say "done in $(($(date +%s) - start))s; log $log, figures $out/gpu_check.json"
rm -rf "$work"
