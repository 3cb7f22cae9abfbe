"""Benchmark: conv3x3/32, conv3x3/64 (VALID), maxpool 2, dense 128, dense 10 on synthetic 28x28x1."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "cnn2d"
    c.model.kwargs.channels = (32, 64)
    c.model.kwargs.dense_sizes = (128,)
    c.data.name = "synthetic"
    c.data.shape = (28, 28, 1)
    c.data.num_classes = 10
    c.train.global_batch_size = 256
    c.train.steps = 100
    c.train.eval_every = 100
    c.optim.name = "sgd"
    c.optim.lr = 0.05
    return c
