"""`python -m jdp.bench --config configs/X.py [--devices 1,2,4,8]`: where a data-parallel step's time goes.

For each device count (interleaved, repeated; medians reported) it measures, at the config's global batch:
- steady-state examples/sec of the compiled step on batches already on the devices, and the time to the
  first step (compile);
- input: the host pipeline's time per global batch (reading + assembling the global array);
- all-reduce: the same step compiled without its collective (`StepOptions.all_reduce=False`) is timed
  too, and the difference is the collective's cost ("with/without" method);
- the ratio to a plain single-device jit step on the same global batch, measured in the same run;
- per-device memory of parameters, gradients and optimizer state (bytes of each array's shard on
  device 0), and XLA's `memory_analysis()` of the compiled step; with `--peak_tflops`, MFU from
  XLA's `cost_analysis()` FLOP count;
and the scaling efficiency throughput_N / (N x throughput_1). Writes bench.json and bench.md.

For a language model it adds tokens/sec; for the GPT the model FLOPs per token, 6N + 12 x layers x block x
width (N: parameters without the position embedding, the tied embedding once; the attention term as in the
PaLM paper's appendix), with MFU from it, and beside it what XLA's cost analysis counts per token.
`--predict` predicts step time and scaling on devices this machine does not have (jdp/predict.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

from jdp import config as config_lib
from jdp.mesh import simulate_cpu_devices

COMM_DOMINATES = 0.5  # warn when the collective takes more than this share of the step


def _bytes_on_first_device(tree) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))


def _time_steps(parallel, state, batches, steps: int) -> tuple[float, float, object]:
    """(seconds to the end of the first step, median seconds per step after it, final state)."""
    t0 = time.perf_counter()
    state, metrics = parallel.train_step(state, batches[0])
    parallel.fetch(metrics)
    first = time.perf_counter() - t0
    times = []
    pending = None
    t_last = time.perf_counter()
    for i in range(steps):
        state, metrics = parallel.train_step(state, batches[(i + 1) % len(batches)])
        if pending is not None:  # the trainer's own pattern: fetch one step late
            parallel.fetch(pending)
            now = time.perf_counter()
            times.append(now - t_last)
            t_last = now
        pending = metrics
    parallel.fetch(pending)
    return first, statistics.median(times), state


def measure(cfg, num_devices: int, steps: int, collective: bool = True, stats: bool = True) -> dict:
    """One measurement of the config's step on `num_devices` devices; `stats` adds XLA's memory and FLOP
    accounting (one more compilation)."""
    from jdp.task import build

    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.num_devices = num_devices
    b = build(cfg, all_reduce=collective)
    parallel, source = b.parallel, b.source
    t0 = time.perf_counter()
    rows = [source.train_batch(i) for i in range(4)]
    batches = [parallel.shard_batch(r) for r in rows]
    jax.block_until_ready(batches)
    input_s = (time.perf_counter() - t0) / len(rows)
    source.close()
    state = parallel.to_devices(b.init_state())
    memory = {"params_bytes": _bytes_on_first_device(state.params),
              "grads_bytes": _bytes_on_first_device(state.params),  # one gradient per parameter, same dtype
              "opt_state_bytes": _bytes_on_first_device(state.opt_state)}
    first, step_s, state = _time_steps(parallel, state, batches, steps)
    compiled = parallel.compiled_stats(state, batches[0]) if stats else {}
    result = {"devices": num_devices, "first_step_s": first, "step_s": step_s, "input_s": input_s,
              "examples_per_sec": cfg.train.global_batch_size / step_s, **memory, **compiled}
    return result | _token_figures(cfg, source, b.abstract_state.params, result)


def _token_figures(cfg, source, params, result: dict) -> dict:
    """A language model's tokens/sec, and the GPT's model FLOPs per token (6N + 12 x L x T x D)."""
    tokens = getattr(source, "tokens_per_example", 0)
    if not tokens:
        return {}
    out = {"tokens_per_example": tokens, "tokens_per_sec": result["examples_per_sec"] * tokens}
    if cfg.model.name == "gpt":
        from jdp.models import settings
        from jdp.models.gpt import flops_per_token, non_embedding_params

        s = settings("gpt", cfg.model.kwargs.to_dict())
        out["model_params_n"] = non_embedding_params(params)
        out["model_flops_per_token"] = flops_per_token(params, s["num_layers"], tokens, s["embed_dim"])
    if "flops" in result:  # XLA's count for one device's step, per token of that device's rows
        out["xla_flops_per_token"] = result["flops"] * result["devices"] / (cfg.train.global_batch_size * tokens)
    return out


def run_bench(cfg, devices: list[int], steps: int, repeats: int, peak_tflops: float = 0.0) -> list[dict]:
    explicit = cfg.parallel.backend in ("shard_map", "pmap")  # jit has no collective of jdp's to remove
    runs = {(n, c): [] for n in devices for c in ((True, False) if explicit else (True,))}
    baseline_cfg = cfg.copy_and_resolve_references()
    baseline_cfg.parallel.backend = "jit"
    baseline = []  # a plain single-device jit step: what data parallelism must not fall far behind
    for repeat in range(repeats):  # interleaved, so drift on a shared machine hits every variant alike
        baseline.append(measure(baseline_cfg, 1, steps, stats=False)["examples_per_sec"])
        for n, collective in runs:  # XLA's accounting is the same every time: taken once
            runs[(n, collective)].append(measure(cfg, n, steps, collective, stats=repeat == 0 and collective))
    rows = []
    for n in devices:
        with_c = runs[(n, True)]
        timed = with_c[-1].keys()  # in every run; XLA's accounting only in the first
        row = {**with_c[0], **{k: statistics.median(r[k] for r in with_c) for k in timed}}
        row["devices"] = n
        if explicit and n > 1:
            without = statistics.median(r["step_s"] for r in runs[(n, False)])
            row["allreduce_s"] = max(row["step_s"] - without, 0.0)
            row["compute_s"] = without
        else:
            row["allreduce_s"], row["compute_s"] = (0.0 if n == 1 else None), row["step_s"]
        rows.append(row)
    base = next((r for r in rows if r["devices"] == 1), None)
    single_jit = statistics.median(baseline)
    for r in rows:
        r["efficiency"] = r["examples_per_sec"] / (r["devices"] * base["examples_per_sec"]) if base else None
        r["vs_single_device_jit"] = r["examples_per_sec"] / single_jit
        # Model FLOPs utilisation against the peak: the GPT's model FLOPs per token x tokens/sec per device;
        # XLA's FLOP count of one device's step over its time (the only figure for other models).
        if peak_tflops and r.get("flops"):
            r["mfu_xla"] = r["flops"] / r["step_s"] / (peak_tflops * 1e12)
        if peak_tflops and r.get("model_flops_per_token"):
            r["mfu"] = r["model_flops_per_token"] * r["tokens_per_sec"] / r["devices"] / (peak_tflops * 1e12)
        elif "mfu_xla" in r:
            r["mfu"] = r["mfu_xla"]
    return rows


def to_markdown(cfg, rows: list[dict]) -> str:
    def ms(x):
        return "n/a" if x is None else f"{x * 1e3:.2f}"

    lines = [f"config: model {cfg.model.name}, data {cfg.data.name}, global batch {cfg.train.global_batch_size}, "
             f"backend {cfg.parallel.backend}, {jax.devices()[0].platform} ({jax.devices()[0].device_kind})", "",
             "| devices | examples/s | vs 1-device jit | step ms | compute ms | all-reduce ms | input ms/batch "
             "| first step s | efficiency | params MB/dev | grads MB/dev | opt state MB/dev | XLA temp MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = "n/a" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(
            f"| {r['devices']} | {r['examples_per_sec']:,.0f} | {r['vs_single_device_jit']:.2f} | {ms(r['step_s'])} | "
            f"{ms(r['compute_s'])} | "
            f"{ms(r['allreduce_s'])} | {ms(r['input_s'])} | {r['first_step_s']:.2f} | {eff} | "
            f"{r['params_bytes'] / 2**20:.2f} | {r['grads_bytes'] / 2**20:.2f} | {r['opt_state_bytes'] / 2**20:.2f} | "
            f"{r.get('temp_bytes', 0) / 2**20:.2f} |")
    if any("tokens_per_sec" in r for r in rows):
        lines += ["", "tokens/s: " + ", ".join(f"{r['devices']} devices {r['tokens_per_sec']:,.0f}" for r in rows)]
    gpt = next((r for r in rows if "model_flops_per_token" in r), None)
    if gpt:
        xla = gpt.get("xla_flops_per_token")
        counted = f"; XLA's cost analysis counts {xla:,.0f}" if xla else ""
        lines += ["", f"FLOPs per token (6N + 12 x layers x block x width, N = {int(gpt['model_params_n']):,}): "
                      f"{int(gpt['model_flops_per_token']):,}{counted}"]
    if any("mfu" in r for r in rows):
        how = "model FLOPs per token x tokens/s per device" if gpt else "XLA FLOPs per device step / step time"
        parts = [f"{r['devices']} devices {r['mfu']:.1%}" + (f" (from XLA's count: {r['mfu_xla']:.1%})"
                                                             if gpt and "mfu_xla" in r else "")
                 for r in rows if "mfu" in r]
        lines += ["", f"MFU ({how}, over the peak): " + ", ".join(parts)]
    return "\n".join(lines) + "\n"


def warnings_for(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["allreduce_s"] and r["allreduce_s"] > COMM_DOMINATES * r["step_s"]:
            out.append(f"warning: on {r['devices']} devices the gradient all-reduce takes "
                       f"{r['allreduce_s'] / r['step_s']:.0%} of the step: communication dominates compute, so data "
                       "parallelism will not pay at this model and batch size (try a larger batch or fewer devices)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--predict" in argv:  # scaling predicted before hardware: jdp/predict.py
        from jdp import predict

        return predict.main([a for a in argv if a != "--predict"])
    parser = argparse.ArgumentParser(prog="python -m jdp.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=config_lib.DEFAULT_CONFIG)
    parser.add_argument("--devices", default="1,2", help="comma-separated device counts (default 1,2)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="output directory (default runs/bench-CONFIG_NAME)")
    parser.add_argument("--peak_tflops", type=float, default=0.0,
                        help="the device's peak TFLOP/s at the config's precision, to report MFU")
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = config_lib.load_config_file(args.config)
        cfg = config_lib.apply_overrides(cfg, config_lib.parse_overrides(rest))
        devices = [int(d) for d in args.devices.split(",")]
    except (config_lib.ConfigError, ValueError) as e:
        print(f"jdp.bench: {e}", file=sys.stderr)
        return 2
    try:  # on a CPU-only machine; ignored by accelerators
        simulate_cpu_devices(cfg.parallel.cpu_devices or max(devices))
    except RuntimeError:  # called from Python after JAX started: the devices are already fixed
        pass
    try:
        rows = run_bench(cfg, devices, args.steps, args.repeats, args.peak_tflops)
    except config_lib.ConfigError as e:
        print(f"jdp.bench: {e}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / f"bench-{args.config.stem}"
    out.mkdir(parents=True, exist_ok=True)
    table = to_markdown(cfg, rows)
    (out / "bench.json").write_text(json.dumps({"config": cfg.to_dict(), "rows": rows}, indent=2, default=list))
    (out / "bench.md").write_text(table)
    print(table)
    for line in warnings_for(rows):
        print(line)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
