"""The two downstream tasks llmtrain ships, built from the Python standard library (text every machine has).

* ``stdlib_mc`` (multiple choice): a function's signature as it opens its docstring, ``def name(args):`` then
  an indented triple quote, and four candidate first lines of a docstring: the function's own and three drawn
  from other functions. Scored by lm-eval's ``multiple_choice`` (``acc``, ``acc_norm``).
* ``stdlib_ppl`` (rolling perplexity): the first ~1000 characters of standard-library modules, scored by
  ``loglikelihood_rolling`` (``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``).

Both come from the modules of a fixed list of standard-library *packages* (``email/``, ``json/`` ...), never
from the top-level ``*.py`` files the demo trains on (:func:`llmtrain.demo.stdlib_sources`), so the demo's
scores are on held-out text. Items are chosen deterministically (sorted files, a seeded ``random.Random``).

The files in ``configs/eval/`` (``stdlib_mc.yaml`` + ``stdlib_mc.jsonl``, ``stdlib_ppl.yaml`` +
``stdlib_ppl.jsonl``, ~150 KB) were written by ``python -m llmtrain.eval.stdlib_tasks OUT_DIR`` and ship with
the package, so every machine scores the same items whatever its Python version; the YAMLs record the Python
that made them. Each YAML is an ordinary lm-eval task (``dataset_path: json``, ``data_files`` relative to the
YAML, resolved by :mod:`llmtrain.eval.tasks`).
"""

from __future__ import annotations

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

# Packages present in every CPython since 3.9 (missing ones are skipped); no tests, no GUI, no data tables.
PACKAGES = (
    "asyncio", "collections", "concurrent", "ctypes", "curses", "dbm", "email", "html", "http", "importlib",
    "json", "logging", "multiprocessing", "sqlite3", "unittest", "urllib", "wsgiref", "xml", "xmlrpc",
    "zoneinfo",
)  # fmt: skip
MC_ITEMS, PPL_DOCS, PPL_CHARS, SEED = 300, 32, 1000, 20
VERSION = 1  # bump when the items change; it goes into the tasks' metadata


def package_sources(stdlib: str | Path | None = None) -> list[Path]:
    """The ``*.py`` files of :data:`PACKAGES` (test directories excluded), sorted by relative path."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [
        p
        for name in PACKAGES
        if (root / name).is_dir()
        for p in (root / name).rglob("*.py")
        if not any(part in ("test", "tests", "__pycache__") for part in p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _docstring_line(node: ast.AST) -> str | None:
    doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    ok = 25 <= len(line) <= 90 and '"' not in line and line.isascii()
    return line if ok else None


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Public module-level functions and public methods of module-level classes, in source order."""
    out: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
    for node in tree.body:
        body = node.body if isinstance(node, ast.ClassDef) else [node]
        out += [f for f in body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f for f in out if not f.name.startswith("_")]


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def mc_items(files: list[Path], root: Path, n: int = MC_ITEMS, seed: int = SEED) -> list[dict]:
    """``n`` multiple-choice items ``{context, choices, label, source}`` (see the module docstring)."""
    pool: list[tuple[str, str, str]] = []  # (context, docstring line, source)
    seen: set[str] = set()
    for path in files:
        tree = _parse(path)
        for fn in _functions(tree) if tree is not None else []:
            line = _docstring_line(fn)
            if line is None or line in seen:
                continue
            seen.add(line)
            prefix = "async def" if isinstance(fn, ast.AsyncFunctionDef) else "def"
            context = f'{prefix} {fn.name}({ast.unparse(fn.args)}):\n    """'
            pool.append((context, line, f"{path.relative_to(root).as_posix()}:{fn.lineno}"))
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(len(pool)), min(n, len(pool))))
    items = []
    for i in chosen:
        context, line, source = pool[i]
        others = rng.sample([j for j in range(len(pool)) if j != i], 3)
        choices = [pool[j][1] for j in others]
        label = rng.randrange(4)
        choices.insert(label, line)
        items.append({"context": context, "choices": choices, "label": label, "source": source})
    return items


def ppl_docs(files: list[Path], root: Path, n: int = PPL_DOCS, chars: int = PPL_CHARS) -> list[dict]:
    """``n`` passages ``{text, source}``: each the whole lines of a module's first ``chars`` characters."""
    heads = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, ValueError):
            continue
        head = text[:chars].rpartition("\n")[0] if len(text) > chars else ""
        if len(head) >= chars // 2 and head.isascii():
            heads.append({"text": head + "\n", "source": path.relative_to(root).as_posix()})
    step = max(len(heads) / max(n, 1), 1.0)
    return [heads[int(k * step)] for k in range(min(n, len(heads)))]


_MC_YAML = """\
# Multiple choice over the Python standard library's docstrings: which first line belongs to this function?
# Written by `python -m llmtrain.eval.stdlib_tasks` (llmtrain/eval/stdlib_tasks.py); data_files are relative
# to this file. Chance level: acc 0.25.
task: stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: stdlib_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: %(version)d
  python: "%(python)s"
"""

_PPL_YAML = """\
# Rolling perplexity of Python standard-library source text (the heads of package modules).
# Written by `python -m llmtrain.eval.stdlib_tasks` (llmtrain/eval/stdlib_tasks.py); data_files are relative
# to this file.
task: stdlib_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: stdlib_ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: %(version)d
  python: "%(python)s"
"""


def write_tasks(out_dir: str | Path, stdlib: str | Path | None = None) -> list[Path]:
    """Write both tasks (YAML + JSONL) into ``out_dir``; returns the files written."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = package_sources(root)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = {"version": VERSION, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    written = []
    for name, rows, yaml_text in (
        ("stdlib_mc", mc_items(files, root), _MC_YAML),
        ("stdlib_ppl", ppl_docs(files, root), _PPL_YAML),
    ):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=True) + "\n" for r in rows), encoding="utf-8")
        spec = out / f"{name}.yaml"
        spec.write_text(yaml_text % fields, encoding="utf-8")
        written += [spec, data]
    return written


if __name__ == "__main__":
    for f in write_tasks(sys.argv[1] if len(sys.argv) > 1 else "."):
        print(f"{f}  {f.stat().st_size} bytes")
