"""Measuring a config's data-parallel step and predicting it on devices not at hand (docs/layout.md). Each module
imports only those before it: scaling, validation, measure, fits, predict, bench (`python -m jdp.bench`'s shim).
"""
