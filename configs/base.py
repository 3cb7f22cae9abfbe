"""Every jdp default lives here; variants import this module and override a few fields."""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.name = "cnn1d"  # a built-in model (jdp.models.MODELS) or an import path package.module:Name
    c.model.kwargs = ml_collections.ConfigDict()  # the model's own settings, e.g. hidden_sizes for mlp
    c.model.bn_sync = True  # average every BatchNorm's statistics across devices

    c.task = ml_collections.ConfigDict()
    c.task.loss = "classification"  # a built-in loss (jdp.task.LOSSES) or an import path package.module:fn

    c.data = ml_collections.ConfigDict()
    c.data.name = "mnist1d"
    c.data.num_classes = 0  # 0 = from the data
    c.data.shape = (28, 28, 1)  # synthetic input shape
    c.data.num_examples = 4096  # synthetic train size
    c.data.num_eval_examples = 1024  # synthetic eval size
    c.data.normalize = True  # tfds: per-channel mean/std (CIFAR, ImageNet constants; else 0.5/0.5)
    c.data.data_dir = ""  # tfds: prepared datasets' directory; "" = tfds's default (~/tensorflow_datasets)
    c.data.train_split = "train"  # tfds: split or slice, e.g. "train[:90%]"
    c.data.eval_split = "test"  # tfds: e.g. "train[90%:]", "validation" (ImageNet)
    c.data.image_size = 224  # tfds, images taller than 64 px: train and eval resolution
    c.data.cache_decoded_mb = 4096  # tfds, images <= 64 px: keep decoded images in memory if the splits fit
    c.data.augment = True  # tfds train: pad-4 crop + flip (small images), random-resized crop + flip (large)

    c.train = ml_collections.ConfigDict()
    c.train.global_batch_size = 128
    c.train.eval_batch_size = 0  # 0 = train.global_batch_size
    c.train.steps = 3000
    c.train.log_every = 50
    c.train.eval_every = 500
    c.train.log_grad_norm = False  # add grad_norm to the train lines (costs a pass over the gradients)
    c.train.log_noise_scale = False  # add grad_noise_scale (the critical-batch estimate) to the train lines
    c.train.grad_accum_steps = 1  # micro-batches per step, all-reduced once (like DDP's no_sync)
    c.train.on_nonfinite = "halt"  # halt: save the state from before the bad step and exit 3 | skip the update

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # sgd | momentum | nesterov | adamw | lamb | lars
    c.optim.lr = 1e-2
    c.optim.momentum = 0.9  # momentum, nesterov, lars; b1 for adamw and lamb
    c.optim.weight_decay = 0.0  # masked off biases and normalisation parameters
    c.optim.schedule = "cosine"  # cosine | linear | constant, after linear warmup
    c.optim.warmup_steps = 0
    c.optim.grad_clip_norm = 0.0  # 0 = off; applied to the averaged gradient
    c.optim.scale_lr_by_batch = False  # lr = optim.lr * global_batch / 256

    c.parallel = ml_collections.ConfigDict()
    c.parallel.backend = "shard_map"  # shard_map | pmap | jit
    c.parallel.cpu_devices = 0  # >0: simulate this many CPU devices; 0 leaves JAX alone
    c.parallel.num_devices = 0  # 0 = all devices, else the first N
    c.parallel.allreduce_dtype = "fp32"  # fp32 | bf16: compress the gradient all-reduce
    c.parallel.shard_optimizer = False  # ZeRO-1: each device keeps and updates 1/N of the optimizer state
    c.parallel.sync_every = 1  # local SGD: >1 averages parameters every H steps instead of gradients every step
    c.parallel.allreduce_combine_threshold_bytes = 0  # XLA's all-reduce bucket size on GPU; 0 = XLA default
    c.parallel.latency_hiding_scheduler = True  # GPU: overlap the all-reduce with the backward pass
    c.parallel.check_replicas_every = 500  # compare the replicas' parameters every N steps (0 = at the end only)

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 1000  # also saved at the end and on preemption; 0 = only then
    c.checkpoint.keep = 3
    c.checkpoint.allow_config_change = False  # resume even if model/optimizer settings changed

    c.precision = "fp32"  # fp32 | bf16 (float32 masters) | fp16 (plus dynamic loss scaling)
    c.loss_scale = ml_collections.ConfigDict()
    c.loss_scale.initial = 2.0**15  # fp16 only
    c.loss_scale.growth_interval = 2000  # finite steps before the scale doubles

    c.code_dir = ""  # importable for import-path names; "" = the folder of the config file (set when it is loaded)

    c.init_from = ""  # start from a parameter file written by `python -m jdp.export`

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ""  # "A:B": a JAX profiler trace of steps A..B into WORKDIR/profile

    c.compile_cache_dir = "~/.cache/jdp/xla"  # persistent XLA compilation cache; "" = off

    c.distributed = ml_collections.ConfigDict()  # multi-process runs; see jdp/distributed.py
    c.distributed.init_timeout_s = 120.0  # all processes must join within this, else exit 5
    c.distributed.heartbeat_timeout_s = 60.0  # a peer silent this long stops the survivors
    return c
