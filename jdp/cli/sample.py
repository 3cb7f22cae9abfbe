"""`python -m jdp.sample`: text from a language model's latest checkpoint, through a KV cache (docs/language_models.md,
"Sampling"); past the block, a full forward over the last `block_size` tokens (nanoGPT's crop)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.checkpoint import CheckpointError
from jdp.cli.config import ArgumentParser, ConfigError
from jdp.cli.resume import restore_for_inference
from jdp.data.text import VOCAB_FILE, Vocabulary
from jdp.errors import DiskError, UsageError

EXIT_OK, EXIT_USAGE, EXIT_DISK = 0, 2, 6


@jax.jit
def _pick(logits_V: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
          vocab_size: jax.Array) -> jax.Array:
    """A token drawn from softmax(logits / temperature) over the `top_k` largest logits of the first `vocab_size`
    ids (`data.num_classes` may pad the model's vocabulary with ids no symbol has)."""
    logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < vocab_size, logits_V.astype(jnp.float32), -jnp.inf)
    logits_V = (logits_V - logits_V.max()) / temperature  # at most 0: a tiny temperature cannot overflow to inf
    kth_largest = jnp.sort(logits_V)[logits_V.shape[0] - top_k]
    return jax.random.categorical(key, jnp.where(logits_V < kth_largest, -jnp.inf, logits_V))


class Sampler:
    """The compiled generation functions of a GPT in eval mode; `vocab_size`: the ids it may draw (None: all)."""

    def __init__(self, model: nnx.Module, vocab_size: int | None = None) -> None:
        graph, state = nnx.split(model)
        self.block_size, self.vocab_size, self._state = model.block_size, vocab_size, state

        def window_logits(state, window_1xT, length):
            return nnx.merge(graph, state)(window_1xT)[0, length - 1]

        def decode(state, tokens_1xT, position, cache, last):  # cache None: the prompt's, into an empty one
            model = nnx.merge(graph, state)
            logits, cache = model.decode(tokens_1xT, model.empty_cache(1) if cache is None else cache, position)
            return logits[0, last], cache

        self._window_logits, self._decode = jax.jit(window_logits), jax.jit(decode, donate_argnums=3)

    def generate(self, prompt: Sequence[int], num_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                 seed: int = 0, use_cache: bool = True) -> list[int]:
        """`num_tokens` new token ids after `prompt` (top_k 0 = every token)."""
        if not prompt:
            raise UsageError("the prompt is empty; give at least one character")
        if not 0 < temperature < math.inf:  # nan drew the same token every time
            raise UsageError(f"temperature={temperature} must be a positive finite number, e.g. 0.8")
        key, tokens, cache = jax.random.key(seed), [int(t) for t in prompt], None
        for i in range(num_tokens):
            if cache is not None and len(tokens) <= self.block_size:  # the last token's keys and values into the cache
                logits, cache = self._decode(self._state, jnp.full((1, 1), tokens[-1], jnp.int32),
                                             jnp.int32(len(tokens) - 1), cache, 0)
            else:  # the prompt, or a context longer than the block: the last block_size tokens, in full
                context = np.asarray(tokens[-self.block_size:], np.int32)  # then padded: causal, so unseen
                window = jnp.asarray(np.pad(context, (0, self.block_size - len(context)))[None])
                if use_cache and cache is None:
                    logits, cache = self._decode(self._state, window, 0, None, len(context) - 1)
                else:
                    logits = self._window_logits(self._state, window, len(context))
            vocab_size = min(self.vocab_size or logits.shape[0], logits.shape[0])
            k = jnp.int32(min(top_k, vocab_size) if top_k > 0 else vocab_size)
            tokens.append(int(_pick(logits, jax.random.fold_in(key, i), jnp.float32(temperature), k,
                                    jnp.int32(vocab_size))))
        return tokens[len(prompt):]


def sample_text(model: nnx.Module, vocab: Vocabulary, prompt: str, num_tokens: int, *, temperature: float,
                top_k: int, seed: int) -> str:
    """The prompt and `num_tokens` generated characters (or bytes) after it."""
    ids = vocab.encode(prompt, "the prompt").tolist()
    generated = Sampler(model, vocab.size).generate(ids, num_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return prompt + vocab.decode(generated)


def sample_workdir(workdir: Path, prompt: str, num_tokens: int, *, temperature: float, top_k: int,
                   seed: int) -> str:
    """A sample from the latest checkpoint of a `python -m jdp.train` run of a language model."""
    vocab_path = workdir / VOCAB_FILE
    if not (workdir / "config.json").exists() and (workdir / "run.json").exists():
        raise ConfigError(f"{workdir} is a jdp.fit run; python -m jdp.sample samples the language-model runs of "
                          "python -m jdp.train: restore the model with jdp.restore(workdir, model) and sample it "
                          "in Python (jdp.cli.sample.sample_text)")
    if not vocab_path.is_file():
        raise ConfigError(f"{vocab_path} not found; pass the --workdir of a language-model run (data.name text:PATH "
                          "or shakespeare)")
    vocab = Vocabulary.load(vocab_path)
    vocab.encode(prompt, "the prompt")  # an unknown character stops here, before anything is restored
    _, engine, state = restore_for_inference(workdir, reads_data=False)
    engine.source.close()
    model = engine.model.module(state.params, state.model_state, state.rng_state, train=False)
    if not hasattr(model, "decode"):
        raise ConfigError(f"{workdir} holds a {type(model).__name__}; sampling needs a language model (gpt)")
    return sample_text(model, vocab, prompt, num_tokens, temperature=temperature, top_k=top_k, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m jdp.sample", description="Generate text from a trained language model.")
    parser.add_argument("--workdir", required=True, help="a python -m jdp.train run of a language model")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--tokens", type=int, default=300, help="how many tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=200, help="draw from the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    try:
        args = parser.parse_args(argv)
        if args.tokens < 1 or args.top_k < 0 or not 0 <= args.seed < 2**32:  # a key takes 32 bits of the seed
            raise ConfigError("--tokens must be at least 1, --top_k at least 0 and --seed in [0, 4294967295]")
        text = sample_workdir(Path(args.workdir), args.prompt, args.tokens, temperature=args.temperature,
                              top_k=args.top_k, seed=args.seed)
    except (UsageError, CheckpointError, DiskError) as e:  # DiskError: a checkpoint unreadable but for its content
        print(f"jdp: {'disk' if isinstance(e, DiskError) else 'error'}: {e}", file=sys.stderr)
        return EXIT_DISK if isinstance(e, DiskError) else EXIT_USAGE
    print(text)
    return EXIT_OK

