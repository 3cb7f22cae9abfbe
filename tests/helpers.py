"""Small configs and comparisons shared by the tests."""

from __future__ import annotations

import shlex
from pathlib import Path

import jax
import ml_collections
import numpy as np

from jdp import step as step_lib
from jdp.configs import base
from jdp.metrics import read_metrics

TINY_CIFAR = Path(__file__).parent / "fixtures" / "tfds"  # data_dir of the committed CIFAR-format fixture
TINY_TEXT = Path(__file__).parent / "fixtures" / "shakespeare_excerpt.txt"  # the start of the shakespeare text

# Tiny models that compile in seconds on a 2-core CPU; resnet is built by the ResNet-18 class.
MODELS = {
    "mlp": dict(model={"name": "mlp", "kwargs": {"hidden_sizes": (32, 32)}}, data={"name": "mnist1d"}),
    "cnn1d": dict(model={"name": "cnn1d"}, data={"name": "mnist1d"}),
    "resnet": dict(model={"name": "resnet18", "kwargs": {"stage_sizes": (1, 1, 1, 1), "width": 8}},
                   data={"name": "synthetic", "shape": (8, 8, 3), "num_classes": 10, "num_examples": 256,
                         "num_eval_examples": 40},
                   optim={"lr": 0.05}),  # stable at this lr, so float32 rounding is not amplified
    "gpt": dict(model={"name": "gpt", "kwargs": {"num_layers": 2, "num_heads": 2, "embed_dim": 16}},
                data={"name": f"text:{TINY_TEXT}", "block_size": 8}, task={"loss": "lm"}),
    "tiny_cifar": dict(model={"name": "cnn2d", "kwargs": {"channels": (8,), "dense_sizes": (16,)}},
                       data={"name": "tfds:tiny_cifar", "data_dir": str(TINY_CIFAR)}),  # augmented on the device
}


def small_config(name: str, *, backend: str = "shard_map", num_devices: int = 0, steps: int = 5,
                 init_from: str = "", precision: str = "fp32", **sections):
    """Plain SGD with an lr large enough that a wrong gradient scale changes the losses."""
    cfg = base.get_config()
    cfg.update(init_from=init_from, precision=precision)
    cfg.train.update(global_batch_size=32, steps=steps, log_every=1, eval_every=steps)
    cfg.optim.update(name="sgd", lr=0.2, schedule="constant")
    cfg.parallel.update(backend=backend, num_devices=num_devices)
    cfg.compile_cache_dir = ""
    for fields in (MODELS[name], sections):
        for section, values in fields.items():
            if values.get("name", cfg[section].get("name")) != cfg[section].get("name"):
                cfg[section].kwargs = ml_collections.ConfigDict()  # another model: none of the old one's settings
            cfg[section].update(values)
    return cfg


def overrides(sections: dict, prefix: str = "--config.") -> list[str]:
    """Nested config sections -> command-line overrides, e.g. {"model": {"kwargs": {"width": 8}}} ->
    ["--config.model.kwargs.width=8"]."""
    return [arg for key, value in sections.items()
            for arg in (overrides(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}={value}"])]


def logits_and_state(model, params, model_state, x, *, train: bool, groups: int = 1, rng_state=None):
    """A jdp model (`jdp.modeldef.ModelDef`, e.g. `build(cfg).model`) run on `x` as the step runs it:
    (logits, the model state after the forward). `rng_state`: that of a model with stochastic layers."""
    outputs, new_state, _ = step_lib.run_loss(model, lambda m, batch: {"logits": m(batch["x"])}, params,
                                              model_state, rng_state or NO_RNG, {"x": x}, train=train, groups=groups)
    return outputs["logits"], new_state


NO_RNG = {"keys": {}, "counts": {}}  # the RNG state of a model without stochastic layers


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over all leaves of two pytrees of the same structure."""
    return max((float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                           strict=True)), default=0.0)


def records(workdir, split: str) -> list[dict]:
    """The `split` lines of WORKDIR/metrics.jsonl, in order."""
    return [r for r in read_metrics(workdir) if r["split"] == split]


def train_losses(workdir) -> list[tuple[int, float]]:
    """(step, loss) of every train line, in order, so a duplicated step shows."""
    return [(r["step"], r["loss"]) for r in records(workdir, "train")]


README = Path(__file__).parent.parent / "README.md"
NOT_RUN = "<!-- not run by the tests: "  # the README's mark on a command block that needs a GPU or a cluster


def readme_command_blocks() -> list[tuple[str, list[str]]]:
    """Each ```bash block of the README: (its mark, or "" if the tests run it; its commands, `a && b` split)."""
    lines = README.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = lines.index("```", i + 1)
        mark = lines[i - 1] if i and lines[i - 1].startswith(NOT_RUN) else ""
        commands = [c.strip() for text in lines[i + 1:end] for c in text.split("#")[0].split("&&") if c.strip()]
        blocks.append((mark, commands))
    return blocks


def readme_command(prefix: str) -> list[str]:
    """The one command of the README's run blocks that is `prefix`, or else starts with it, as printed, split into
    arguments."""
    run = [c for mark, commands in readme_command_blocks() if not mark for c in commands]
    found = [c for c in run if c == prefix] or [c for c in run if c.startswith(prefix)]
    assert len(found) == 1, f"the README's run blocks hold {len(found)} commands starting with {prefix!r}: {found}"
    return shlex.split(found[0])
