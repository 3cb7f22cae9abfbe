"""The redesign's figures of a checkout: lines in jdp/ (and how many of them are code, docstrings, comments and
blank) and in its core (split, step, gradient, sync strategies, update, loss, model state, backends), the length of
`train_step` and of the longest function, the README's length, and the lines outside jdp/sync/ that name a sync
strategy's class or one of the strategy flags (the Option rows of jdp/options.py aside).

    python benchmarks/house_figures.py [CHECKOUT]      (default: this one)
"""

import ast
import re
import sys
from pathlib import Path

STRATEGY_NAMES = re.compile(r"\b(AllReduce|ZeRO1|ZeRO3|LocalSGD|DiLoCo|PowerSGD|QuantizedAllReduce|HybridShard|"
                            r"ShardedOptimizer|FullySharded|shard_group|"
                            r"shard_optimizer|shard_params|sync_every|allreduce_dtype|powersgd_rank|"
                            r"powersgd_start_step|outer_optimizer|outer_lr|outer_momentum)\b")
CORE = {"mesh.py", "step.py", "gradients.py", "update.py", "loss.py", "modeldef.py", "parallel.py", "zero.py"}


def main(root: Path) -> None:
    files = [p for p in (root / "jdp").rglob("*.py") if "configs" not in p.relative_to(root).parts]
    texts = {p: p.read_text() for p in files}
    trees = {p: ast.parse(text) for p, text in texts.items()}
    lines = {p: len(text.splitlines()) for p, text in texts.items()}
    core = sum(n for p, n in lines.items()
               if p.parent == root / "jdp" and p.name in CORE or p.parent == root / "jdp" / "sync")
    functions = [(node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.name}", node.name)
                 for p, tree in trees.items() for node in ast.walk(tree)
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    train_step = next(n for n, where, name in functions if name == "train_step" and "step.py" in where)
    longest = max(functions)
    print(f"jdp/: {sum(lines.values())} lines ({kinds_of_lines(texts, trees)}); core: {core}; train_step: {train_step} "
          f"lines; longest function: {longest[1]}, {longest[0]} lines; "
          f"README: {len((root / 'README.md').read_text().splitlines())} lines; "
          f"lines naming a strategy or its flags outside jdp/sync/: {strategy_mentions(root, texts)}")


def kinds_of_lines(texts: dict[Path, str], trees: dict[Path, ast.Module]) -> str:
    """How many of the files' lines are code, docstrings, comments and blank."""
    counts = dict.fromkeys(("code", "docstrings", "comments", "blank"), 0)
    for path, text in texts.items():
        docstrings = {line for node in ast.walk(trees[path])
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                      and (doc := node.body[:1]) and isinstance(doc[0], ast.Expr)
                      and isinstance(doc[0].value, ast.Constant) and isinstance(doc[0].value.value, str)
                      for line in range(doc[0].lineno, doc[0].end_lineno + 1)}
        for number, line in enumerate(text.splitlines(), 1):
            kind = ("blank" if not line.strip() else "docstrings" if number in docstrings
                    else "comments" if line.lstrip().startswith("#") else "code")
            counts[kind] += 1
    return ", ".join(f"{kind} {n}" for kind, n in counts.items())


def strategy_mentions(root: Path, texts: dict[Path, str]) -> int:
    count = 0
    for path, text in texts.items():
        if (root / "jdp" / "sync") in path.parents:
            continue
        if path.name == "options.py" and path.parent == root / "jdp" and "OPTIONS: tuple" in text:
            start = text.index("OPTIONS: tuple")
            text = text[:start] + text[text.index("\nBY_NAME", start):]  # the Option rows
        count += sum(bool(STRATEGY_NAMES.search(line)) for line in text.splitlines())
    return count


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
