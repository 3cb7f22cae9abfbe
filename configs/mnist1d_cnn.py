"""The default: the MNIST-1D paper's CNN (3 strided conv1d layers of 25 channels) on MNIST-1D."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "cnn1d"
    c.data.name = "mnist1d"
    c.train.steps = 6000
    c.train.eval_every = 1000
    c.optim.weight_decay = 0.1  # AdamW; without it the CNN overfits MNIST-1D's 4000 examples (~89%)
    return c
