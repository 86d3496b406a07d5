"""The tau of prompt lookup on the decode's own outputs: the drafter any target gets for free.

Prompt lookup drafts by copying: the last n tokens committed are searched for in the prompt and
the output so far, and the tokens that followed their first occurrence are the draft (the longest n
from LOOKUP_NGRAM down to 1 that occurs with a token after it; none, no draft), as transformers'
prompt lookup decoding does (in a loop the first occurrence has the most committed tokens after
it). At T=0 its acceptance on the decode's outputs is exact arithmetic, with the decode's steps:
commit the accepted run and the target's next token, go on from there. A trained drafter below it
has not learned to copy what the target copies (a base model repeating its prompt, code quoting its
context).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

LOOKUP_NGRAM = 3


def lookup_tau(prompts: list[list[int]], outputs: list[list[int]], block_size: int, ngram: int = LOOKUP_NGRAM) -> float:
    """Committed tokens over verify steps of prompt lookup with B-1 drafts a step, over every output."""
    commits: list[int] = []
    for prompt, out in zip(prompts, outputs, strict=True):
        commits += decode_commits(len(out), functools.partial(_accepted, prompt + out, len(prompt), block_size - 1,
                                                              ngram))
    return sum(commits) / len(commits) if commits else 1.0


def decode_commits(length: int, run: Callable[[int], int]) -> list[int]:
    """The tokens each verify step commits over an output of `length` tokens, stepped as the decode steps: the
    first token comes from the prefill; a step whose block starts at output token j commits the run(j) drafts
    it got right and the target's next token, cut at the output's end (its limit or stop token)."""
    commits, j = [], 0
    while j < length - 1:  # the last token ends the decode: no step after it
        commits.append(min(run(j) + 1, length - 1 - j))
        j += commits[-1]
    return commits


def _accepted(seq: list[int], start: int, width: int, ngram: int, j: int) -> int:
    """How many of the drafts after output token j (seq[start + j], committed) equal the tokens after it."""
    at = start + j + 1
    draft = _draft(seq, at, width, ngram)
    return next((i for i, t in enumerate(draft) if at + i >= len(seq) or seq[at + i] != t), len(draft))


def _draft(seq: list[int], end: int, width: int, ngram: int) -> list[int]:
    """Up to `width` committed tokens (before `end`) after the first occurrence of seq[end-n:end] that has
    one, the longest n <= ngram."""
    for n in range(min(ngram, end - 1), 0, -1):
        key = seq[end - n:end]
        for i in range(end - n):  # occurrences before the key itself: each has a token after it
            if seq[i:i + n] == key:
                return seq[i + n:min(i + n + width, end)]
    return []
