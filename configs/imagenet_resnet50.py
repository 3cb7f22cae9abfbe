"""ResNet-50 v1.5 on ImageNet (ILSVRC2012) from a prepared tensorflow-datasets copy.

Goyal et al.'s recipe: momentum SGD, lr 0.1 x batch/256, 5 warmup epochs, weight decay 1e-4,
90 epochs; reference top-1 ~76-77% (not measured here). BatchNorm per device, as in that recipe (32 images
per GPU): synced BatchNorm would add 53 small, latency-bound all-reduces to every forward pass on several GPUs.
"""

from jdp.configs import base


def get_config():
    c = base.get_config()
    c.model.name = "resnet50"
    c.model.kwargs.stem = "imagenet"
    c.model.bn_sync = False  # per-device statistics (Goyal et al.); see the module docstring
    c.data.name = "tfds:imagenet2012"
    c.data.eval_split = "validation"  # imagenet2012 has train and validation (the test split has no labels)
    c.data.image_size = 224  # random-resized crops for training; centre 0.875 crop for eval
    c.train.global_batch_size = 1024
    c.train.steps = 90 * 1_281_167 // 1024
    c.train.log_every = 100
    c.train.eval_every = 5000
    c.optim.name = "momentum"
    c.optim.lr = 0.1
    c.optim.scale_lr_by_batch = True
    c.optim.weight_decay = 1e-4
    c.optim.warmup_steps = 5 * 1_281_167 // 1024
    return c
