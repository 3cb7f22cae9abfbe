"""`python -m jdp.launch`: the command is `jdp.cli.launch`."""

import sys

if __name__ == "__main__":
    from jdp.cli.launch import main

    sys.exit(main())
