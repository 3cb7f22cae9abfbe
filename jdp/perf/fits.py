"""`python -m jdp.bench --fits --memory_gb G --devices N` (docs/performance.md, "Making a model fit"): which GPT
shapes fit in G GB a device under each of STRATEGIES, by XLA's peak of a step compiled in a capped child process.
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time

SHAPES = {  # name: (layers, heads, width); block 1024, vocabulary 50,257, GPT-2's biases and tied embedding
    "GPT-2 small": (12, 12, 768),
    "GPT-2 medium": (24, 16, 1024),
    "GPT-2 large": (36, 20, 1280),
    "GPT-2 XL": (48, 25, 1600),
    "GPT 2.7B": (32, 32, 2560),
    "GPT 6.7B": (32, 32, 4096),
}
# name: (jdp.perf.measure.SHARDINGS entry, remat, scanned whatever the shape)
STRATEGIES = {"plain": ("plain", "none", False), "ZeRO-1": ("zero1", "none", False),
              "ZeRO-3": ("zero3", "none", False), "ZeRO-3 + scan + remat": ("zero3", "full", True)}


def measure_one(shape: str, strategy: str, devices: int) -> dict:
    """One compile, in this process (the child's side)."""
    from jdp.cli import config as config_lib
    from jdp.configs import gpt2_small
    from jdp.mesh import simulate_cpu_devices
    from jdp.perf.measure import compiled_memory

    with contextlib.suppress(RuntimeError):  # JAX already started (called in-process): its devices stand
        simulate_cpu_devices(devices)
    sharding, remat, scanned = STRATEGIES[strategy]
    layers, heads, width = SHAPES[shape] if shape in SHAPES else map(int, shape.split("x"))  # or "LxHxW": 2x2x16
    large = shape not in ("GPT-2 small", "GPT-2 medium")  # an unrolled compile grows with depth: "LxHxW" scanned
    cfg = config_lib.load_config_file(gpt2_small.__file__)
    cfg.model.kwargs.update(num_layers=layers, num_heads=heads, embed_dim=width, remat=remat,
                            scan_layers=scanned or large)
    cfg.compile_cache_dir = ""
    return {**compiled_memory(cfg, devices, sharding), "scanned": cfg.model.kwargs.scan_layers, "remat": remat,
            "host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def measure(shape: str, strategy: str, devices: int, timeout_s: float) -> dict:
    """One compile in a child process, killed after `timeout_s`."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "jdp.perf.fits", shape, strategy, str(devices)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"compile over {timeout_s:.0f} s"}
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}", "wall_s": time.perf_counter() - t0}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], memory_gb: float, devices: int) -> str:
    def gb(x: float) -> str:
        return f"{x / 2**30:,.2f}"

    lines = [f"Which GPT shapes fit in {memory_gb:g} GB a device on {devices} devices (one 1024-token sequence per "
             "device, float32, AdamW): the train step compiled from shapes by XLA:CPU, not run; a GPU compiler's "
             "buffers differ (jdp/perf/fits.py)", "",
             "| model | params | state | blocks | arguments GB/dev | temporaries GB/dev | peak GB/dev | fits | "
             "compile s | host RSS GB |", "|---|---:|---|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | | {r['strategy']} | | | | | {r['error']} | | |")
            continue
        fits = "yes" if r["peak_bytes"] <= memory_gb * 2**30 else "no"
        blocks = ("scanned" if r["scanned"] else "unrolled") + (f", remat {r['remat']}" if r["remat"] != "none"
                                                                else "")
        lines.append(f"| {r['shape']} | {r['params_n'] / 1e6:,.0f}M | {r['strategy']} | {blocks} | "
                     f"{gb(r['argument_bytes'])} | {gb(r['temp_bytes'])} | {gb(r['peak_bytes'])} | {fits} | "
                     f"{r['compile_s']:.0f} | {gb(r['host_rss_bytes'])} |")
    return "\n".join(lines) + "\n"


def run_fits(memory_gb: float, devices: int, timeout_s: float) -> tuple[list, str]:
    rows = []
    for shape in SHAPES:
        for strategy in STRATEGIES:
            row = {"shape": shape, "strategy": strategy, **measure(shape, strategy, devices, timeout_s)}
            rows.append(row)
            print(f"{shape}, {strategy}: " + (row["error"] if "error" in row else
                                               f"peak {row['peak_bytes'] / 2**30:.2f} GB/dev"), flush=True)
    return rows, table(rows, memory_gb, devices)


if __name__ == "__main__":  # the child of `measure`: python -m jdp.perf.fits SHAPE STRATEGY DEVICES
    print(json.dumps(measure_one(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
