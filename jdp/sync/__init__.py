"""Step 3, the gradient sync, as strategies behind one interface (`jdp.sync.Sync`), like DDP's communication hooks:
`fit(sync=...)` takes one, a `Sync` subclass of your own, or a name (flags: `jdp.sync.flags`; docs/communication.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jdp.sync.base import AllReduce, Local, Reduced, Sync
from jdp.sync.diloco import DiLoCo
from jdp.sync.flags import FLAGS, NAMES
from jdp.sync.hybrid import HybridShard
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.powersgd import PowerSGD
from jdp.sync.quantized import QuantizedAllReduce
from jdp.sync.streaming import StreamingDiLoCo
from jdp.sync.zero1 import Sliceable, ZeRO1, clip_by_global_norm
from jdp.sync.zero3 import ZeRO3

__all__ = ["NAMES", "AllReduce", "DiLoCo", "HybridShard", "Local", "LocalSGD", "PowerSGD", "QuantizedAllReduce",
           "Reduced", "Sliceable", "StreamingDiLoCo", "Sync", "ZeRO1", "ZeRO3", "clip_by_global_norm", "for_inference",
           "strategy"]


def for_inference(options: Any) -> Any:
    """`fit`'s options (checked) with `Sync.for_inference`'s strategy as an object, every strategy flag at default."""
    from jdp.options import DEFAULTS

    return dataclasses.replace(options, sync=strategy(options)[0].for_inference(),
                               **{flag: DEFAULTS[flag] for flag in FLAGS})


def strategy(options: Any) -> tuple[Sync, str]:
    """(the strategy `fit`'s options name, how they name it), the options already checked (`jdp.options.check`)."""
    from jdp.options import BY_NAME, check

    return check({name: getattr(options, name) for name in BY_NAME})
