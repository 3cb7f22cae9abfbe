#!/usr/bin/env bash
# The GPT on one GPU: jdp bf16 tokens/s against its PyTorch twin compiled with torch.compile under bf16 autocast,
# as nanoGPT runs it (the gpt step of scripts/gpu_check.sh, with the versions; same $OUT and log files).
exec env GPU_CHECK_ONLY="versions gpt summary" "$(dirname "$0")/gpu_check.sh" "$@"
