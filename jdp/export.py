"""`python -m jdp.export --workdir W --out params.npz`: a run's parameters and BatchNorm statistics
in a framework-neutral .npz, and the loader behind `--config.init_from=params.npz`.

Key names: `params/<module path>/<name>` and `model_state/<module path>/<name>`, path parts joined
by "/", e.g. `params/layers/0/kernel` (Dense kernels are (in, out); conv kernels are HWIO or WIO),
`model_state/bn/mean`. A `step` entry records the training step the file was taken at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

SECTIONS = ("params", "model_state")


def flatten(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    return {prefix + "/" + "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def load_into(path: str | Path, params: Any, model_state: Any) -> tuple[Any, Any]:
    """Values from an exported .npz in the structure of `params` and `model_state`; every key must be
    present with the same shape. Raises ValueError naming the first key that does not fit."""
    with np.load(path) as stored:
        values = dict(stored)

    def fill(tree: Any, prefix: str) -> Any:
        keys = list(flatten(tree, prefix))
        leaves = jax.tree.leaves(tree)
        filled = []
        for key, leaf in zip(keys, leaves, strict=True):
            if key not in values:
                raise ValueError(f"{path} has no {key}; was it exported from a run of the same model?")
            if values[key].shape != leaf.shape:
                raise ValueError(f"{path}: {key} has shape {values[key].shape}, the model expects {leaf.shape}")
            filled.append(values[key].astype(leaf.dtype))
        return jax.tree.unflatten(jax.tree.structure(tree), filled)

    return fill(params, "params"), fill(model_state, "model_state")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    from jdp import config as config_lib
    from jdp.checkpoint import CheckpointError
    from jdp.resume import restore_for_inference

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
