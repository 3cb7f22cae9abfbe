"""Where the CPU GPT recipe's train step spends its time, op class by op class, in jdp (XLA's profile of the
compiled step) and in nanoGPT (torch.profiler over its own model.py and AdamW), same shapes: 4 layers, 4 heads,
width 128, block 64, batch 12, 65 symbols (docs/benchmarks.md, "jdp against nanoGPT").

    python benchmarks/profile_gpt.py [--steps 20] [--nanogpt ../shared/bench/nanogpt] [--config.KEY=VALUE ...]

jdp: each XLA operation's thread time, classed by the innermost line of jdp's source it comes from (the HLO's
stack frames: `self.ln1(x)` is layer norm, `dot_product_attention` attention, ...) and by the operation (a dot
or a fused dot is a matmul); "backward" is what `jax.grad` added. nanoGPT: torch's self CPU time per aten
operation, the optimizer's and the gradient clipping's operations apart. Thread time is summed over threads: a
step that keeps both cores busy shows up to twice its wall time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import linecache
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASSES = ("matmul (linear layers, head)", "attention (scores, softmax, values)", "layer norm", "GELU",
           "cross-entropy", "embedding", "AdamW + clipping", "other (copies, the step's own sums)")


def _jdp_class(expression: str, function: str, is_dot: bool) -> str:
    if "dot_product_attention" in expression or "_explicit" in expression:
        return CLASSES[1]
    if function == "gelu":
        return CLASSES[3]
    if is_dot:
        return CLASSES[0]
    if re.search(r"\bln(1|2|_f)\b", expression):
        return CLASSES[2]
    if function == "language_model_loss":
        return CLASSES[4]
    if "wte[" in expression or "wpe" in expression or "take" in expression:
        return CLASSES[5]
    if function in ("Sync.update", "update", "clip_by_global_norm") or "tx.update" in expression:
        return CLASSES[6]
    return CLASSES[7]


def _frames(hlo: str) -> dict[int, tuple[str, str]]:
    """stack_frame_id -> (the innermost source expression, its function), from the HLO's location tables."""
    def table(name: str) -> str:
        return re.search(rf"^{name}\n(.*?)(?:\n\n|\n[A-Z][A-Za-z]+\n)", hlo, re.S | re.M).group(1)

    files = dict(re.findall(r'^(\d+) "(.*)"$', table("FileNames"), re.M))
    functions = dict(re.findall(r'^(\d+) "(.*)"$', table("FunctionNames"), re.M))
    locations = {}
    for fid, f, fn, line, end_line, col, end_col in re.findall(
            r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+) end_line=(\d+) column=(\d+) "
            r"end_column=(\d+)\}", table("FileLocations"), re.M):
        text = linecache.getline(files[f], int(line))
        expression = text[int(col):int(end_col)] if line == end_line else text.strip()
        locations[fid] = (expression, functions[fn])
    return {int(sid): locations[loc] for sid, loc in
            re.findall(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=\d+\}", table("StackFrames"), re.M)}


def xla_thread_time(trace: str, steps: int) -> collections.Counter[str]:
    """The thread time (ns per step) of each XLA operation in a `jax.profiler.trace` directory of `steps` steps."""
    import jax

    profile = jax.profiler.ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0])
    total: collections.Counter[str] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if line.name.startswith(("tf_XLAEigen", "tf_XLAPjRt")):
                for event in line.events:
                    if "ThunkExecutor" not in event.name:
                        total[event.name] += event.duration_ns / steps
    return total


