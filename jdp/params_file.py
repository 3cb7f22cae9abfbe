"""The .npz parameter file of `python -m jdp.export` and `init_from`, keys `params/<module path>/<name>` and
`model_state/<module path>/<name>`. A scanned model's stacked layers (`<path>/layers/<name>`, `jdp.layers.Stack`)
and an unrolled model's (`<path>/<i>/<name>`) are one model's two layouts: a file of either loads into the other."""

from __future__ import annotations

import itertools
import re
import zipfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jdp import nested


def flatten(tree: Any, prefix: str) -> dict[str, np.ndarray]:
    return nested.flatten(jax.tree.map(np.asarray, tree), prefix + "/", "/")  # rebuilt by jax: in jax's leaf order


def load_into(path: str | Path, params: Any, model_state: Any) -> tuple[Any, Any]:
    """Values from an exported .npz in the structure of `params` and `model_state`; ValueError naming the first
    key missing or of another shape."""
    open(path, "rb").close()  # a missing file or a folder: its own OSError
    if not zipfile.is_zipfile(path):  # np.load would read a .npy's one array, or offer to unpickle anything else
        raise ValueError(f"{path} is not an .npz file (a zip of named arrays)")
    with np.load(path) as stored:
        values = dict(stored)

    def other_layout(key: str) -> np.ndarray | None:
        """The value of `key` from the file's layers in the other layout (stacked <-> unrolled), if there."""
        if stacked := re.match(r"^(.*)/layers/(\D[^/]*(?:/.*)?)$", key):
            layers = list(itertools.takewhile(lambda x: x is not None, (
                values.get(f"{stacked[1]}/{i}/{stacked[2]}") for i in range(len(values)))))
            return np.stack(layers) if layers else None
        if unrolled := re.match(r"^(.*)/(\d+)/(.*)$", key):
            whole = values.get(f"{unrolled[1]}/layers/{unrolled[3]}")
            return whole[int(unrolled[2])] if whole is not None and int(unrolled[2]) < len(whole) else None
        return None

    def fill(tree: Any, prefix: str) -> Any:
        filled = []
        for key, leaf in flatten(tree, prefix).items():
            if key not in values and (converted := other_layout(key)) is not None:
                values[key] = converted
            if key not in values:
                raise ValueError(f"{path} has no {key}; was it exported from a run of the same model?")
            if values[key].shape != leaf.shape:
                raise ValueError(f"{path}: {key} has shape {values[key].shape}, the model expects {leaf.shape}")
            filled.append(values[key].astype(leaf.dtype))
        return jax.tree.unflatten(jax.tree.structure(tree), filled)

    return fill(params, "params"), fill(model_state, "model_state")
