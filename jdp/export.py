"""`python -m jdp.export --workdir W --out params.npz`: a run's parameters and BatchNorm statistics
in a framework-neutral .npz (`jdp.params_file`), which `--config.init_from=params.npz` starts a run from.

Key names: `params/<module path>/<name>` and `model_state/<module path>/<name>`, path parts joined
by "/", e.g. `params/layers/0/kernel` (Dense kernels are (in, out); conv kernels are HWIO or WIO),
`model_state/bn/mean`. A `step` entry records the training step the file was taken at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from jdp import config as config_lib
from jdp.checkpoint import CheckpointError
from jdp.params_file import flatten
from jdp.resume import restore_for_inference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    try:
        step, built, state = restore_for_inference(args.workdir)
    except (config_lib.ConfigError, CheckpointError) as e:
        print(f"jdp.export: {e}", file=sys.stderr)
        return 2
    built.source.close()
    host = built.parallel.to_host(state)  # RNG streams are left out: they are not weights
    arrays = {**flatten(host.params, "params"), **flatten(host.model_state, "model_state"), "step": np.int64(step)}
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}: {len(arrays) - 1} arrays from step {step} of {args.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
