"""The scaling predictor's old module name, kept for its importers: the model is jdp/perf/scaling.py, the
command (`python -m jdp.bench --predict`) jdp/perf/predict.py."""

from jdp.perf.measure import one_device_step_s as measure_step_s
from jdp.perf.predict import gradient_bytes, main, parser, to_markdown
from jdp.perf.scaling import (
    ALLREDUCE_BYTES,
    BACKWARD_SHARE,
    DEFAULT_DEVICES,
    INTER_LINKS,
    INTRA_LINKS,
    Link,
    Topology,
    hierarchical_allreduce_s,
    predict,
    ring_allreduce_s,
    step_s,
)

__all__ = ["ALLREDUCE_BYTES", "BACKWARD_SHARE", "DEFAULT_DEVICES", "INTER_LINKS", "INTRA_LINKS", "Link", "Topology",
           "gradient_bytes", "hierarchical_allreduce_s", "main", "measure_step_s", "parser", "predict",
           "ring_allreduce_s", "step_s", "to_markdown"]
