"""jdp against PyTorch DDP (docs/compare.md): a PyTorch twin of each jdp model, weights both ways, step-by-step
parity and speed. Needs the `compare` extra (torch), which is imported only inside this package.
"""
