"""nanoGPT's shakespeare_char recipe with its CPU overrides (its CPU figure: loss ~1.88 in ~3 min): 4 layers,
4 heads, width 128, block 64, batch 12, 2000 steps with the learning rate decaying over all of them, no
dropout; the same optimizer settings as configs/shakespeare_char.py. Evaluates every 250 steps on the
first 1024 validation windows (65,536 characters), and ends with a sample."""

from jdp.configs import shakespeare_char


def get_config():
    c = shakespeare_char.get_config()
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.embed_dim = 128
    c.model.dropout = 0.0
    c.data.block_size = 64
    c.data.eval_windows = 1024
    c.train.global_batch_size = 12
    c.train.eval_batch_size = 128
    c.train.steps = 2000
    c.train.eval_every = 250
    c.train.log_every = 50
    return c
