"""`python -m jdp.bench --predict`: a config's step time and scaling efficiency on 1, 8, 64 and 512 devices,
predicted before the hardware exists (docs/benchmarks.md, "Scaling prediction before hardware"). `--validate`: the
same model, nothing fitted, against published scaling results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flax import nnx

from jdp.cli import build as build_lib
from jdp.cli import config as config_lib
from jdp.models import count_params
from jdp.perf import measure, scaling, validation


def to_markdown(rows: list[dict], grad_bytes: float, topo_names: str) -> str:
    lines = [f"gradient {grad_bytes / 1e6:,.2f} MB per all-reduce; {topo_names}", "",
             "| devices | nodes | batch/device | compute ms | all-reduce ms | step ms (no overlap) | efficiency | "
             f"step ms (overlap {scaling.BACKWARD_SHARE:.2f}) | efficiency | all-reduce > compute below batch/device "
             "| all-reduce > compute above gradient MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        small = " (under 1 example: not runnable)" if r["per_device_batch"] < 1 else ""
        one = r["devices"] == 1  # no all-reduce: no threshold
        lines.append(f"| {r['devices']} | {r['nodes']} | {r['per_device_batch']:g}{small} | {r['compute_s'] * 1e3:.3f} "
                     f"| {r['allreduce_s'] * 1e3:.3f} | {r['step_s'] * 1e3:.3f} | {r['efficiency']:.1%} "
                     f"| {r['step_s_overlap'] * 1e3:.3f} | {r['efficiency_overlap']:.1%} "
                     f"| {'—' if one else format(r['threshold_batch'], ',.1f')} "
                     f"| {'—' if one else format(r['threshold_bytes'] / 1e6, ',.2f')} |")
    return "\n".join(lines) + "\n"


def gradient_bytes(cfg, input_shape: tuple[int, ...] | None = None, num_classes: int = 0) -> tuple[int, int]:
    """(parameters, bytes one gradient all-reduce sends) of the config's model, built abstractly through jdp's
    own task building; without `input_shape` and `num_classes` they come from the config's data."""
    if input_shape is None or not num_classes:
        try:
            make_model = build_lib.build_task(cfg).make_model
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"{e} (or predict without the data: pass --step_ms, --input_shape and "
                                         "--num_classes)") from None
    else:
        build_lib.check_names(cfg)
        make_model = build_lib.model_maker(cfg, input_shape, num_classes)
    params = count_params(nnx.state(build_lib.abstract_model(make_model), nnx.Param))
    return params, params * scaling.ALLREDUCE_BYTES[config_lib.sync_strategy(config_lib.fit_values(cfg))[0].dtype_name]


def main(argv: list[str]) -> int:
    p = config_lib.ArgumentParser(prog="python -m jdp.bench --predict", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=config_lib.DEFAULT_CONFIG)
    p.add_argument("--step_ms", type=config_lib.positive(float, zero=True), default=0.0,
                   help="one device's step time at the config's global batch (default: measured here by jdp.bench)")
    p.add_argument("--devices", type=config_lib.counts, default=",".join(map(str, scaling.DEFAULT_DEVICES)))
    p.add_argument("--per_node", type=config_lib.positive(int), default=8, help="devices per node (default 8)")
    p.add_argument("--intra", default="nvlink-a100", choices=sorted(scaling.INTRA_LINKS), help="link within a node")
    p.add_argument("--inter", default="net-100g", choices=sorted(scaling.INTER_LINKS), help="link between nodes")
    p.add_argument("--scaling", default="strong", choices=("strong", "weak"),
                   help="strong: the config's global batch split over the devices (jdp's contract); weak: each "
                        "device keeps the config's global batch (the global batch grows N-fold)")
    p.add_argument("--input_shape", type=config_lib.counts, help="one example's shape, e.g. 224,224,3: with "
                   "--num_classes, the model is built without reading the config's data")
    p.add_argument("--num_classes", type=int, default=0)
    p.add_argument("--steps", type=config_lib.positive(int), default=20,
                   help="timed steps per measurement (without --step_ms)")
    p.add_argument("--repeats", type=config_lib.positive(int), default=3)
    p.add_argument("--validate", action="store_true",
                   help="predict published scaling results instead (no config) and print the error")
    try:
        args, rest = p.parse_known_args(argv)
        if args.validate:
            print(validation.to_markdown(validation.validate()))
            return 0
        cfg = config_lib.load_config_file(args.config)
        cfg = config_lib.apply_overrides(cfg, config_lib.parse_overrides(rest))
        topo = scaling.Topology(args.per_node, scaling.INTRA_LINKS[args.intra], scaling.INTER_LINKS[args.inter])
        for n in args.devices:
            scaling.hierarchical_allreduce_s(0.0, n, topo)  # device counts that do not fill nodes, refused up front
        params, nbytes = gradient_bytes(cfg, args.input_shape, args.num_classes)
        one_step = (args.step_ms / 1e3 if args.step_ms  # else jdp.bench's one-device step, timed here
                    else measure.one_device_step_s(cfg, args.steps, args.repeats))
    except (config_lib.ConfigError, ValueError) as e:
        print(f"jdp.bench --predict: {e}", file=sys.stderr)
        return 2
    batch = cfg.train.global_batch_size
    rows = scaling.predict(nbytes, one_step, batch, args.devices, topo, args.scaling)
    measured = "given" if args.step_ms else "measured here by jdp.bench"
    strategy = config_lib.sync_strategy(config_lib.fit_values(cfg))[0]
    print(f"{args.config.name}: {cfg.model.name}, {params:,} parameters, all-reduce in {strategy.dtype_name}; "
          f"one device's step {one_step * 1e3:.3f} ms at batch {batch} ({measured}); {args.scaling} scaling")
    print(f"links: {args.intra}: {topo.intra.about}; {args.inter}: {topo.inter.about}")
    print(to_markdown(rows, nbytes, f"{args.per_node} devices per node, {args.intra} within, {args.inter} between"))
    return 0
