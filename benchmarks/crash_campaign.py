"""Crash campaign: SIGKILL `python -m jdp.train` at seeded random moments, rerun it, and compare the result bitwise
with an uninterrupted run.

About a third of the kills land in the middle of a checkpoint write (`JDP_KILL_AT=save:STEP`, `jdp.faults`); the
others are sent from outside at a random moment of the run's life (start-up, restore, training, eval, saves,
summary). After each kill the same command is rerun (with `--kills_per_run K`, the first K-1 reruns are killed
again), and the run survived when the last rerun finishes and its per-step losses, eval lines and final state (the
leaf digests of its last checkpoint) equal the uninterrupted run's, with no step missing or repeated and one
summary line.

Then the finished uninterrupted run's last checkpoint is tampered with, one way per case, as files are on disk:
copied from the previous checkpoint's files, renamed to a later step, and one flipped bit in its metadata
(`data/metadata`: a shape, a dtype, the format, the fingerprint of the run's settings that the resume guard
compares). Each copy is rerun, and survives when the rerun exits 0, names the checkpoint, moves it to
WORKDIR/rejected and trains the lost steps again to the same outcome as above.

    python benchmarks/crash_campaign.py --kills 45 --seed 0

Prints one line per run and per tampered checkpoint, then `survived N / tried M` (kills) and `tampered: survived N
/ tried M`; exits 1 unless every kill and every tampered checkpoint was survived.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMEOUT_S = 300  # any single run


def command(workdir: Path, steps: int) -> list[str]:
    every = max(1, steps // 6)
    return [sys.executable, "-m", "jdp.train", "--workdir", str(workdir), "--config", "mnist1d_mlp",
            "--config.model.kwargs.hidden_sizes=(32,)", f"--config.train.steps={steps}", "--config.train.log_every=1",
            f"--config.train.eval_every={2 * every}", f"--config.checkpoint.every_steps={every}"]


def outcome(workdir: Path) -> dict:
    """What must be bitwise equal: train and eval lines (without wall times), summary count, final digests."""
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    drop = ("wall_time", "examples_per_sec")
    final = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    data = json.loads((workdir / "checkpoints" / str(final) / "data" / "metadata").read_text())
    return {"train": [{k: v for k, v in r.items() if k not in drop} for r in lines if r["split"] == "train"],
            "eval": [{k: v for k, v in r.items() if k not in drop} for r in lines if r["split"] == "eval"],
            "summaries": sum(r["split"] == "summary" for r in lines), "final_step": final,
            "digests": data["digests"]}


def _flip_metadata(checkpoint: Path, pattern: str, flip) -> None:
    """Rewrites the first match of `pattern` in the checkpoint's data/metadata through `flip`, byte for byte
    otherwise, as a flipped bit on disk leaves it."""
    path = checkpoint / "data" / "metadata"
    text = path.read_text()
    match = re.search(pattern, text)
    assert match, f"{pattern} not in {path}"
    path.write_text(text[:match.start()] + flip(match[0]) + text[match.end():])


def _copied(checkpoints: Path, last: int, previous: int) -> str:
    shutil.rmtree(checkpoints / str(last))
    shutil.copytree(checkpoints / str(previous), checkpoints / str(last))
    return str(last)


def _renamed(checkpoints: Path, last: int, previous: int) -> str:  # a later step than the run reaches: 12 -> 99
    (checkpoints / str(last)).rename(checkpoints / str(last * 8 + 3))
    return str(last * 8 + 3)


def _shape(checkpoints: Path, last: int, previous: int) -> str:  # [40, 32] -> [41, 32]: the low bit of a size
    _flip_metadata(checkpoints / str(last), r'"float32", \[\d+', lambda m: re.sub(
        r"\d+$", lambda n: str(int(n[0]) ^ 1), m))
    return str(last)


def _dtype(checkpoints: Path, last: int, previous: int) -> str:
    _flip_metadata(checkpoints / str(last), r'"float32"', lambda m: '"float16"')
    return str(last)


def _format(checkpoints: Path, last: int, previous: int) -> str:  # 2 -> 3: one bit
    _flip_metadata(checkpoints / str(last), r'"format": \d+', lambda m: m[:-1] + str(int(m[-1]) ^ 1))
    return str(last)


def _fingerprint(checkpoints: Path, last: int, previous: int) -> str:  # the run's settings' hash: one bit
    _flip_metadata(checkpoints / str(last), r'"fit": "[0-9a-f]', lambda m: m[:-1] + format(int(m[-1], 16) ^ 1, "x"))
    return str(last)


# Each tampers with the last checkpoint of a finished run and returns the name it is found under.
TAMPERS = {"copied": _copied, "renamed": _renamed, "shape": _shape, "dtype": _dtype, "format": _format,
           "fingerprint": _fingerprint}


def tampered(root: Path, steps: int, env: dict[str, str], expected: dict, names: list[str]) -> int:
    """Reruns a copy of the finished reference run per tamper in `names`; returns how many survived."""
    every = max(1, steps // 6)
    last = steps // every * every
    survived = 0
    for name in names:
        workdir = root / f"tampered-{name}"
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.copytree(root / "reference", workdir)
        found = TAMPERS[name](workdir / "checkpoints", last, last - every)
        code = run(workdir, steps, env)
        ok = code == 0 and (workdir / "rejected" / found).is_dir() and outcome(workdir) == expected
        survived += ok
        print(f"tampered checkpoint {found} ({name}): {'survived' if ok else f'FAILED (exit code {code})'}",
              flush=True)
        if ok:
            shutil.rmtree(workdir)
    return survived


def run(workdir: Path, steps: int, env: dict[str, str], kill_after_s: float | None = None) -> int:
    """Runs the command to its end, or SIGKILLs it `kill_after_s` seconds after it started. Returns its code."""
    proc = subprocess.Popen(command(workdir, steps), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        if kill_after_s is not None:
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode not in (0, -signal.SIGKILL):
        print(err[-2000:], file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=45)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60, help="steps of each run (a checkpoint every steps/6)")
    parser.add_argument("--kills_per_run", type=int, default=1,
                        help="kill each run this many times (every rerun but the last) before comparing it")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--tampers", default=",".join(TAMPERS),
                        help=f"tampered-checkpoint cases to run, comma-separated, or none ({', '.join(TAMPERS)})")
    args = parser.parse_args(argv)
    tampers = [] if args.tampers == "none" else args.tampers.split(",")
    if unknown := [t for t in tampers if t not in TAMPERS]:
        parser.error(f"--tampers: unknown case {unknown[0]!r}; choose from {', '.join(TAMPERS)}, or none")
    rng = random.Random(args.seed)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="jdp-crash-"))
    env = {k: v for k, v in os.environ.items() if k != "JDP_KILL_AT"}
    env.update(JAX_NUM_CPU_DEVICES=str(args.devices), JAX_PLATFORMS="cpu")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "xla-cache"))

    t0 = time.monotonic()
    if run(root / "reference", args.steps, env) != 0:
        print("the uninterrupted run failed", file=sys.stderr)
        return 1
    lifetime = time.monotonic() - t0
    expected = outcome(root / "reference")
    every = max(1, args.steps // 6)
    saves = list(range(every, args.steps + 1, every))

    survived = tried = trial = 0
    while tried < args.kills:
        workdir, trial = root / f"run{trial}", trial + 1
        shutil.rmtree(workdir, ignore_errors=True)
        landed = []  # the kills of this run: each rerun but the last is killed again
        while len(landed) < min(args.kills_per_run, args.kills - tried):
            if rng.random() < 1 / 3:
                step = rng.choice(saves)
                how = f"during the save of step {step}"
                code = run(workdir, args.steps, {**env, "JDP_KILL_AT": f"save:{step}"})
            else:
                delay = rng.uniform(0.0, lifetime)
                how, code = f"{delay:.2f} s after the start", run(workdir, args.steps, env, kill_after_s=delay)
            if code != -signal.SIGKILL:  # it finished (or failed) before the kill
                break
            landed.append(how)
        if not landed:
            continue
        tried += len(landed)
        code = run(workdir, args.steps, env)
        ok = code == 0 and outcome(workdir) == expected
        survived += len(landed) if ok else 0
        print(f"run {trial}, killed {'; '.join(landed)}: {'survived' if ok else f'FAILED (exit code {code})'}",
              flush=True)
        if ok and args.workdir is None:
            shutil.rmtree(workdir)
    print(f"survived {survived} / tried {tried}")
    intact = tampered(root, args.steps, env, expected, tampers)
    if tampers:
        print(f"tampered: survived {intact} / tried {len(tampers)}")
    ok = survived == tried and intact == len(tampers)
    if args.workdir is None and ok:
        shutil.rmtree(root)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
