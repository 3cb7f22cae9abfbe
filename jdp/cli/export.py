"""`python -m jdp.export --workdir W --out params.npz`: the latest parameters and BatchNorm statistics of a
`python -m jdp.train` run, or of a `jdp.fit` run whose model is importable, as an .npz of `params/<module path>/<name>`,
`model_state/...` and `step` (docs/checkpoints.md) that `--config.init_from=params.npz` starts a run from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jdp import reopen
from jdp.checkpoint import CheckpointError
from jdp.cli import config as config_lib
from jdp.cli.resume import restore_for_inference
from jdp.errors import DiskError, FitError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jdp.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    try:
        out = reopen.params_file_path(args.out)  # before anything is restored
        if (args.workdir / "config.json").exists():  # a python -m jdp.train run: rebuilt from its config
            step, built, state = restore_for_inference(args.workdir, reads_data=False)
            built.source.close()
            host = built.parallel.to_host(state)  # RNG streams are left out: they are not weights
            reopen.write_params_file(out, host.params, host.model_state, step)
        else:  # a jdp.fit run whose record names an importable model
            step, _ = reopen.export_params(args.workdir, out)
    except (config_lib.ConfigError, CheckpointError, FitError, DiskError) as e:
        print(f"jdp.export: {e}", file=sys.stderr)
        return 6 if isinstance(e, DiskError) else 2
    print(f"wrote {out}: the parameters and model state of step {step} of {args.workdir}")
    return 0
