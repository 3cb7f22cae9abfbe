"""`python -m jdp.train`: jdp's command line, `jdp.cli.train`."""

import sys

from jdp import preemption

if __name__ == "__main__":
    preemption.exit_on_signal()  # a SIGTERM from here until training starts exits 75: safe to requeue
    from jdp.environment import BadEnvironment, check_environment

    try:
        check_environment()  # before JAX is imported: it parses its JAX_* variables then, and fails in a traceback
    except BadEnvironment as e:
        print(f"jdp: error: {e}", file=sys.stderr)
        sys.exit(2)
    from jdp.cli.train import main

    raise SystemExit(main())
