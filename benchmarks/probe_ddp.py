"""Where PyTorch DDP's step time goes on this CPU: the twin model (jdp/compare/torch_models.py) in two
spawned gloo processes, one thread each, per-rank batch = the config's global batch / 2.

    python benchmarks/probe_ddp.py [--config configs/synthetic_mlp.py] [--steps 60]     # needs the compare extra

Per step, medians over `--steps` timed steps after 5 warm-up steps, rank 0's view:
- compute: forward + backward + SGD update, no communication;
- all-reduce: gloo `all_reduce` of one flat tensor the size of all gradients;
- DDP step: the same update through DistributedDataParallel (bucketed all-reduce overlapped with backward).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from jdp.cli import config as config_lib  # noqa: E402
from jdp.compare import torch_models  # noqa: E402
from jdp.data import build_source  # noqa: E402

WORKERS = 2


def _timed(fn, steps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _worker(rank: int, config: str, steps: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORKERS)
    cfg = config_lib.load_config_file(config)
    batch = cfg.train.global_batch_size
    source = build_source(cfg.data, seed=cfg.seed, global_batch_size=batch, eval_batch_size=batch,
                          process_index=rank, process_count=WORKERS)
    rows = source.train_batch(0)
    torch.manual_seed(0)
    model = torch_models.build_twin(cfg.model, source.input_shape, cfg.data.num_classes or source.num_classes)
    x, y = torch_models.prepare_input(model, rows["x"]), torch.from_numpy(rows["y"]).long()
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    compute = _timed(lambda: step(model, torch.optim.SGD(model.parameters(), lr=1e-3)), steps)
    dist.barrier()
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    allreduce = _timed(lambda: dist.all_reduce(flat), steps)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    dist.barrier()
    ddp_step = _timed(lambda: step(ddp, ddp_opt), steps)
    if rank == 0:
        print(f"{Path(config).stem}: {flat.numel():,} parameters, {len(y)} rows per rank, {WORKERS} gloo processes, "
              "1 thread each")
        print(f"| per step | ms |\n|---|---:|\n| forward + backward + SGD, no communication | {compute:.1f} |\n"
              f"| gloo all_reduce of all gradients ({flat.numel() * 4 / 1e6:.1f} MB) | {allreduce:.1f} |\n"
              f"| the DDP step | {ddp_step:.1f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "synthetic_mlp.py"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(args.config, args.steps, str(Path(tmp) / "rendezvous")), nprocs=WORKERS)


if __name__ == "__main__":
    main()
