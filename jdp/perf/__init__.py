"""Measuring a config's data-parallel step and predicting it on devices not at hand (docs/layout.md). Each module
imports only those named before it, jdp's library and `jdp.cli`: `scaling` (the alpha-beta model), `validation`
(the model against published results), `measure` (one step, compiled and timed), `fits`, `predict` (`--predict`) and
`bench` (`python -m jdp.bench`, which keeps that name through the shim jdp/bench.py).
"""
