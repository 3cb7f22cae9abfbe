"""Every command block of the README is run by a test as printed, or marked as needing a GPU or a cluster."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import NOT_RUN, readme_command, readme_command_blocks
from tests.test_end_to_end import check_finished_run

REPO = Path(__file__).resolve().parents[1]

# The test that runs each of the README's commands (by the start of the command as printed). The install and
# test commands are what .ci/run does.
RUN_BY = {
    "python -m jdp.train": "test_readme::test_the_quick_start_then_the_device_example",
    "python -m jdp.train --cpu_devices 8": "test_readme::test_the_quick_start_then_the_device_example",
    "python -m jdp.train --config configs/NAME.py": "test_readme::test_the_running_example",
    "python -m jdp.compare parity": "test_compare::test_parity_mlp_cli",
    "python -m jdp.compare speed": "test_compare::test_speed_cli",
    "python -m jdp.bench --predict": "test_predict::test_readme_prediction_commands_run_as_printed",
    **dict.fromkeys(("python -m jdp.train --config configs/shakespeare_char_cpu.py", "python -m jdp.sample"),
                    "test_lm::test_the_readme_language_model_commands_run"),
    "python -m jdp.compare parity --config configs/shakespeare_char_cpu.py": "test_compare::test_parity_gpt",
}


def _ci_commands() -> list[list[str]]:
    return [shlex.split(line) for line in (REPO / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def _run_by_ci(command: str) -> bool:
    """`pip install SPEC` when CI installs SPEC (`.` is covered by `.[extras]`); `pytest` when CI runs it."""
    args = shlex.split(command)
    if args == ["pytest"]:
        return ["python", "-m", "pytest"] in _ci_commands()
    installed = [c[-1] for c in _ci_commands() if c[:4] == ["python", "-m", "pip", "install"]]
    return args[:2] == ["pip", "install"] and any(spec == args[-1] or spec.startswith(args[-1] + "[")
                                                  for spec in installed)


def test_every_command_block_is_run_or_marked():
    blocks = readme_command_blocks()
    assert len(blocks) >= 5
    for mark, commands in blocks:
        if mark:
            assert mark.startswith(NOT_RUN + "needs a GPU") or mark.startswith(NOT_RUN + "needs a cluster"), mark
            continue
        for command in commands:
            if command.startswith(("pip ", "pytest")):
                assert _run_by_ci(command), f"{command!r} is not what .ci/run runs"
                continue
            prefix = max((p for p in RUN_BY if command == p or command.startswith(p + " ")), key=len, default=None)
            assert prefix is not None, f"no test runs the README's {command!r}; add one to RUN_BY, or mark its block"
            module, name = RUN_BY[prefix].split("::")
            assert f"\ndef {name}(" in (REPO / "tests" / f"{module}.py").read_text(), RUN_BY[prefix]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert args[0] == "python"
    out = subprocess.run([sys.executable, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _files(workdir: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*")
            if p.is_file()}


@pytest.mark.timeout(500)
def test_the_quick_start_then_the_device_example(tmp_path):
    """The quick start trains the default config to the MNIST-1D paper's accuracy in runs/mnist1d_cnn; the
    README's device example, run next in the same directory, trains in a workdir of its own on 4 devices and
    leaves the finished quick-start run untouched."""
    _run(readme_command("python -m jdp.train"), tmp_path)
    check_finished_run(tmp_path / "runs" / "mnist1d_cnn", "mnist1d_cnn")
    before = _files(tmp_path / "runs" / "mnist1d_cnn")

    example = readme_command("python -m jdp.train --cpu_devices 8")
    _run(example, tmp_path)
    assert _files(tmp_path / "runs" / "mnist1d_cnn") == before
    workdir = tmp_path / example[example.index("--workdir") + 1]
    assert len(json.loads((workdir / "run.json").read_text())["devices"]) == 4
    summary = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["split"] == "summary" and summary["eval_accuracy"] > 0.5


def test_the_running_example(tmp_path):
    """The "Running" template with NAME a shipped config, from a directory holding the configs folder."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    template = readme_command("python -m jdp.train --config configs/NAME.py")
    command = [arg.replace("NAME", "digits_mlp") for arg in template]
    _run(command, tmp_path)
    summary = json.loads((tmp_path / "runs" / "digits_mlp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["split"] == "summary" and summary["eval_accuracy"] > 0.9
