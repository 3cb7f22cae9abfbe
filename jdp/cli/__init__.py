"""jdp's commands: `python -m jdp.train`, `jdp.sample`, `jdp.export`, `jdp.plot`, `jdp.launch` (each file:
docs/layout.md). The library never imports this package; `jdp.perf` and `jdp.compare` import it."""
