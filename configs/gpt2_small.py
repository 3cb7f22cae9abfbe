"""GPT-2 small's shapes (124M parameters: 12 layers, 12 heads, width 768, block 1024, vocabulary 50,257, biases,
the embedding tied to the output) on any text source, made to fit: ZeRO-3 (`parallel.shard_params`), each of 8
devices keeping 1/8 of the parameters, gradients and AdamW state, on scanned blocks gathered one at a time
(`model.scan_layers`) whose activations are recomputed in the backward (`model.remat=full`). The text's own tokens
fill the first ids of the 50,257-token vocabulary (`data.num_classes`), so the model has GPT-2's size on the
offline plays; a tokenizer's ids go in through the same field. Its memory per device on 8 devices, plain, ZeRO-1 and
ZeRO-3, each for every remat setting: `python -m jdp.bench --config configs/gpt2_small.py --compile_only --devices 8`
(docs/benchmarks.md, "Making a model fit": 1,061 MB a device against 4,524 MB for the plain unrolled model)."""

from jdp.configs import shakespeare_char


def get_config():
    c = shakespeare_char.get_config()
    c.model.num_layers = 12
    c.model.num_heads = 12
    c.model.embed_dim = 768
    c.model.dropout = 0.0
    c.model.scan_layers = True
    c.model.remat = "full"
    c.model.scan_layers = True
    c.model.remat = "full"
    c.model.bias = True  # GPT-2's
    c.data.num_classes = 50257
    c.data.block_size = 1024
    c.data.eval_windows = 64
    c.train.global_batch_size = 8  # one sequence per device on 8
    c.train.eval_batch_size = 8
    c.optim.lr = 6e-4  # GPT-2 small in nanoGPT's train_gpt2 recipe
    c.optim.min_lr = 6e-5
    c.optim.b2 = 0.95
    c.optim.warmup_steps = 200
    c.parallel.shard_params = True
    c.sample.tokens = 0
    return c
