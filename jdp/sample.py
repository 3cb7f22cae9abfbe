"""`python -m jdp.sample`: the command is `jdp.cli.sample`."""

import sys

if __name__ == "__main__":
    from jdp.cli.sample import main

    sys.exit(main())
