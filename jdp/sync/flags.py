"""The one mapping from the strategy flags of `fit` and the config (`sync` naming one of `NAMES`, and `FLAGS`) to a
strategy object."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from jdp.sync.base import AllReduce, Sync
from jdp.sync.diloco import DiLoCo
from jdp.sync.hybrid import HybridShard
from jdp.sync.local_sgd import LocalSGD
from jdp.sync.powersgd import PowerSGD, needs
from jdp.sync.quantized import QuantizedAllReduce
from jdp.sync.zero1 import ZeRO1
from jdp.sync.zero3 import ZeRO3

FLAGS = ("shard_optimizer", "shard_params", "shard_group", "sync_every", "allreduce_dtype", "powersgd_rank",
         "powersgd_start_step", "outer_optimizer", "outer_lr", "outer_momentum")
NAMES = ("allreduce", "zero1", "zero3", "local_sgd", "diloco", "powersgd")


def chosen(o: dict[str, Any], view: Any, require: Callable[[bool, str], None]) -> tuple[Sync, str]:
    """(the strategy the flags in `o` name, how `view` names it); `require(condition, line)` refuses contradictions."""
    n, sync = view, o["sync"]
    if isinstance(sync, Sync):
        params = sync.params()
        require(isinstance(params, dict), f"{type(sync).__name__}.params() returned {params!r}; return a dict of "
                "the parameters that define its numerics, by keyword")
        changed = [flag for flag in FLAGS if o[flag] != view.default(flag)]
        require(not changed, f"{n('sync')}={sync!r} is a strategy object, and {n(changed[0])}={o[changed[0]]!r} is a "
                f"strategy setting: give it to the object, or leave {n(changed[0])} at its default" if changed
                else "")
        return sync, repr(sync)
    require(isinstance(sync, str) and sync in NAMES, f"{n('sync')}={sync!r} is unknown; choose one of "
            f"{', '.join(NAMES)}, or give a strategy object (a jdp.sync.Sync)")
    h, dtype = o["sync_every"], o["allreduce_dtype"]
    require(not (o["shard_params"] and o["shard_optimizer"]), f"{n('shard_params')}=True (ZeRO-3) already shards the "
            f"optimizer state; set {n('shard_optimizer')}=False")
    require(not o["shard_optimizer"] or h == 1, f"{n('shard_optimizer')}=True and {n('sync_every')} > 1 (local SGD) "
            "cannot be combined")
    zero1 = f"{n('shard_optimizer')}=True" if o["shard_optimizer"] else f"{n('sync')}=zero1" if sync == "zero1" else ""
    zero3 = f"{n('shard_params')}=True" if o["shard_params"] else f"{n('sync')}=zero3" if sync == "zero3" else ""
    require(not zero1 or dtype in ("fp32", "bf16"), f"{zero1} reduce-scatters the gradient in fp32 or bf16, not "
            f"{dtype}; use {view.use('allreduce_dtype', 'fp32')}")
    in_param_dtype = ("reduce-scatters the gradient in the parameters' dtype (the gather's transpose); use "
                      f"{view.use('allreduce_dtype', 'fp32')}")
    require(sync != "zero3" or dtype == "fp32", f"{n('sync')}=zero3 {in_param_dtype}")
    require(not o["shard_params"] or h == 1 and sync == "allreduce",
            f"{n('shard_params')}=True reduce-scatters each step's gradient, so it cannot be combined with "
            f"{n('sync_every')} > 1 (local SGD, DiLoCo) or {n('sync')}=powersgd; set {n('shard_params')}=False")
    require(not o["shard_params"] or dtype == "fp32", f"{n('shard_params')}=True {in_param_dtype}")
    diloco = h > 1 and (sync == "diloco" or o["outer_optimizer"] != "none")
    if (k := o["shard_group"]) and not diloco:
        require(h == 1 and sync in ("allreduce", "zero1", "zero3"),
                f"{n('shard_group')}={k} (hybrid sharding) reduce-scatters each step's gradient inside its groups, so "
                f"it cannot be combined with {n('sync_every')} > 1 (local SGD; DiLoCo takes it, with an "
                f"{n('outer_optimizer')}) or {n('sync')}={sync}; set {n('shard_group')}=0")
        require(dtype == "fp32", f"{n('shard_group')}={k} (hybrid sharding) sends the gradient in float32; use "
                                 f"{view.use('allreduce_dtype', 'fp32')}")
        return HybridShard(k, 1 if zero1 else 3), f"{n('shard_group')}={k}"
    if sync == "powersgd":
        require(h == 1 and not o["shard_optimizer"] and dtype == "fp32", needs(f"{n('sync')}=powersgd", view))
        return PowerSGD(o["powersgd_rank"], o["powersgd_start_step"]), f"{n('sync')}=powersgd"
    require(o["outer_optimizer"] == "none" or h > 1, f"{n('outer_optimizer')}={o['outer_optimizer']} (DiLoCo) "
            f"applies the change of each round of {n('sync_every')} steps; set {n('sync_every')} > 1")
    require(h == 1 or sync in ("allreduce", "local_sgd", "diloco"), f"{n('sync')}={sync} runs every step; set "
            f"{n('sync_every')}=1")
    require(h > 1 or sync not in ("local_sgd", "diloco"), f"{n('sync')}={sync} averages every {n('sync_every')} "
            f"steps; set {n('sync_every')} > 1")
    if h > 1:
        require(dtype == "fp32" or (diloco and dtype in ("int8", "int4")), f"{n('allreduce_dtype')}={dtype} "
                f"compresses gradients, and local SGD ({n('sync_every')} > 1) averages parameters instead (DiLoCo "
                f"sends its outer gradient in int8 or int4); use {view.use('allreduce_dtype', 'fp32')}")
        if diloco:
            outer = "nesterov" if o["outer_optimizer"] == "none" else o["outer_optimizer"]
            bits = 32 if dtype == "fp32" else int(dtype[3:])
            return (DiLoCo(h, o["outer_lr"], o["outer_momentum"], outer, bits, group_size=k or 1),
                    f"{n('sync_every')}={h}" + (f", {n('shard_group')}={k}" if k else ""))
        return LocalSGD(h), f"{n('sync_every')}={h}"
    if zero3 or zero1:
        return ZeRO3() if zero3 else ZeRO1(dtype), zero3 or zero1
    quantized = dtype in ("int8", "int4")
    return QuantizedAllReduce(int(dtype[3:])) if quantized else AllReduce(dtype), f"{n('allreduce_dtype')}={dtype}"


def from_config(path: str, kwargs: dict[str, Any]) -> Sync | str:
    """The strategy class at `path` (`pkg.module:Class`) built with `kwargs`, or a built-in name as it is (its
    settings are flags of their own); ValueError in one line otherwise."""
    if path in NAMES:
        if kwargs:
            raise ValueError(f"{path} is built in and takes its settings from its own keys, not sync_kwargs "
                             f"({', '.join(kwargs)}); drop them, or name a strategy by import path pkg.module:Class")
        return path
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"{path!r} is neither one of {', '.join(NAMES)} nor an import path pkg.module:Class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - a module that fails as it imports: its own error, a SyntaxError
        raise ValueError(f"{path!r} cannot be imported ({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, Sync)):
        raise ValueError(f"{path!r} is not a subclass of jdp.sync.Sync")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}(**{kwargs}) fails: {e}") from None
