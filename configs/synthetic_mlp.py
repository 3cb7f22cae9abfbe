"""Benchmark: MLP 784-1024-1024-10 on synthetic 784-feature inputs, global batch 256."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "mlp"
    c.model.kwargs.hidden_sizes = (1024, 1024)
    c.data.name = "synthetic"
    c.data.shape = (784,)
    c.data.num_classes = 10
    c.train.global_batch_size = 256
    c.train.steps = 200
    c.train.eval_every = 200
    c.optim.name = "sgd"
    c.optim.lr = 0.05
    return c
