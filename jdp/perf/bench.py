"""`python -m jdp.bench --config configs/X.py [--devices 1,2,4,8]`: where a data-parallel step's time goes
(docs/performance.md, "Making it fast"; the columns: docs/benchmarks.md).

Each variant (device count, with or without its collective) is compiled once and timed `--repeats` times,
interleaved; medians at the config's global batch. The all-reduce's cost is the step less the same step compiled
without its collective; MFU is over `PEAK_TFLOPS` or `--peak_tflops`. Writes bench.json, bench.md.
`--predict`: step time and scaling on devices not at hand (`--predict --help`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

import jax

from jdp import precision
from jdp.cli import config as config_lib
from jdp.cli.train import enable_compilation_cache
from jdp.errors import UsageError, warn
from jdp.layers import REMAT_POLICIES
from jdp.memory import mb
from jdp.mesh import simulate_cpu_devices
from jdp.models import settings
from jdp.models.gpt import flops_per_token, non_embedding_params
from jdp.perf import fits, predict
from jdp.perf.measure import SHARDINGS, Variant, compiled_memory

COMM_DOMINATES = 0.5  # warn when the collective takes more than this share of the step


# Dense peak TFLOP/s per GPU, by device kind (matched by substring, first match wins): bf16/fp16, and TF32, which
# XLA uses for float32 matmuls on these GPUs. NVIDIA's datasheets (nvidia.com/en-us/data-center/h100, /h200, A100)
# list H100/H200 "with sparsity": dense is half. Sustained matmul rates are lower (~790 bf16 measured on an H200).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp32": 378.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "fp32": 417.5},
    "H100": {"bf16": 989.5, "fp16": 989.5, "fp32": 494.5},
    "H200": {"bf16": 989.5, "fp16": 989.5, "fp32": 494.5},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
}


def peak_tflops_for(device_kind: str, precision: str) -> float:
    """The known dense peak of `device_kind` at `precision` (0.0 when not in PEAK_TFLOPS)."""
    return next((peaks[precision] for kind, peaks in PEAK_TFLOPS.items() if kind.lower() in device_kind.lower()),
                0.0)


def _token_figures(cfg, tokens: int, params, result: dict) -> dict:
    """A language model's tokens/sec, and the GPT's model FLOPs per token (6N + 12 x L x T x D)."""
    if not tokens:
        return {}
    out = {"tokens_per_example": tokens, "tokens_per_sec": result["examples_per_sec"] * tokens}
    if cfg.model.name == "gpt":
        s = settings("gpt", cfg.model.kwargs.to_dict())
        out["model_params_n"] = non_embedding_params(params)
        out["model_flops_per_token"] = flops_per_token(params, s["num_layers"], tokens, s["embed_dim"])
    if "flops" in result:  # XLA's count for one device's step, per token of that device's rows
        out["xla_flops_per_token"] = result["flops"] * result["devices"] / (cfg.train.global_batch_size * tokens)
    return out


def run_bench(cfg, devices: list[int], steps: int, repeats: int, peak_tflops: float = 0.0,
              baseline: bool = True) -> list[dict]:
    """Every variant compiled once, then timed `repeats` times, interleaved so that drift on a shared machine
    hits every variant alike. `peak_tflops` 0 = the known peak of the device at the config's precision."""
    explicit = cfg.parallel.backend in ("shard_map", "pmap")  # jit has no collective of jdp's to remove
    variants = {}
    if baseline:  # a plain single-device jit step: what data parallelism must not fall far behind
        jit_cfg = config_lib.with_default_sync(cfg)  # the run's strategy may need a per-device step
        jit_cfg.parallel.backend, jit_cfg.train.log_noise_scale = "jit", False
        variants["jit"] = Variant(jit_cfg, 1)
    # Without its collective, a step on one device is the same program: nothing to measure.
    variants |= {(n, c): Variant(cfg, n, c)
                 for n in devices for c in ((True, False) if explicit and n > 1 else (True,))}
    times = collections.defaultdict(list)
    for _ in range(repeats):
        for key, variant in variants.items():
            times[key].append(variant.time(steps))
    median = {key: statistics.median(t) for key, t in times.items()}
    kind = jax.devices()[0].device_kind
    peak = peak_tflops or peak_tflops_for(kind, cfg.precision)
    rows = []
    for n in devices:
        with_c = variants[(n, True)]
        row = {**with_c.row(median[(n, True)]), **with_c.stats()}
        row |= _token_figures(cfg, with_c.tokens_per_example, with_c.abstract_params, row)
        without = median.get((n, False))
        row["allreduce_s"] = (0.0 if n == 1 else None) if without is None else max(row["step_s"] - without, 0.0)
        row["compute_s"] = row["step_s"] if without is None else without
        row.update(precision=cfg.precision, device_kind=kind)
        rows.append(row)
    base = next((r for r in rows if r["devices"] == 1), None)
    for r in rows:
        r["efficiency"] = r["examples_per_sec"] / (r["devices"] * base["examples_per_sec"]) if base else None
        r["vs_single_device_jit"] = (r["examples_per_sec"] * median["jit"] / variants["jit"].batch_size
                                     if baseline else None)
        # MFU: the GPT's model FLOPs, else XLA's FLOP count of one device's step (the only figure for other models).
        if not peak:
            continue
        r["peak_tflops"] = peak
        if r.get("flops"):
            r["mfu_xla"] = r["flops"] / r["step_s"] / (peak * 1e12)
        if r.get("model_flops_per_token"):
            r["mfu"] = r["model_flops_per_token"] * r["tokens_per_sec"] / r["devices"] / (peak * 1e12)
        elif "mfu_xla" in r:
            r["mfu"] = r["mfu_xla"]
    return rows


