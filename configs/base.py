"""Every jdp default lives here, or for the training options (seed, precision, and the train, parallel,
checkpoint and loss_scale settings `jdp.fit` also takes) in their one definition, `jdp.options`; variants import
this module and override a few fields."""

import ml_collections

from jdp.options import CONFIG_KEYS


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.name = "cnn1d"  # a built-in model (jdp.models.MODELS) or an import path package.module:Name
    c.model.kwargs = ml_collections.ConfigDict()  # the model's own settings, e.g. hidden_sizes for mlp

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
    c.data.block_size = 64  # text: tokens a model sees (a training window is block_size + 1 tokens)
    c.data.tokenizer = "chars"  # text: chars (the text's own characters, nanoGPT's vocabulary) | bytes (256)
    c.data.eval_windows = 0  # text: evaluate on the first N non-overlapping validation windows; 0 = all of them

    c.train = ml_collections.ConfigDict()
    c.train.global_batch_size = 128
    c.train.steps = 3000

    c.optim = ml_collections.ConfigDict()
    c.optim.name = "adamw"  # sgd | momentum | nesterov | adamw | lamb | lars
    c.optim.lr = 1e-2
    c.optim.momentum = 0.9  # momentum, nesterov, lars; b1 for adamw and lamb
    c.optim.b2 = 0.999  # adamw, lamb
    c.optim.weight_decay = 0.0  # masked off biases and normalisation parameters
    c.optim.schedule = "cosine"  # cosine | linear | constant, after linear warmup
    c.optim.warmup_steps = 0
    c.optim.min_lr = 0.0  # where cosine and linear decay end
    c.optim.grad_clip_norm = 0.0  # 0 = off; applied to the averaged gradient
    c.optim.scale_lr_by_batch = False  # lr = optim.lr * global_batch / 256

    c.parallel = ml_collections.ConfigDict()
    c.parallel.cpu_devices = 0  # >0: simulate this many CPU devices; 0 leaves JAX alone
    c.parallel.allreduce_combine_threshold_bytes = 0  # XLA's all-reduce bucket size on GPU; 0 = XLA default
    c.parallel.latency_hiding_scheduler = True  # GPU: overlap the all-reduce with the backward pass
    c.parallel.sync_kwargs = ml_collections.ConfigDict()  # parallel.sync as an import path: its keyword arguments

    c.checkpoint = ml_collections.ConfigDict()

    c.sample = ml_collections.ConfigDict()  # language models: a sample printed at the end of python -m jdp.train
    c.sample.tokens = 0  # 0 = no sample
    c.sample.prompt = "\n"
    c.sample.temperature = 0.8
    c.sample.top_k = 200

    c.loss_scale = ml_collections.ConfigDict()

    c.code_dir = ""  # importable for import-path names; "" = the folder of the config file (set when it is loaded)

    c.init_from = ""  # start from a parameter file written by `python -m jdp.export`

    c.metrics = ml_collections.ConfigDict()  # trackers beside metrics.jsonl and TensorBoard (docs/trackers.md)
    c.metrics.loggers = ""  # comma-separated names of jdp.loggers.LOGGERS: "wandb", "mlflow", "wandb,mlflow"
    c.metrics.wandb_project = ""  # "" = WANDB_PROJECT, else W&B's default
    c.metrics.mlflow_tracking_uri = ""  # "" = MLFLOW_TRACKING_URI, else file:./mlruns (a store in the working dir)
    c.metrics.mlflow_experiment = ""  # "" = MLFLOW_EXPERIMENT_NAME, else MLflow's Default

    c.profile = ml_collections.ConfigDict()
    c.profile.steps = ""  # "A:B": a JAX profiler trace of steps A..B into WORKDIR/profile

    c.compile_cache_dir = "~/.cache/jdp/xla"  # persistent XLA compilation cache; "" = off

    c.distributed = ml_collections.ConfigDict()  # multi-process runs; see jdp/distributed.py
    c.distributed.init_timeout_s = 120.0  # all processes must join within this, else exit 5
    c.distributed.heartbeat_timeout_s = 60.0  # a peer silent this long stops the survivors
    # HOST:PORT process 0's coordinator listens on; "" = JAX_COORDINATOR_BIND_ADDRESS, else only the coordinator
    # address's host (MASTER_ADDR); every interface only when asked for: "0.0.0.0:PORT" or "[::]:PORT"
    c.distributed.bind_address = ""

    for key, option in CONFIG_KEYS.items():  # the training options, with their help and range in jdp.options
        *sections, name = key.split(".")
        section = c
        for part in sections:
            section = section[part]
        section[name] = option.config_value
    return c
