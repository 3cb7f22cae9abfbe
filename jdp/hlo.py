"""What a compiled program sends over the wire, read from its HLO text after XLA's passes (`compiled.as_text()`):
under jit the collectives exist only once the program is partitioned, and XLA may combine them or change their
element type (XLA:CPU all-reduces a bfloat16 payload in float32).

The count is the operand bytes each device hands its all-reduces, reduce-scatters and all-gathers, in the steady
state of a training step:
- a collective in the entry computation runs every step;
- a conditional's last branch (the true branch of `lax.cond`) is the steady state, run once every `period` steps:
  a periodic sync's round, or a compressing strategy's path after its start step; its other branches (a start-up
  path, or nothing) are not counted;
- a while loop's body counts its known trip count times (once when XLA does not know it).
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")  # an unindented line opening a computation
_COLLECTIVE = re.compile(r"=\s+(.+?)\s+(all-reduce|reduce-scatter|all-gather)(-start)?\(")
_SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(true|false)_computation=%?([\w.\-]+)")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED = re.compile(r"\b(?:to_apply|calls)=%?([\w.\-]+)")


def _bytes(shapes: list[tuple[str, str]]) -> int:
    return sum(_ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d) for dtype, dims in shapes)


def shape_bytes(text: str) -> int:
    """Bytes of the first HLO-style shape (`f32[2,4]`) on each line of `text`."""
    return _bytes([found[0] for line in text.splitlines() if (found := _SHAPE.findall(line))])


def sends_dtype(hlo_text: str, dtype: str) -> bool:
    """Whether a collective of the program carries `dtype` (`bf16`, `f32`, ...)."""
    return any(found == dtype for match in _COLLECTIVE.finditer(hlo_text) for found, _ in _SHAPE.findall(match[1]))


def collective_bytes(hlo_text: str, num_devices: int, period: int = 1) -> float:
    """The operand bytes per device of the program's collectives per step (see the module docstring).
    `num_devices`: the size of the collectives' device group (an all-gather's operand is its result / N, a
    reduce-scatter's its result * N); `period`: how many steps apart a conditional's steady branch runs."""
    sent: dict[str, float] = defaultdict(float)  # computation -> bytes of its own collectives
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)  # computation -> (callee, runs per run of it)
    entry = computation = None
    for line in hlo_text.splitlines():
        if opened := _COMPUTATION.match(line):
            computation = opened.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        if match := _COLLECTIVE.search(line):
            shapes, op, start = match.groups()
            found = _SHAPE.findall(shapes)
            if op == "all-gather" and start:  # an asynchronous all-gather's result is (operands, results)
                sent[computation] += _bytes(found[:len(found) // 2])
            else:
                sent[computation] += _bytes(found) * {"all-gather": 1 / num_devices,
                                                      "reduce-scatter": num_devices}.get(op, 1)
        if " conditional(" in line:
            listed = _BRANCHES.search(line)
            named = dict((kind, name) for kind, name in _TRUE_FALSE.findall(line))
            branches = ([b.strip().lstrip("%") for b in listed.group(1).split(",")] if listed
                        else [named["false"], named["true"]])
            calls[computation] += [(b, 0.0) for b in branches[:-1]] + [(branches[-1], 1 / period)]
        elif body := _WHILE_BODY.search(line):
            trips = _TRIP_COUNT.search(line)
            calls[computation].append((body.group(1), float(trips.group(1)) if trips else 1.0))
        else:
            calls[computation] += [(callee, 1.0) for callee in _CALLED.findall(line)]

    @functools.cache
    def total(computation: str) -> float:
        return sent[computation] + sum(runs * total(callee) for callee, runs in calls[computation] if runs)

    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return total(entry) if num_devices > 1 else 0.0  # a group of one device sends nothing
