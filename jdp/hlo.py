"""What a compiled program sends, read from its HLO text after XLA's passes (`compiled.as_text()`): the operand
bytes each device hands its collectives per step, in the steady state (docs/communication.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")  # an unindented line opening a computation
_COLLECTIVE = re.compile(r"=\s+(.+?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all|ragged-all-to-all"
                         r"|collective-permute)(-start)?\(")
# An element type (pred, s4, bf16, f8e4m3fn, c64, ...) and its dimensions; its bits: its first number (pred: 8).
_SHAPE = re.compile(r"\b(pred|bf16|[sufc]\d+(?:e\w+)?)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"(true|false)_computation=%?([\w.\-]+)")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED = re.compile(r"\b(?:to_apply|calls)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class CommBytes:
    """Operand bytes per device per step: of the collectives within one group of devices, and of the others."""
    in_group: float
    cross_group: float

    @property
    def total(self) -> float:
        return self.in_group + self.cross_group


def _bytes(shapes: list[tuple[str, str]]) -> int:
    return sum(math.ceil(int(re.match(r"\D+(\d*)", dtype)[1] or 8) * math.prod(int(d) for d in dims.split(",") if d)
                         / 8) for dtype, dims in shapes)


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, b, ...)`."""
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape[1:-1], 1):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            elements.append(shape[start:i])
            start = i + 1
    return elements + [shape[start:-1]]


def _groups(line: str, num_devices: int) -> list[set[int]]:
    """The device groups of a collective's line (a collective-permute's: its source-target pairs)."""
    if iota := _IOTA_GROUPS.search(line):
        count, size, dims, perm = iota.groups()
        ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
        ids = ids.transpose([int(p) for p in perm.split(",")]) if perm else ids
        return [set(group) for group in ids.reshape(int(count), int(size)).tolist()]
    listed = _GROUPS.search(line) or _PAIRS.search(line)
    groups = re.findall(r"\{([\d,]+)\}", listed[1]) if listed else []
    return [{int(d) for d in group.split(",")} for group in groups] or [set(range(num_devices))]


def sends_dtype(hlo_text: str, dtype: str) -> bool:
    """Whether a collective of the program carries `dtype` (`bf16`, `f32`, ...)."""
    return any(found == dtype for match in _COLLECTIVE.finditer(hlo_text) for found, _ in _SHAPE.findall(match[1]))


def shape_bytes(text: str) -> int:
    """Bytes of the first HLO-style shape (`f32[2,4]`) on each line of `text`."""
    return _bytes([found[0] for line in text.splitlines() if (found := _SHAPE.findall(line))])


def collectives(hlo_text: str, num_devices: int, period: int = 1, group_size: int | None = None) -> CommBytes:
    """The operand bytes per device of the program's collectives per step. `num_devices`: those of a collective
    without replica groups; `period`: steps between a conditional's runs; `group_size`: a collective is in-group when
    each replica group (or source-target pair) lies within one block of that many consecutive devices (None: none)."""
    sent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # computation -> in-group, cross-group bytes
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)  # computation -> (callee, runs per run of it)
    entry = computation = None
    for line in hlo_text.splitlines():
        if opened := _COMPUTATION.match(line):
            computation = opened.group(1)
            entry = computation if line.startswith("ENTRY") else entry
            continue
        if match := _COLLECTIVE.search(line):
            shape, op, start = match.groups()
            result = _elements(shape)[1] if start and op != "all-reduce" else shape  # -start: (operands, result, ..)
            groups = _groups(line, num_devices)
            if max(len(group) for group in groups) > 1:
                size = len(groups[0])
                within = group_size is not None and all(len({d // group_size for d in g}) == 1 for g in groups)
                sent[computation][0 if within else 1] += _bytes(_SHAPE.findall(result)) * {
                    "all-gather": 1 / size, "reduce-scatter": size}.get(op, 1)
        if " conditional(" in line:
            listed = _BRANCHES.search(line)
            named = dict(_TRUE_FALSE.findall(line))
            branches = re.findall(r"[\w.\-]+", listed[1]) if listed else [named["false"], named["true"]]
            calls[computation] += ([(branches[0], 0.0), (branches[1], 1 / period)] if len(branches) == 2
                                   else [(b, 1 / period) for b in branches])
        elif body := _WHILE_BODY.search(line):
            trips = _TRIP_COUNT.search(line)
            calls[computation].append((body.group(1), float(trips.group(1)) if trips else 1.0))
        else:
            calls[computation] += [(callee, 1.0) for callee in _CALLED.findall(line)]

    @functools.cache
    def total(computation: str) -> tuple[float, float]:
        called = [(runs, total(callee)) for callee, runs in calls[computation] if runs]
        return tuple(sent[computation][i] + sum(runs * counted[i] for runs, counted in called) for i in (0, 1))

    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return CommBytes(*total(entry))
