"""ResNet-18 on CIFAR-10 from a prepared tensorflow-datasets copy (`tfds build cifar10`).

The standard recipe: SGD with Nesterov momentum 0.9, lr 0.1 x batch/256 (0.2 at batch 512) after 5
warmup epochs, weight decay 5e-4, cosine schedule, 200 epochs, 4-pixel-padded random crops and flips;
reference accuracy ~95% (not measured here).
"""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "resnet18"
    c.model.kwargs.stem = "cifar"
    c.data.name = "tfds:cifar10"
    c.train.global_batch_size = 512
    c.train.steps = 200 * 50_000 // 512
    c.train.log_every = 100
    c.train.eval_every = 2000
    c.optim.name = "nesterov"
    c.optim.lr = 0.1
    c.optim.scale_lr_by_batch = True
    c.optim.weight_decay = 5e-4
    c.optim.warmup_steps = 5 * 50_000 // 512
    return c
