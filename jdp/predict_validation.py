"""The scaling model against published results, under its old module name: jdp/perf/validation.py."""

from jdp.perf.validation import CASES, Published, predicted_efficiency, to_markdown, validate

__all__ = ["CASES", "Published", "predicted_efficiency", "to_markdown", "validate"]
