"""`python -m jdp.compare parity|speed --config configs/X.py --workers N [options] [--config.a.b=v ...]`

    parity  jdp and its PyTorch DDP twin from the same weights on the same batches: per-step loss and gradient-norm
            differences; the last line states the worst and the tolerance. Exit 0 within tolerance, 1 outside,
            2 usage, 3 a side failed.
    speed   examples/s, step time, time to first step and peak memory of jdp's backends and of DDP at the same
            global batch; interleaved repeats, medians and ratios vs DDP.

Reports (markdown, JSON, PNG) go to --workdir (default runs/compare-NAME); docs/compare.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

EXIT_OK, EXIT_OUTSIDE_TOLERANCE, EXIT_USAGE, EXIT_SIDE_FAILED = 0, 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    from jdp.cli.config import positive

    parser = argparse.ArgumentParser(prog="python -m jdp.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("parity", "speed"):
        p = sub.add_parser(name, allow_abbrev=False)
        p.add_argument("--config", help="a jdp config file (default: configs/mnist1d_cnn.py)")
        p.add_argument("--workers", type=positive(int), default=2,
                       help="devices on the jdp side, ranks on the DDP side")
        p.add_argument("--workdir", type=Path, help="default: runs/compare-NAME (speed: runs/compare-NAME-speed)")
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="cuda: real GPUs, NCCL and SyncBatchNorm kernels (not simulated CPU devices)")
        p.add_argument("--timeout", type=float, default=900, help="seconds allowed to each process")
        p.add_argument("--report_only", action="store_true",
                       help="report (parity: judge) the results already in --workdir again, without running anything")
    parity, speed = sub.choices["parity"], sub.choices["speed"]
    parity.add_argument("--steps", type=positive(int), default=50)
    parity.add_argument("--tolerance", type=float, help="relative, for every step's loss (default: by model and "
                        "optimizer, jdp/compare/parity.py TOLERANCES)")
    parity.add_argument("--grad_tolerance", type=float, help="relative, for every step's gradient norm")
    parity.add_argument("--step1_tolerance", type=float, help="relative, for step 1's loss and gradient norm")
    speed.add_argument("--steps", type=positive(int), help="steps per run (default: the config's train.steps)")
    speed.add_argument("--repeats", type=positive(int), default=3)
    speed.add_argument("--backends", type=lambda text: tuple(filter(None, text.split(","))),
                       default="shard_map,pmap,jit", help="comma-separated jdp backends")
    speed.add_argument("--torch_compile", action="store_true",
                       help="torch.compile the twin (with --config.precision=bf16 on cuda: bf16 autocast, nanoGPT's "
                            "recipe)")
    speed.add_argument("--torch_threads", type=positive(int), default=1,
                       help="torch threads per DDP rank (default 1: one rank per core, as DDP runs on a CPU)")
    speed.add_argument("--jdp_devices", type=positive(int),
                       help="simulated CPU devices of the jdp process (default: --workers); e.g. --workers 1 "
                            "--torch_threads 2 --jdp_devices 2 gives each side one process and two cores")
    speed.add_argument("--compile_cache", action="store_true",
                       help="keep jdp's persistent compilation cache (default: off, so compile time is cold)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from jdp.cli import config as config_lib
    from jdp.compare.procs import SideFailed

    argv = sys.argv[1:] if argv is None else argv
    args, rest = _parser().parse_known_args(argv)
    try:
        overrides = config_lib.parse_overrides(rest)
        path = Path(args.config) if args.config else config_lib.DEFAULT_CONFIG
        cfg = config_lib.apply_overrides(config_lib.load_config_file(path), overrides)
        config_lib.check_ranges(cfg)  # here, in one line, rather than in a side's traceback
        name = path.stem
        workdir = args.workdir or Path("runs") / f"compare-{name}{'-speed' if args.command == 'speed' else ''}"
        if args.command == "parity":
            from jdp.compare.parity import parity, report_workdir

            chosen = {"loss": args.tolerance, "grad_norm": args.grad_tolerance, "step1": args.step1_tolerance}
            tolerance = {k: v for k, v in chosen.items() if v is not None}
            result = report_workdir(workdir, tolerance) if args.report_only else parity(
                cfg, name=name, workers=args.workers, steps=args.steps, workdir=workdir, tolerance=tolerance,
                timeout_s=args.timeout, device=args.device)
            print(f"report: {workdir / 'parity.md'}")
            print(result.last_line())
            return EXIT_OK if result.passed else EXIT_OUTSIDE_TOLERANCE
        from jdp.compare import speed as speed_lib

        result = speed_lib.report_workdir(workdir) if args.report_only else speed_lib.speed(
            cfg, name=name, workers=args.workers, workdir=workdir, steps=args.steps, repeats=args.repeats,
            backends=args.backends, timeout_s=args.timeout, compile_cache=args.compile_cache, device=args.device,
            command="python -m jdp.compare " + shlex.join(argv), torch_compile=args.torch_compile,
            torch_threads=args.torch_threads, jdp_devices=args.jdp_devices)
        print(f"report: {workdir / 'speed.md'}")
        ddp = next(r for r in result["rows"] if r["run"] == "ddp")
        print("; ".join(f"{r['run']} {r['examples_per_sec']:,.0f} ex/s ({r['ratio_vs_ddp']:.2f}x)"
                        for r in result["rows"] if r is not ddp) + f"; ddp {ddp['examples_per_sec']:,.0f} ex/s")
        return EXIT_OK
    except (config_lib.ConfigError, ValueError, SideFailed) as e:
        print(f"jdp.compare: {e}", file=sys.stderr)
        return EXIT_SIDE_FAILED if isinstance(e, SideFailed) else EXIT_USAGE


if __name__ == "__main__":
    from jdp.metrics import console_may_close

    with console_may_close(quiet=True):  # `| head` ends it as any command's, without a BrokenPipeError traceback
        sys.exit(main())
