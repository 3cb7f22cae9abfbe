"""jdp against PyTorch DistributedDataParallel: a PyTorch twin of each jdp model, weight transfer both ways,
step-by-step parity and a speed comparison. Needs the `compare` extra (`pip install -e ".[compare]"`, torch);
torch is imported only inside this package.

    python -m jdp.compare parity --config configs/mnist1d_mlp.py --workers 2 --steps 50
    python -m jdp.compare speed  --config configs/synthetic_mlp.py --workers 2
"""
