"""`python -m jdp.train`: jdp's command line, `jdp.cli.train`."""

import sys

from jdp import preemption

if __name__ == "__main__":
    preemption.exit_on_signal()  # a SIGTERM from here until training starts exits 75: safe to requeue
    from jdp.cli.train import main

    sys.exit(main())