def jdp_profile(overrides: list[str], steps: int) -> tuple[float, dict[str, float]]:
    """jdp's compiled step on one device: its wall time per step (ms) and the thread time (ms) per class."""
    import jax

    from jdp.cli.config import apply_overrides, load_config_file, parse_overrides
    from jdp.perf.measure import Variant

    cfg = apply_overrides(load_config_file(ROOT / "configs/shakespeare_char_cpu.py"), parse_overrides(overrides))
    variant = Variant(cfg, 1)
    wall = statistics.median(variant.time(steps) for _ in range(3)) * 1e3
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            for i in range(steps):
                variant.state, metrics = variant._step(variant.state, variant.batches[i % len(variant.batches)])
            jax.block_until_ready(metrics)
        times = xla_thread_time(trace, steps)
    hlo = variant._step.as_text()
    frames = _frames(hlo)
    ops = {m[1]: m for m in re.finditer(
        r"^\s*(?:ROOT )?%([\w.\-]+) = \S+ (\S+?)\(.*?metadata=\{op_name=\"([^\"]*)\"(?: stack_frame_id=(\d+))?", hlo,
        re.M)}
    classes: collections.Counter = collections.Counter()
    for name, ns in times.items():
        if (op := ops.get(name)) is None:
            continue
        expression, function = frames.get(int(op[4] or 0), ("", ""))
        is_dot = op[2] in ("dot", "convolution") or (op[2] == "fusion" and "dot_general" in op[3])
        part = "backward" if "transpose(" in op[3] else "forward"
        kind = _jdp_class(expression, function, is_dot)
        classes[(kind, part) if kind != CLASSES[6] else (kind, "")] += ns / 1e6
    return wall, dict(classes)


def _torch_class(name: str) -> str | None:
    for pattern, kind in ((r"::(mm|addmm|bmm|matmul)$", CLASSES[0]),
                          (r"scaled_dot_product|flash_attention", CLASSES[1]), (r"layer_norm", CLASSES[2]),
                          (r"gelu", CLASSES[3]),
                          (r"log_softmax|nll_loss|cross_entropy", CLASSES[4]), (r"embedding", CLASSES[5])):
        if re.search(pattern, name):
            return kind
    return None


def nanogpt_profile(source: Path, steps: int) -> tuple[float, dict[str, float]]:
    """nanoGPT's model and AdamW (`configure_optimizers`) with its clipping: wall ms per step, self CPU ms per class."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(source))
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    x, y = torch.randint(0, 65, (12, 64)), torch.randint(0, 65, (12, 64))

    def step() -> float:
        _, loss = model(x, y)
        loss.backward()
        with torch.profiler.record_function("AdamW + clipping"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(5):
        step()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        walls.append((time.perf_counter() - t0) / steps * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    classes: collections.Counter = collections.Counter()
    for event in prof.events():
        parent, in_optimizer, backward = event.cpu_parent, False, False
        while parent is not None:
            in_optimizer |= parent.name == "AdamW + clipping"
            backward |= parent.name.startswith("autograd::engine")
            parent = parent.cpu_parent
        kind = CLASSES[6] if in_optimizer else _torch_class(event.name)
        if kind is None or event.name.startswith("autograd::"):
            kind = CLASSES[7]
        part = "" if kind == CLASSES[6] else "backward" if backward or "backward" in event.name.lower() else "forward"
        classes[(kind, part)] += event.self_cpu_time_total / 1e3 / steps
    return statistics.median(walls), dict(classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nanogpt", type=Path, default=ROOT.parent / "shared/bench/nanogpt")
    args, overrides = parser.parse_known_args()
    jdp_wall, jdp = jdp_profile(overrides, args.steps)
    torch_wall, torch_classes = nanogpt_profile(args.nanogpt, args.steps)
    print(f"| op class | jdp fwd | jdp bwd | nanoGPT fwd | nanoGPT bwd |  (ms per step; wall: jdp {jdp_wall:.1f}, "
          f"nanoGPT {torch_wall:.1f}{'; ' + ' '.join(overrides) if overrides else ''})")
    print("|---|---:|---:|---:|---:|")
    for kind in CLASSES:
        cells = [f"{d.get((kind, part), 0.0):.1f}" for d in (jdp, torch_classes) for part in ("forward", "backward")]
        if kind == CLASSES[6]:
            cells = [f"{jdp.get((kind, ''), 0.0):.1f}", "", f"{torch_classes.get((kind, ''), 0.0):.1f}", ""]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print(f"| total thread time | {sum(jdp.values()):.1f} | | {sum(torch_classes.values()):.1f} | |")


if __name__ == "__main__":
    main()
