import json
import os
import subprocess
import sys

from jdp.cli.plot import main


def _write_run(path, losses):
    path.mkdir()
    lines = [{"step": i + 1, "split": "train", "loss": loss, "accuracy": 0.5} for i, loss in enumerate(losses)]
    lines.append({"step": len(losses), "split": "eval", "loss": losses[-1], "accuracy": 0.6})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plot_overlays_runs_into_a_png(tmp_path):
    _write_run(tmp_path / "a", [2.0, 1.0, 0.5])
    _write_run(tmp_path / "b", [2.0, 1.5, 1.0])
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_of_a_missing_run_is_one_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_plot_refuses_an_out_it_cannot_write_and_runs_with_nothing_to_plot(tmp_path, capsys):
    """An unknown format and an unwritable place were tracebacks (exit 1); a run with no values an empty PNG."""
    _write_run(tmp_path / "a", [2.0, 1.0])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    cases = {(tmp_path / "a", tmp_path / "p.xyz"): "--out {out}: matplotlib writes no .xyz file; end it with one of ",
             (tmp_path / "a", tmp_path / "missing" / "p.png"):
                 "cannot write {out}: {out.parent} is not an existing folder; make it, or give another path",
             (tmp_path / "a", tmp_path):
                 "cannot write {out}: it is a folder; give a file path such as {out}/curves.png",
             (tmp_path / "empty", tmp_path / "p.png"): "no loss to plot in the metrics.jsonl of {run}; pass run "
                                                       "directories that have trained at least one logged step"}
    for (run, out), refusal in cases.items():
        assert main([str(run), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jdp.plot: {refusal.format(out=out, run=run)}") and err.count("\n") == 1, err
    assert not (tmp_path / "p.png").exists()


def test_plot_shows_the_outputs_of_a_users_loss(tmp_path):
    """A loss without accuracy: the panels are the loss and the loss function's own outputs."""
    from jdp.cli.plot import plot_runs

    run = tmp_path / "regression"
    run.mkdir()
    lines = [{"step": 1, "split": "train", "loss": 1.0, "abs_err": 0.8, "lr": 0.1},
             {"step": 1, "split": "eval", "loss": 0.9, "abs_err": 0.7}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    plot_runs([run], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_plot_whose_stdout_reader_is_gone_ends_quietly(tmp_path):
    """`python -m jdp.plot RUN | head -0`: its `wrote` line raised a BrokenPipeError traceback, exit 1. Now the plot
    is written and the command exits 0 with nothing on stderr, as a command whose output is cut by `head`; the same
    wrapper is around jdp.bench, jdp.compare, jdp.export and jdp.sample."""
    _write_run(tmp_path / "a", [2.0, 1.0])
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([sys.executable, "-m", "jdp.plot", str(tmp_path / "a"), "--out", str(tmp_path / "c.png")],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (0, "")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_plot_and_a_resume_keep_a_damaged_line_of_metrics_jsonl_as_it_is(tmp_path):
    """A line that is JSON but no record, or bytes that are not UTF-8, was an AttributeError or a
    UnicodeDecodeError traceback, in jdp.plot and in the resume that trims the file."""
    from jdp.metrics import _truncate_after

    _write_run(tmp_path / "a", [2.0, 1.0, 0.5])
    path = tmp_path / "a" / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"5\n" + b"\xff{\n" + b"".join(lines[1:]))
    assert main([str(tmp_path / "a"), "--out", str(tmp_path / "c.png")]) == 0
    assert [r["step"] for r in _truncate_after(path, 1)] == [1]
    assert path.read_bytes().splitlines()[1:3] == [b"5", b"\xff{"]  # kept as they were
