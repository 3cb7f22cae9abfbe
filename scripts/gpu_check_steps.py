"""The Python steps of scripts/gpu_check.sh, one subcommand each; every one prints one result line and writes its
figures to DIR/NAME.json, and `summary` gathers them into DIR/gpu_check.json.

    python scripts/gpu_check_steps.py {versions,xla_flags,torch_resnet50,train_vs_bench,gpt,summary} DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _write(out: Path, name: str, figures: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(figures, indent=1, default=str))


def versions(out: Path) -> None:
    """Library versions, the device, NCCL: what every other figure ran on."""
    from importlib.metadata import PackageNotFoundError, version

    figures = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "torchvision", "numpy",
                 "opencv-python-headless", "pillow"):
        try:
            figures[name] = version(name)
        except PackageNotFoundError:
            figures[name] = None
    import jax

    figures["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    figures["backend"] = jax.default_backend()
    try:
        import torch

        figures["torch_cuda"] = torch.version.cuda
        figures["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except ImportError:
        pass
    figures["cpu_cores"] = os.cpu_count()
    _write(out, "versions", figures)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


def xla_flags(out: Path) -> None:
    """jdp's XLA flags parse on this jax, and an unknown flag aborts the process (so a typo cannot pass unseen)."""
    from jdp.configs import base
    from jdp.environment import apply_communication_flags

    cfg = base.get_config()
    cfg.parallel.allreduce_combine_threshold_bytes = 25 * 2**20
    os.environ.pop("XLA_FLAGS", None)
    apply_communication_flags(cfg.parallel)
    ours = os.environ.pop("XLA_FLAGS")
    probe = [sys.executable, "-c", "import jax; jax.devices(); print('ok')"]

    def runs(flags: str) -> bool:
        env = {**os.environ, "XLA_FLAGS": flags}
        return subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120).returncode == 0

    figures = {"jdp_flags": ours, "jdp_flags_parse": runs(ours),
               "unknown_flag_aborts": not runs("--xla_jdp_no_such_flag=1")}
    _write(out, "xla_flags", figures)
    print(f"xla flags: jdp's ({ours}) parse: {figures['jdp_flags_parse']}; an unknown flag aborts: "
          f"{figures['unknown_flag_aborts']}")


def torch_resnet50(out: Path, batch: int = 256, steps: int = 30) -> None:
    """PyTorch at its best on the same step: torchvision ResNet-50 (jdp's torch twin if torchvision is missing),
    channels_last, bf16 autocast, cudnn.benchmark, SGD momentum, synthetic 224x224 batches already on the GPU."""
    import torch

    if not torch.cuda.is_available():
        print("torch resnet50: no GPU")
        return
    try:
        from torchvision.models import resnet50

        model, source = resnet50(num_classes=1000), "torchvision"
    except ImportError:
        import ml_collections

        from jdp.compare.torch_models import build_twin

        twin_cfg = ml_collections.ConfigDict({"name": "resnet50", "kwargs": {"stem": "imagenet"}})
        model, source = build_twin(twin_cfg, (224, 224, 3), 1000), "jdp's torch twin"
    torch.backends.cudnn.benchmark = True
    model = model.cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):  # cudnn.benchmark picks its kernels here
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    img_s = batch / sorted(times)[1]
    _write(out, "torch_resnet50", {"img_per_s": img_s, "model": source, "batch": batch,
                                   "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})
    print(f"torch resnet50 ({source}, channels_last, bf16 autocast, cudnn.benchmark): {img_s:,.0f} img/s")


def train_vs_bench(out: Path) -> None:
    """examples/sec of the `python -m jdp.train` run against jdp.bench's for the same config."""
    from jdp.metrics import read_metrics

    summary = [r for r in read_metrics(out / "train") if r["split"] == "summary"]
    rows = json.loads((out / "bench-bf16" / "bench.json").read_text())["rows"]
    if not summary:
        print("train vs bench: the train run wrote no summary")
        return
    train, bench = summary[-1]["examples_per_sec"], rows[0]["examples_per_sec"]
    figures = {"train_examples_per_sec": train, "bench_examples_per_sec": bench, "ratio": train / bench,
               "compile_time_s": summary[-1]["compile_time_s"], "checkpoint_stall_s": summary[-1]["checkpoint_stall_s"]}
    _write(out, "train_vs_bench", figures)
    print(f"jdp.train {train:,.0f} examples/s = {train / bench:.2f} x jdp.bench's {bench:,.0f} (the loop's "
          f"overhead); first step {figures['compile_time_s']:.1f} s, checkpoint stall "
          f"{figures['checkpoint_stall_s'] * 1e3:.0f} ms")


def gpt(out: Path) -> None:
    """The shakespeare_char GPT (nanoGPT's GPU recipe) in bf16: jdp.bench's tokens/s and MFU, then jdp against its
    PyTorch twin under torch.compile and bf16 autocast, as nanoGPT runs it."""
    config = ["--config", str(ROOT / "configs" / "shakespeare_char.py"), "--config.precision=bf16"]
    subprocess.run([sys.executable, "-m", "jdp.bench", *config, "--devices", "1", "--steps", "20", "--repeats", "2",
                    "--no-baseline", "--out", str(out / "bench-gpt")], check=True)
    subprocess.run([sys.executable, "-m", "jdp.compare", "speed", *config, "--device", "cuda", "--workers", "1",
                    "--torch_compile", "--backends", "shard_map", "--repeats", "2", "--steps", "100",
                    "--workdir", str(out / "gpt-vs-torch")], check=True)
    print(f"gpt: jdp.bench in {out / 'bench-gpt'}, jdp vs the torch.compile twin in {out / 'gpt-vs-torch'}")


def summary(out: Path) -> None:
    """Every step's figures in one JSON, plus the headline ratios."""
    figures = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "gpu_check.json"}
    for precision in ("bf16", "fp32"):
        bench = out / f"bench-{precision}" / "bench.json"
        if bench.exists():
            row = json.loads(bench.read_text())["rows"][0]
            figures[f"jdp_{precision}"] = {k: row.get(k) for k in (
                "examples_per_sec", "mfu", "peak_tflops", "first_step_s", "step_s", "matmul_dtypes", "temp_bytes",
                "argument_bytes", "output_bytes", "flops", "device_kind")}
    bf16, fp32 = figures.get("jdp_bf16", {}), figures.get("jdp_fp32", {})
    if bf16 and fp32:
        figures["bf16_over_tf32"] = bf16["examples_per_sec"] / fp32["examples_per_sec"]
    if bf16 and "torch_resnet50" in figures:
        figures["jdp_bf16_over_torch"] = bf16["examples_per_sec"] / figures["torch_resnet50"]["img_per_s"]
    (out / "gpu_check.json").write_text(json.dumps(figures, indent=1, default=str))
    headline = {k: round(v, 3) for k, v in figures.items() if isinstance(v, float)}
    print(f"summary: {headline or 'no GPU figures'} (every figure: gpu_check.json)")


if __name__ == "__main__":
    step, directory = sys.argv[1], Path(sys.argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    {"versions": versions, "xla_flags": xla_flags, "torch_resnet50": torch_resnet50, "train_vs_bench": train_vs_bench,
     "gpt": gpt, "summary": summary}[step](directory)
