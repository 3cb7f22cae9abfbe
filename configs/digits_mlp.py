"""An MLP on scikit-learn's 8x8 handwritten digits (1437 train / 360 test, fixed stratified split)."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "mlp"
    c.model.kwargs.hidden_sizes = (128,)
    c.data.name = "digits"
    c.train.global_batch_size = 64
    c.train.steps = 1000
    c.train.eval_every = 250
    c.optim.lr = 3e-3
    return c
