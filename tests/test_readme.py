"""Every command block of the README and of docs/ is run by a test as printed, or marked as needing a GPU or a
cluster; every relative link of theirs, and every pointer of jdp's code into docs/, leads to a file (and heading) that
exists; the README stays a front door."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import NOT_RUN
from tests.test_end_to_end import check_finished_run

REPO = Path(__file__).resolve().parents[1]

# The pages whose commands the tests run: the README and every page of docs/ but the record of measurements, whose
# commands are the measurements' own (minutes to hours on named machines; benchmarks/README.md lists them).
# docs/compare_example/ holds reports, not pages.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MEASUREMENTS = {REPO / "docs" / "benchmarks.md"}
README_MAX_LINES = 250  # the README is the front door; the reference is in docs/

# The test that runs each command of the README and docs/ (by the start of the command as printed). The install
# and test commands are what .ci/run does.
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
    "python -m jdp.compare parity --config configs/mnist1d_mlp.py --workers 2 --steps 30 "
    "--config.parallel.sync=powersgd": "test_compare::test_parity_powersgd_against_ddps_hook",
    "WANDB_MODE=offline python -m jdp.train": "test_loggers::test_the_docs_tracker_command_runs",
    "python benchmarks/comm_pareto.py": "test_comm_pareto::test_the_pareto_harness_runs_and_writes_its_table_and_plot",
}


def command_blocks(page: Path) -> list[tuple[str, list[str]]]:
    """Each ```bash block of `page`: (its mark, or "" if the tests run it; its commands, `a && b` split)."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        mark = lines[i - 1] if i and lines[i - 1].startswith(NOT_RUN) else ""
        commands = [c.strip() for text in lines[i + 1:end] for c in text.split("#")[0].split("&&") if c.strip()]
        blocks.append((mark, commands))
    return blocks


def doc_command_blocks() -> list[tuple[str, str, list[str]]]:
    """(page, mark, commands) of every ```bash block of the README and docs/, the record of measurements aside."""
    return [(str(page.relative_to(REPO)), mark, commands) for page in PAGES if page not in MEASUREMENTS
            for mark, commands in command_blocks(page)]


def doc_command(prefix: str) -> list[str]:
    """The one command of the run blocks of the README and docs/ that is `prefix`, or else starts with it, as
    printed, split into arguments."""
    run = [c for _, mark, commands in doc_command_blocks() if not mark for c in commands]
    found = [c for c in run if c == prefix] or [c for c in run if c.startswith(prefix)]
    assert len(found) == 1, f"the run blocks of the README and docs/ hold {len(found)} commands starting with " \
                            f"{prefix!r}: {found}"
    return shlex.split(found[0])


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
    blocks = doc_command_blocks()
    assert len(blocks) >= 5
    assert {page for page, _, _ in blocks} >= {"README.md", "docs/performance.md", "docs/datasets.md"}
    for page, mark, commands in blocks:
        if mark:
            assert mark.startswith(NOT_RUN + "needs a GPU") or mark.startswith(NOT_RUN + "needs a cluster"), \
                f"{page}: {mark}"
            continue
        for command in commands:
            if command.startswith(("pip ", "pytest")):
                assert _run_by_ci(command), f"{page}: {command!r} is not what .ci/run runs"
                continue
            prefix = max((p for p in RUN_BY if command == p or command.startswith(p + " ")), key=len, default=None)
            assert prefix is not None, f"no test runs {page}'s {command!r}; add one to RUN_BY, or mark its block"
            module, name = RUN_BY[prefix].split("::")
            assert f"\ndef {name}(" in (REPO / "tests" / f"{module}.py").read_text(), RUN_BY[prefix]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _outside_code(page: Path) -> list[str]:
    """The lines of `page` outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _outside_code(page):
        if re.match(r"#{1,6} ", line):
            slug = _slug(line.lstrip("#"))
            n = sum(a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a) is not None for a in anchors)
            anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def test_every_relative_link_leads_somewhere():
    """Links between the README and docs/ (and into the repository) name files, and headings, that exist."""
    checked = 0
    for page in PAGES:
        for line in _outside_code(page):
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z]+:", target):
                    continue
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                assert file.exists(), f"{page.relative_to(REPO)}: the link {target!r} leads to no file"
                if anchor and file.suffix == ".md":
                    assert anchor in _anchors(file), f"{page.relative_to(REPO)}: {target!r} names no heading"
                checked += 1
    assert checked >= 20


def test_every_pointer_of_the_code_into_docs_leads_somewhere():
    """`docs/PAGE.md, "Heading"` in jdp's docstrings and comments: the page exists, and the quoted words start one of
    its headings or bold item labels (`- **Model** ...`); a pointer may wrap across lines."""
    labels = {page.name: [" ".join(re.sub(r"^(#{1,6} |- \*\*)", "", line).split())
                          for line in _outside_code(page) if re.match(r"#{1,6} |- \*\*", line)]
              for page in (REPO / "docs").glob("*.md")}
    checked = 0
    for module in (REPO / "jdp").rglob("*.py"):
        for page, heading in re.findall(r"docs/([\w-]+\.md)(?:,?\s*['\"]([^'\"]+)['\"])?", module.read_text()):
            where = f"{module.relative_to(REPO)}: docs/{page}"
            assert page in labels, f"{where} is no page"
            if heading:
                words = " ".join(heading.split())
                assert any(label.startswith(words) for label in labels[page]), f"{where} has no heading {words!r}"
                checked += 1
    assert checked >= 10


def test_the_readme_is_a_front_door():
    """At most README_MAX_LINES lines, and every page of docs/ linked from it."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, \
        f"the README has {len(readme.splitlines())} lines, over {README_MAX_LINES}: move reference text to docs/"
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, f"the README's Documentation does not link docs/{page.name}"


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    assert args[0] == "python"
    out = subprocess.run([sys.executable, *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=360)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _files(workdir: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*")
            if p.is_file()}


@pytest.mark.timeout(500)
@pytest.mark.slow
def test_the_quick_start_then_the_device_example(tmp_path):
    """The quick start trains the default config to the MNIST-1D paper's accuracy in runs/mnist1d_cnn; the
    README's device example, run next in the same directory, trains in a workdir of its own on 4 devices and
    leaves the finished quick-start run untouched."""
    _run(doc_command("python -m jdp.train"), tmp_path)
    check_finished_run(tmp_path / "runs" / "mnist1d_cnn", "mnist1d_cnn")
    before = _files(tmp_path / "runs" / "mnist1d_cnn")

    example = doc_command("python -m jdp.train --cpu_devices 8")
    _run(example, tmp_path)
    assert _files(tmp_path / "runs" / "mnist1d_cnn") == before
    workdir = tmp_path / example[example.index("--workdir") + 1]
    assert len(json.loads((workdir / "run.json").read_text())["devices"]) == 4
    summary = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["split"] == "summary" and summary["eval_accuracy"] > 0.5


@pytest.mark.slow
def test_the_running_example(tmp_path):
    """The "Running" template with NAME a shipped config, from a directory holding the configs folder."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    template = doc_command("python -m jdp.train --config configs/NAME.py")
    command = [arg.replace("NAME", "digits_mlp") for arg in template]
    _run(command, tmp_path)
    summary = json.loads((tmp_path / "runs" / "digits_mlp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["split"] == "summary" and summary["eval_accuracy"] > 0.9