def to_markdown(cfg, rows: list[dict]) -> str:
    def two_places(x, scale: float = 1.0) -> str:  # None: not measured
        return "n/a" if x is None else f"{x * scale:.2f}"

    lines = [f"config: model {cfg.model.name}, data {cfg.data.name}, global batch {cfg.train.global_batch_size}, "
             f"backend {cfg.parallel.backend}, {jax.devices()[0].platform} ({jax.devices()[0].device_kind})", "",
             "| devices | examples/s | vs 1-device jit | step ms | compute ms | all-reduce ms | input ms/batch "
             "| first step s | efficiency | params MB/dev | grads MB/dev | opt state MB/dev | XLA temp MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["devices"], f"{r['examples_per_sec']:,.0f}", two_places(r["vs_single_device_jit"]),
                 *(two_places(r[k], 1e3) for k in ("step_s", "compute_s", "allreduce_s", "input_s")),
                 f"{r['first_step_s']:.2f}", two_places(r["efficiency"]),
                 *(two_places(r.get(k, 0), 2**-20) for k in ("params_bytes", "grads_bytes", "opt_state_bytes",
                                                            "temp_bytes"))]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if matmuls := rows[0].get("matmul_dtypes"):
        lines += ["", f"precision {cfg.precision}: the compiled train step has "
                  f"{precision.summary(collections.Counter(matmuls))} (as jdp lowers it, before XLA's passes)"]
    if any("tokens_per_sec" in r for r in rows):
        lines += ["", "tokens/s: " + ", ".join(f"{r['devices']} devices {r['tokens_per_sec']:,.0f}" for r in rows)]
    if gpt := next((r for r in rows if "model_flops_per_token" in r), None):
        xla = gpt.get("xla_flops_per_token")
        counted = f"; XLA's cost analysis counts {xla:,.0f}" if xla else ""
        lines += ["", f"FLOPs per token (6N + 12 x layers x block x width, N = {int(gpt['model_params_n']):,}): "
                      f"{int(gpt['model_flops_per_token']):,}{counted}"]
    if any("mfu" in r for r in rows):
        how = "model FLOPs per token x tokens/s per device" if gpt else "XLA FLOPs per device step / step time"
        parts = [f"{r['devices']} devices {r['mfu']:.1%}" + (f" (from XLA's count: {r['mfu_xla']:.1%})"
                                                             if gpt and "mfu_xla" in r else "")
                 for r in rows if "mfu" in r]
        lines += ["", f"MFU ({how}, over the peak {rows[0]['peak_tflops']:g} TFLOP/s at {cfg.precision}): "
                  + ", ".join(parts)]
    return "\n".join(lines) + "\n"


