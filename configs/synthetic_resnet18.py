"""Benchmark: ResNet-18 (CIFAR stem, synced BatchNorm) on synthetic 32x32x3 images."""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "resnet18"
    c.data.name = "synthetic"
    c.data.shape = (32, 32, 3)
    c.data.num_classes = 10
    c.data.num_examples = 2048
    c.data.num_eval_examples = 512
    c.train.global_batch_size = 128
    c.train.steps = 50
    c.train.log_every = 10
    c.train.eval_every = 50
    c.optim.name = "momentum"
    c.optim.lr = 0.1
    c.optim.weight_decay = 5e-4
    return c
