"""Step 3 of data parallelism, the gradient sync, as strategies behind one interface (`jdp.sync.Sync`), like DDP's
communication hooks. The built-ins, each a public class with its own parameters:
- `AllReduce(dtype="fp32")`: the mean all-reduce (the default; "bf16" as DDP's bf16 compression hook);
- `ZeRO1(dtype="fp32")`: the optimizer state sharded, the gradient reduce-scattered;
- `ZeRO3()`: parameters, gradients and optimizer state sharded (FSDP), a scanned model gathered layer by layer;
- `HybridShard(group_size=k, stage=3)`: ZeRO-3 (or ZeRO-1) inside groups of k devices (a node's: by default one
  process's), data parallelism across the groups (HSDP), on a groups x `data` mesh;
- `LocalSGD(every=H)` and `DiLoCo(every=H, outer_lr=0.7, outer_momentum=0.9)`: H local steps, then a sync
  (`DiLoCo(..., group_size=k)`: a learner a group of k devices, data parallel inside);
  `StreamingDiLoCo(every=H, fragments=F, overlap=0)`: DiLoCo syncing F fragments of the model in turn;
- `PowerSGD(rank=4, start_step=10, min_compression_rate=1)`: low-rank compression with error feedback;
- `QuantizedAllReduce(bits=8, block=256)`: int8 or int4 gradients through an all-to-all and an all-gather (qgZ).

`fit(sync=...)` takes one of them, a strategy of your own (a subclass of `Sync`, in your file), or a name; the
older flags map onto them in `jdp.sync.flags`. docs/communication.md shows a strategy written outside jdp."""

from __future__ import annotations

import dataclasses
from typing import Any

from jdp.sync.base import AllReduce, Local, Reduced, Sync
from jdp.sync.diloco import DiLoCo
from jdp.sync.flags import FLAGS, NAMES, chosen
from jdp.sync.hybrid import HybridShard
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.powersgd import PowerSGD
from jdp.sync.quantized import QuantizedAllReduce
from jdp.sync.streaming import StreamingDiLoCo
from jdp.sync.zero1 import ZeRO1
from jdp.sync.zero3 import ZeRO3

__all__ = ["NAMES", "AllReduce", "DiLoCo", "HybridShard", "Local", "LocalSGD", "PowerSGD", "QuantizedAllReduce",
           "Reduced", "StreamingDiLoCo", "Sync", "ZeRO1", "ZeRO3", "for_inference", "strategy"]


def for_inference(options: Any) -> Any:
    """`fit`'s options (checked) with the strategy that restores the run's checkpoints on any device count
    (`Sync.for_inference`) given as an object, every strategy flag at its default."""
    from jdp.options import BY_NAME

    return dataclasses.replace(options, sync=strategy(options)[0].for_inference(),
                               **{flag: BY_NAME[flag].default for flag in FLAGS})


def strategy(options: Any) -> tuple[Sync, str]:
    """(the strategy `fit`'s options name, how they name it), the options already checked (`jdp.options.check`)."""
    from jdp.errors import FitError
    from jdp.options import BY_NAME, FIT_NAMES

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise FitError(message)

    values = {name: getattr(options, name) for name in BY_NAME}
    return chosen(values, FIT_NAMES, require, {name: option.default for name, option in BY_NAME.items()})
