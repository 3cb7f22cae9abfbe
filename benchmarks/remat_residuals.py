"""What JAX saves from the forward for the backward (`jax.ad_checkpoint.print_saved_residuals`), per remat
setting, for a GPT of a config's shapes: one sequence of the config's block, the loss summed, traced from shapes
(nothing runs). The unrolled model's figure is what remat saves before XLA's buffer assignment, which on XLA:CPU
need not lower the compiled temporaries of unrolled blocks (docs/benchmarks.md, "Making a model fit").

    python benchmarks/remat_residuals.py --config configs/gpt2_small.py [--scan_layers]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--scan_layers", action="store_true", help="the scanned model (default: unrolled)")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdp.cli import config as config_lib
    from jdp.layers import REMAT_POLICIES, saved_residual_bytes
    from jdp.models import build_model

    cfg = config_lib.load_config_file(args.config)
    block = cfg.data.block_size
    print(f"| remat | saved residuals MB ({'scanned' if args.scan_layers else 'unrolled'}, one sequence of {block}) "
          "| / none |\n|---|---:|---:|")
    none = None
    tokens = jnp.zeros((1, block + 1), jnp.int32)
    for remat in REMAT_POLICIES:
        kwargs = {**cfg.model.kwargs.to_dict(), "remat": remat, "scan_layers": args.scan_layers}
        model = nnx.eval_shape(lambda kwargs=kwargs: build_model("gpt", kwargs, (block,), cfg.data.num_classes,
                                                                 seed=0))
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

        def loss(params, graph=graph, rest=rest):
            logits = nnx.merge(graph, params, rest)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum()

        saved = saved_residual_bytes(loss, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
        none = none or saved
        print(f"| {remat} | {saved / 2**20:,.1f} | {saved / none:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