def memory_markdown(cfg, rows: list[dict]) -> str:
    """The `--compile_only` table: per-device memory of each sharding of the state, side by side."""
    platform = jax.devices()[0].platform
    compiler = f"XLA:{platform.upper()}'s" if platform == "cpu" else "XLA's"
    scanned = " scanned" if settings(cfg.model.name, cfg.model.kwargs.to_dict()).get("scan_layers") else ""
    lines = [f"config: model {cfg.model.name}{scanned}, global batch {cfg.train.global_batch_size}, backend "
             f"{cfg.parallel.backend}, precision {cfg.precision}, {platform} ({jax.devices()[0].device_kind}); "
             f"{rows[0]['params_n']:,} parameters; compiled from shapes, not run", "",
             "| devices | state | remat | params MB/dev | grads MB/dev | opt state MB/dev | "
             f"params + opt state MB/dev | / plain | arguments MB/dev | temp MB/dev ({compiler} compiler) | "
             "arguments + temp MB/dev | peak MB/dev | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {r["devices"]: r["params_bytes"] + r["opt_state_bytes"] for r in rows if r["sharding"] == "plain"}
    for r in rows:
        persistent = r["params_bytes"] + r["opt_state_bytes"]
        arguments, temp = r.get("argument_bytes", 0), r.get("temp_bytes", 0)
        lines.append(f"| {r['devices']} | {r['sharding']} | {r['remat']} | {mb(r['params_bytes'])} | "
                     f"{mb(r['grads_bytes'])} | {mb(r['opt_state_bytes'])} | {mb(persistent)} | "
                     f"{persistent / plain[r['devices']]:.3f} | {mb(arguments)} | {mb(temp)} | "
                     f"{mb(arguments + temp)} | {mb(r.get('peak_bytes', 0))} | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


def _results_folder(out: Path) -> Path:
    """--out, made before anything is measured, so that a bad one does not cost the run's figures."""
    if out.exists() and not out.is_dir():
        raise config_lib.ConfigError(f"--out {out} is a file; pass a folder for the results")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise config_lib.ConfigError(f"--out {out} cannot be made ({e.strerror}); pass another folder") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise config_lib.ConfigError(f"--out {out} is read-only to this user; pass another folder")
    return out


def _write(out: Path, name: str, data, table: str, *warnings: str) -> int:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=list))
    (out / f"{name}.md").write_text(table)
    print(table, flush=True)
    for line in warnings:
        warn(line)
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.md'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--predict" in argv:  # scaling predicted before hardware: jdp/perf/predict.py
        return predict.main([a for a in argv if a != "--predict"])
    parser = config_lib.ArgumentParser(prog="python -m jdp.bench", description=__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=config_lib.DEFAULT_CONFIG)
    parser.add_argument("--devices", type=config_lib.counts, default="1,2",
                        help="comma-separated device counts (default 1,2)")
    parser.add_argument("--steps", type=config_lib.positive(int), default=30, help="timed steps per measurement")
    parser.add_argument("--repeats", type=config_lib.positive(int), default=3)
    parser.add_argument("--out", type=Path, help="output directory (default runs/bench-CONFIG_NAME)")
    parser.add_argument("--peak_tflops", type=config_lib.positive(float, zero=True), default=0.0,
                        help="the device's peak TFLOP/s at the config's precision, for MFU (default: from "
                             "PEAK_TFLOPS for known GPUs, bf16 or TF32 peak as the precision runs)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a plain single-device jit step (one more compilation)")
    parser.add_argument("--compile_only", action="store_true",
                        help="run nothing: per-device memory of the state replicated, ZeRO-1 and ZeRO-3, side by "
                             "side, from the compiled steps (for models too big to run here), per remat setting")
    parser.add_argument("--remat", default="",
                        help="--compile_only: comma-separated remat settings to compile (default: all of none, "
                             "dots, full for a model that takes remat)")
    parser.add_argument("--fits", action="store_true",
                        help="run nothing: which GPT shapes fit in --memory_gb a device on --devices, under plain, "
                             "ZeRO-1, ZeRO-3 and ZeRO-3 + scan + remat (compiled from shapes)")
    parser.add_argument("--memory_gb", type=config_lib.positive(float), default=16.0,
                        help="--fits: GB (2**30 bytes) a device")
    parser.add_argument("--timeout_s", type=config_lib.positive(float), default=600.0,
                        help="--fits: the cap of each compile")
    try:
        args, rest = parser.parse_known_args(argv)
        if args.fits:
            if len(args.devices) != 1:
                raise config_lib.ConfigError(f"--fits takes one device count (--devices 8), not "
                                             f"{','.join(map(str, args.devices))}")
            out = _results_folder(args.out or Path("runs") / "bench-fits")
            rows, table = fits.run_fits(args.memory_gb, args.devices[0], args.timeout_s)
            return _write(out, "fits", rows, table)
        cfg = config_lib.load_config_file(args.config)
        cfg = config_lib.apply_overrides(cfg, config_lib.parse_overrides(rest))
        out = _results_folder(args.out or Path("runs") / f"bench-{args.config.stem}")
        with contextlib.suppress(RuntimeError):  # called from Python after JAX started: the devices are fixed
            simulate_cpu_devices(cfg.parallel.cpu_devices or max(args.devices))  # a CPU-only machine's
        enable_compilation_cache(cfg.compile_cache_dir)
        if args.compile_only:  # by default every remat setting of a model that takes one (the GPT, the ResNet)
            if cfg.parallel.backend == "pmap":
                raise config_lib.ConfigError("--compile_only compiles the shard_map or jit step; use "
                                             "--config.parallel.backend=shard_map")
            remats = REMAT_POLICIES if "remat" in settings(cfg.model.name, cfg.model.kwargs.to_dict()) else ("",)
            rows = [{**compiled_memory(cfg, n, sharding, remat), "remat": remat or "-"}
                    for n in args.devices for sharding in SHARDINGS
                    for remat in (args.remat.split(",") if args.remat else remats)
                    if not (sharding == "zero1" and cfg.parallel.backend == "jit")]  # ZeRO-1 is shard_map's
        else:
            rows = run_bench(cfg, args.devices, args.steps, args.repeats, args.peak_tflops, args.baseline)
    except UsageError as e:  # a bad argument, a config the step refuses, more devices than there are
        print(f"jdp.bench: {e}", file=sys.stderr)
        return 2
    table = memory_markdown(cfg, rows) if args.compile_only else to_markdown(cfg, rows)
    warnings = [f"on {r['devices']} devices the gradient all-reduce takes "
                f"{r['allreduce_s'] / r['step_s']:.0%} of the step: communication dominates compute, so data "
                "parallelism will not pay at this model and batch size (try a larger batch or fewer devices)"
                for r in rows if r.get("allreduce_s") and r["allreduce_s"] > COMM_DOMINATES * r["step_s"]]
    return _write(out, "bench", {"config": cfg.to_dict(), "rows": rows}, table, *warnings)
