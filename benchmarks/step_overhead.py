"""What jdp adds per step around the compiled program, on the MNIST-1D CNN (configs/mnist1d_cnn.py, global batch
256) on N devices (docs/benchmarks.md, "Fixed per-step costs"). Interleaved, medians of `--repeats`:

    python benchmarks/step_overhead.py --devices 1     (and --devices 2: simulated CPU devices)

- bare loop: a hand-written step of the same model and optimizer (`jax.jit`; on N devices `jax.shard_map` with a
  `lax.pmean` of the gradient), over batches already on the devices, nothing fetched: the host waits for step s-1
  before dispatching s+1, which bounds the queue of steps (unbounded, XLA:CPU's collectives on 2 simulated devices
  deadlock after some 30 steps);
- jdp's step: jdp's compiled train step (`DataParallel.train_step`) in the same bare loop, on host batches as the
  trainer gives it (`DataParallel.shard_batch`: the step's input sharding puts them on the devices);
- jdp's step, device batches: the same on batches put on the devices once (what a dataset kept on the devices
  would save: the per-step transfer); `device_put` each step: each host batch put on the devices just before its
  step, or one step ahead (while the previous step runs);
- + late fetch: and each step's metrics fetched to the host one step late, as the trainer does;
- jdp.fit: the whole trainer (batches read on the host and put on the devices, the callbacks, the progress bar),
  its steady-state examples/s (`FitResult.examples_per_sec`).

A repeat during which other processes used more than `--max_foreign` of the machine's CPU is thrown away and run
again (benchmarks/bench_input.py's ForeignLoad).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max_foreign", type=float, default=0.15)
    args = parser.parse_args()

    from jdp.mesh import simulate_cpu_devices

    simulate_cpu_devices(args.devices if args.devices > 1 else 0)
    import jax
    import optax
    from bench_input import ForeignLoad
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdp.trainer
    from jdp.cli.build import build_task
    from jdp.configs import mnist1d_cnn
    from jdp.mesh import DATA_AXIS, make_mesh
    from jdp.trainer import prepare

    cfg = mnist1d_cnn.get_config()
    cfg.train.global_batch_size, cfg.parallel.num_devices, cfg.compile_cache_dir = args.batch, args.devices, ""
    cfg.train.eval_every = 0  # the trainer's clock leaves evals out anyway
    task = build_task(cfg)
    host_batches = [task.source.train_batch(i) for i in range(8)]
    mesh = make_mesh(args.devices)

    # The bare loop.
    graphdef, params, rest = nnx.split(task.make_model(), nnx.Param, ...)
    params = nnx.to_pure_dict(params)  # the optimizer's masks are over pure dicts
    tx = task.optimizer

    def bare_step(params, opt_state, batch):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        if args.devices > 1:
            value, grads = jax.lax.pmean((value, grads), DATA_AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if args.devices > 1:
        bare_step = jax.shard_map(bare_step, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)), out_specs=P(),
                                  check_vma=False)
    bare = jax.jit(bare_step, donate_argnums=(0, 1))
    split = NamedSharding(mesh, P(DATA_AXIS))
    bare_batches = [{k: jax.device_put(v, split) for k, v in b.items() if k in ("x", "y")} for b in host_batches]
    bare_state = [jax.device_put(params, NamedSharding(mesh, P())), None]
    bare_state[1] = jax.jit(tx.init)(bare_state[0])

    def run_bare(steps: int) -> None:
        p, o = bare_state
        pending = None
        for i in range(steps):
            p, o, loss = bare(p, o, bare_batches[i % len(bare_batches)])
            if pending is not None:
                pending.block_until_ready()
            pending = loss
        jax.block_until_ready(p)
        bare_state[:] = [p, o]

    # jdp's compiled step, in the same loop.
    engine = prepare(task.make_model, task.loss_fn, task.source, optimizer=tx, global_batch_size=args.batch,
                     options=task.options)
    parallel = engine.parallel
    jdp_batches = [parallel.shard_batch(b) for b in host_batches]
    device_batches = [{k: jax.device_put(v, split) for k, v in b.items()} for b in jdp_batches]
    jdp_state = [parallel.to_devices(engine.init_state())]

    def run_jdp_step(steps: int, fetch: bool, batches: list = jdp_batches, put: str = "") -> None:
        state, pending = jdp_state[0], None
        ahead = jax.device_put(batches[0], split) if put == "ahead" else None
        for i in range(steps):
            batch = batches[i % len(batches)]
            batch = ahead if put == "ahead" else jax.device_put(batch, split) if put else batch
            state, metrics = parallel.train_step(state, batch)
            if put == "ahead":
                ahead = jax.device_put(batches[(i + 1) % len(batches)], split)
            if pending is not None:
                parallel.fetch(pending) if fetch else jax.block_until_ready(pending)
            pending = metrics
        jax.block_until_ready(state)
        jdp_state[0] = state

    def run_fit(steps: int) -> float:
        return jdp.trainer.run(task.make_model, task.loss_fn, task.source, optimizer=tx, steps=steps,
                               global_batch_size=args.batch, options=task.options).examples_per_sec

    def timed(fn, *a) -> float:
        t0 = time.perf_counter()
        fn(*a)
        return args.batch * args.steps / (time.perf_counter() - t0)

    modes = {"bare loop": lambda: timed(run_bare, args.steps),
             "jdp's step": lambda: timed(run_jdp_step, args.steps, False),
             "jdp's step, device batches": lambda: timed(run_jdp_step, args.steps, False, device_batches),
             "jdp's step, device_put each step": lambda: timed(run_jdp_step, args.steps, False, jdp_batches, "now"),
             "jdp's step, device_put a step ahead": lambda: timed(run_jdp_step, args.steps, False, jdp_batches,
                                                                   "ahead"),
             "jdp's step + late fetch": lambda: timed(run_jdp_step, args.steps, True),
             "jdp.fit": lambda: run_fit(args.steps)}
    for mode in modes.values():  # compiled, warmed up
        mode()
    rates: dict[str, list[float]] = {name: [] for name in modes}
    load = ForeignLoad()
    while min(len(v) for v in rates.values()) < args.repeats:
        load.start()
        got = {name: mode() for name, mode in modes.items()}
        if (foreign := load.stop()) > args.max_foreign:
            print(f"  thrown away: other processes used {foreign:.0%} of the CPU", flush=True)
            continue
        for name, rate in got.items():
            rates[name].append(rate)
    base = statistics.median(rates["bare loop"])
    print(f"| {args.devices} device(s), MNIST-1D CNN, batch {args.batch} | examples/s | step (ms) | / bare loop |")
    print("|---|---:|---:|---:|")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:,.0f} | {args.batch / rate * 1e3:.3f} | {rate / base:.3f} |")


if __name__ == "__main__":
    main()
