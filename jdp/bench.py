"""`python -m jdp.bench`: the benchmark is `jdp.perf.bench` (`--predict`: `jdp.perf.predict`)."""

import sys

if __name__ == "__main__":
    from jdp.perf.bench import main

    sys.exit(main())
