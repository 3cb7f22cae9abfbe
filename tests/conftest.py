"""8 simulated CPU devices and one persistent compilation cache for the whole test run."""

import os
import tempfile

import jax

from jdp.configs import base
from jdp.environment import apply_communication_flags
from jdp.mesh import simulate_cpu_devices

# Before any device is touched: every test sees 8 CPU devices, under the XLA flags a CLI run of the default config
# adds. XLA_FLAGS is part of the compilation cache's key: set once here, the tests and their training subprocesses
# share cache entries, and a test that runs the CLI in-process (which adds the flags) leaves the keys of the tests
# after it as they were. Without it a rerun of the suite missed a quarter of the cache.
apply_communication_flags(base.get_config().parallel)
simulate_cpu_devices(8)

# Shared by this process and the training subprocesses the tests start (they inherit the env). The programs compile
# at XLA's default LLVM level, as users' do: --xla_backend_optimization_level=0 takes a quarter off a cold cache, but
# fuses floating-point ops otherwise, so two programs bit-for-bit equal in a run (DiLoCo, one-fragment Streaming
# DiLoCo) differ in the tests.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jdp-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
