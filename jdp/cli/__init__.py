"""jdp's commands: `python -m jdp.train` (`train`: a config file -> `jdp.fit`, through `task` and `config`;
`resume`: what a train workdir holds), `jdp.sample`, `jdp.export`, `jdp.plot` and `jdp.launch`. The library
below never imports this package; the benchmark (`jdp.perf`) and the PyTorch comparison (`jdp.compare`) stand
above it."""
