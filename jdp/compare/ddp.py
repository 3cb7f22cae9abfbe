"""The PyTorch DDP side: `python -m jdp.compare.ddp SPEC.json` (written by `parity.run_ddp`) spawns `workers` ranks
(gloo over loopback on CPU, NCCL with one GPU per rank on CUDA), each training the config's twin under DDP on the
rows jdp's device `rank` gets. Rank 0 writes OUT/ddp_result.json; mode "parity" adds the all-reduced loss, gradient
norm, eval and final weights.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from jdp.cli import config as config_lib
from jdp.compare import torch_models, weights
from jdp.data import build_source
from jdp.sync.base import DDPTwin

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adamw")


def make_optimizer(optim_cfg, model: torch.nn.Module) -> torch.optim.Optimizer:
    """jdp.cli.optim.build_optimizer's transform in torch (lr set per step): optax's sgd chain with decayed weights
    is torch SGD with dampening 0 and coupled decay; optax adamw is torch AdamW's update in another order, equal
    to rounding. Decay is masked off vectors on both sides (jdp's `p.ndim > 1`)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    name = optim_cfg.name
    if name in ("sgd", "momentum", "nesterov"):
        momentum = 0.0 if name == "sgd" else optim_cfg.momentum
        return torch.optim.SGD(groups, lr=0.0, momentum=momentum, dampening=0.0, nesterov=name == "nesterov")
    return torch.optim.AdamW(groups, lr=0.0, betas=(optim_cfg.momentum, optim_cfg.get("b2", 0.999)), eps=1e-8)


def _clip_like_optax(grads: list[torch.Tensor], max_norm: float) -> None:
    """optax.clip_by_global_norm: unchanged below max_norm, else g / norm * max_norm (torch's
    clip_grad_norm_ would scale by max_norm / (norm + 1e-6))."""
    norm = torch.nn.utils.get_total_norm(grads)
    if not bool(norm < max_norm):
        for g in grads:
            g.div_(norm).mul_(max_norm)


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Per example or per token (logits (B, T, V)): a mean over every entry of the rank's rows, as jdp's."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def _evaluate(model: torch.nn.Module, cfg, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy over the whole eval split, as jdp's evaluate (padded rows masked)."""
    source = build_source(cfg.data, seed=cfg.seed, global_batch_size=cfg.train.global_batch_size,
                          eval_batch_size=cfg.train.eval_batch_size)  # 0: the global batch size, as in jdp
    model.eval()
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for rows in source.eval_batches():
            logits = model(torch_models.prepare_input(model, rows["x"]).to(device)).float()
            y = torch.from_numpy(rows["y"]).long().to(device)
            mask = torch.from_numpy(rows["mask"]).to(device).view(-1, *[1] * (y.ndim - 1)).expand(y.shape)
            loss_sum += float((_cross_entropy(logits, y, reduction="none") * mask.flatten()).sum())
            correct += float(((logits.argmax(-1) == y).float() * mask).sum())
            count += float(mask.sum())
    return loss_sum / count, correct / count


def ddp_twin(cfg) -> DDPTwin:
    """How DDP computes what the config's sync strategy computes; ValueError in one line where it cannot."""
    strategy = config_lib.sync_strategy(config_lib.fit_values(cfg))[0]
    twin = strategy.ddp_twin()
    if twin is None:
        raise ValueError(f"sync {strategy!r}: the DDP twin mirrors the float32 mean all-reduce and DDP's "
                         "powerSGD_hook only; choose one of those")
    return twin


def _low_rank(ddp: DDP, settings: dict, seed: int) -> float:
    """Registers DDP's own `powerSGD_hook` with jdp's strategy's settings (`Sync.ddp_twin`); returns the float32 bytes
    it sends per step after the start, by its rule (a tensor of 2+ dimensions is the matrix (shape[0], the rest))."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    rank = settings["matrix_approximation_rank"]
    state = powerSGD_hook.PowerSGDState(process_group=None, random_seed=seed, **settings)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    floats = 0
    for p in ddp.module.parameters():
        n, m = p.shape[0], p.numel() // max(p.shape[0], 1)
        r = min(rank, n, m)
        floats += r * (n + m) if p.ndim > 1 and r * (n + m) < n * m else p.numel()
    return floats * 4.0


def train(rank: int, spec: dict) -> dict:
    cfg = config_lib.load_saved_config(Path(spec["config"]))
    world, steps, parity = spec["workers"], cfg.train.steps, spec["mode"] == "parity"
    device = torch.device(f"cuda:{rank}" if spec["device"] == "cuda" else "cpu")
    batch_size = cfg.train.global_batch_size
    source = build_source(cfg.data, seed=cfg.seed, global_batch_size=batch_size,
                          eval_batch_size=cfg.train.eval_batch_size, process_index=rank, process_count=world)
    model = torch_models.build_twin(cfg.model, source.input_shape, cfg.data.num_classes or source.num_classes,
                                    sync_bn=cfg.model.bn_sync and world > 1)
    with np.load(spec["init"]) as init:
        model.load_state_dict(weights.flat_to_torch(dict(init), model), strict=True)
    model.to(device)
    compiled = torch.compile(model) if spec.get("compile") else model  # the same parameters
    autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    with warnings.catch_warnings():  # broadcast_buffers=False: with True, rank 0's BatchNorm statistics overwrite all
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)  # torch 2.13 on
        ddp = DDP(compiled, device_ids=[rank] if device.type == "cuda" else None, broadcast_buffers=False)
    twin = ddp_twin(cfg)
    comm_bytes = _low_rank(ddp, twin.settings, cfg.seed) if twin.hook == "powerSGD_hook" else None
    optimizer = make_optimizer(cfg.optim, model)
    params = list(model.parameters())
    bn_stats = [] if (cfg.model.bn_sync and world > 1) else [  # each rank's running statistics, averaged per step
        b for m in model.modules() if isinstance(m, torch_models.BatchNorm) for b in (m.running_mean, m.running_var)]
    lrs, clip = spec["lrs"], cfg.optim.grad_clip_norm
    losses, grad_norms = [], []

    def now() -> float:  # once the device's queued work is done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.time()

    for step in range(steps):
        rows = source.train_batch(step)
        x = torch_models.prepare_input(model, rows["x"]).to(device, non_blocking=True)
        y = torch.from_numpy(rows["y"]).long().to(device, non_blocking=True)
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        with autocast:
            loss = _cross_entropy(ddp(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        grads = [p.grad for p in params]
        if parity:
            grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        if clip > 0:
            _clip_like_optax(grads, clip)
        optimizer.step()
        torch_models.average_bn_buffers(bn_stats, world)
        loss = loss.detach()
        if parity:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss)  # rank-local in speed mode; read after the loop, so no step waits on it
        if step == 0:
            t_first = now()

    result = {"examples_per_sec": batch_size * (steps - 1) / (now() - t_first) if steps > 1 else float("nan"),
              "losses": [float(loss) for loss in losses], "grad_norms": grad_norms, "backend": dist.get_backend(),
              "time_to_first_step_s": t_first - spec["launch_time"],
              "torch": torch.__version__, "threads": torch.get_num_threads(), "comm_bytes_per_step": comm_bytes}
    if parity and rank == 0:
        result["eval_loss"], result["eval_accuracy"] = _evaluate(model, cfg, device)
        np.savez(Path(spec["out"]) / "ddp_final.npz", **weights.torch_to_flat(model.state_dict(), model))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    result["peak_rss_mib_per_worker"] = [r / 1024 for r in gathered]
    return result


def _worker(rank: int, spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if spec["device"] == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # Rendezvous through a file, not a TCP port that another program could take first.
    dist.init_process_group(backend, init_method=f"file://{Path(spec['out']).resolve() / 'rendezvous'}", rank=rank,
                            world_size=spec["workers"], timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    result = train(rank, spec)
    if rank == 0:
        (Path(spec["out"]) / "ddp_result.json").write_text(json.dumps(result))
    dist.barrier()  # every rank is done with gloo
    # Leave without interpreter teardown: gloo's worker threads, still owned by DDP's reducer, can abort
    # the process ("terminate called without an active exception") when they are destroyed at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # python -m jdp.compare.ddp SPEC.json
    spec = json.loads(Path(sys.argv[1]).read_text())
    (Path(spec["out"]) / "rendezvous").unlink(missing_ok=True)  # a stale store file would hang the rendezvous
    # A failed rank ends the others and raises here; the time limit is the parent's (`procs.run` kills the group).
    mp.start_processes(_worker, args=(spec,), nprocs=spec["workers"], start_method="spawn")
