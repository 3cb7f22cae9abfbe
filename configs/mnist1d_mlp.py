"""An MLP (2 hidden layers of 256) on MNIST-1D."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "mlp"
    c.data.name = "mnist1d"
    return c
