"""`python -m jdp.bench`: the benchmark's command name, kept; the benchmark is jdp/perf/bench.py (`--predict`:
jdp/perf/predict.py). Its names stay importable from here."""

import sys

from jdp.perf.bench import (
    COMM_DOMINATES,
    PEAK_TFLOPS,
    _token_figures,
    main,
    peak_tflops_for,
    run_bench,
    to_markdown,
    warnings_for,
)
from jdp.perf.measure import Variant, _bytes_on_first_device

__all__ = ["COMM_DOMINATES", "PEAK_TFLOPS", "Variant", "_bytes_on_first_device", "_token_figures", "main",
           "peak_tflops_for", "run_bench", "to_markdown", "warnings_for"]

if __name__ == "__main__":
    sys.exit(main())
