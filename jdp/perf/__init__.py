"""Performance: measuring a config's data-parallel step, and predicting it on devices not at hand.

- `measure`: one configuration's step, built, compiled and timed (`Variant`);
- `bench`: `python -m jdp.bench`, where a step's time goes, across device counts (uses `measure`);
- `scaling`: the alpha-beta model of the gradient all-reduce and of a step's time and efficiency;
- `validation`: `scaling` against published scaling results (uses `scaling`);
- `predict`: `python -m jdp.bench --predict`, a config's predicted scaling (uses `scaling`, `validation`,
  `measure`).

Each imports only the modules named before it, jdp's library and the CLI's config layer (`jdp.cli`).
`python -m jdp.bench` keeps the command's name through the shim jdp/bench.py.
"""
