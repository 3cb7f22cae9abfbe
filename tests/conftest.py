"""8 simulated CPU devices and one persistent compilation cache for the whole test run."""

import os
import tempfile

import jax

# Before any device is touched: every test sees 8 CPU devices.
jax.config.update("jax_num_cpu_devices", 8)

# Shared by this process and the training subprocesses the tests start (they inherit the env). The programs compile
# at XLA's default LLVM level, as users' do: --xla_backend_optimization_level=0 takes a quarter off a cold cache, but
# fuses floating-point ops otherwise, so two programs bit-for-bit equal in a run (DiLoCo, one-fragment Streaming
# DiLoCo) differ in the tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jdp-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
