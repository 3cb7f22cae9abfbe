"""GPT-2 medium's shapes (355M parameters: 24 layers, 16 heads, width 1024), otherwise configs/gpt2_small.py:
block 1024, vocabulary 50,257, ZeRO-3 on scanned, rematerialised blocks. Its parameters, gradients and AdamW state
(16 bytes a parameter) take 5,414 MB on every device under plain data parallelism, 677 MB on each of 8 with
`parallel.shard_params`; the compiled step needs 1,872 MB a device in all, against 10,713 MB for the plain unrolled
model (`python -m jdp.bench --config configs/gpt2_medium.py --compile_only --devices 8`; docs/benchmarks.md,
"Making a model fit")."""

from jdp.configs import gpt2_small


def get_config():
    c = gpt2_small.get_config()
    c.model.num_layers = 24
    c.model.num_heads = 16
    c.model.embed_dim = 1024
    c.optim.lr = 3e-4
    c.optim.min_lr = 3e-5
    return c
