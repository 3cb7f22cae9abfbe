"""`python -m jdp.plot`: the command is `jdp.cli.plot`."""

import sys

if __name__ == "__main__":
    from jdp.cli.plot import main

    sys.exit(main())
