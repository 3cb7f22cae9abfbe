"""Weights both ways between jdp's flat `jdp.export` names (`params/layers/0/kernel`) and a
`jdp.compare.torch_models` twin's state_dict: each conversion a transpose or a permutation (`_WEIGHTS`), both round
trips exact; torch's `num_batches_tracked` stays the twin's own."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from jdp.compare.torch_models import BatchNorm

Flat = dict[str, np.ndarray]


# Module type -> (conversion, jdp's name of its weight); a bias, where the module has one, is `bias` on both sides.
_WEIGHTS = {nn.Linear: ("linear", "kernel"), nn.Conv1d: ("conv", "kernel"), nn.Conv2d: ("conv", "kernel"),
            nn.Embedding: ("copy", "embedding"), nn.LayerNorm: ("copy", "scale"), BatchNorm: ("copy", "scale")}


def _entries(model: nn.Module) -> Iterator[tuple[str, str, str, Any]]:
    """(jdp key, torch key, kind, flatten_from) for every weight of `model`."""
    for name, module in model.named_modules():
        if (found := next((v for t, v in _WEIGHTS.items() if isinstance(module, t)), None)) is None:  # subclasses
            continue
        path, (kind, weight) = name.replace(".", "/"), found
        yield f"params/{path}/{weight}", f"{name}.weight", kind, getattr(module, "jdp_flatten_from", None)
        if getattr(module, "bias", None) is not None:
            yield f"params/{path}/bias", f"{name}.bias", "copy", None
        if isinstance(module, BatchNorm):
            yield from ((f"model_state/{path}/{s}", f"{name}.running_{s}", "copy", None) for s in ("mean", "var"))


def _convert(kind: str, value: np.ndarray, flatten_from, to_torch: bool) -> np.ndarray:
    """One weight from jdp's layout to torch's (`to_torch`) or back."""
    if kind == "conv":  # (*spatial, I, O) <-> (O, I, *spatial)
        nd = value.ndim - 2
        return np.transpose(value, (nd + 1, nd, *range(nd)) if to_torch else (*range(2, 2 + nd), 1, 0))
    if kind == "linear" and flatten_from:  # perm[j]: the jdp (channels-last) row of torch's flattened feature j
        c, *spatial = flatten_from
        perm = np.moveaxis(np.arange(int(np.prod(flatten_from))).reshape(*spatial, c), -1, 0).reshape(-1)
        return value[perm].T if to_torch else value.T[np.argsort(perm)]
    return value.T if kind == "linear" else value


def unstacked(flat: Flat) -> Flat:
    """Export-named arrays with a scanned model's stacked layers (`<path>/layers/<name>`, not followed by a layer
    index as an `nnx.List`'s are) split into the unrolled model's names, one per layer (`<path>/<i>/<name>`)."""
    out = {}
    for key, value in flat.items():
        if stacked := re.match(r"^(.*)/layers/(\D[^/]*(?:/.*)?)$", key):
            out |= {f"{stacked[1]}/{i}/{stacked[2]}": layer for i, layer in enumerate(np.asarray(value))}
        else:
            out[key] = value
    return out


def flat_to_torch(flat: Flat, model: nn.Module) -> dict[str, torch.Tensor]:
    """Export-named arrays (stacked too) -> `model`'s state_dict; ValueError naming a missing key."""
    flat = unstacked(flat)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for jdp_key, torch_key, kind, flatten_from in _entries(model):
        if jdp_key not in flat:
            raise ValueError(f"no {jdp_key} for the twin's {torch_key}; is it the same model and config?")
        value = np.ascontiguousarray(_convert(kind, np.asarray(flat[jdp_key]), flatten_from, True))
        state[torch_key] = torch.tensor(value, dtype=state[torch_key].dtype)
    return state


def torch_to_flat(state_dict: dict[str, torch.Tensor], model: nn.Module) -> Flat:
    """A twin's state_dict -> arrays with jdp.export key names (what `--config.init_from` reads)."""
    return {jdp_key: np.ascontiguousarray(_convert(kind, state_dict[key].detach().cpu().numpy(), flatten_from, False))
            for jdp_key, key, kind, flatten_from in _entries(model)}

