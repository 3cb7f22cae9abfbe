"""jdp against PyTorch DDP (docs/compare.md); needs the `compare` extra (torch), imported only inside this package."""
