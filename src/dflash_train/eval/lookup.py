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

LOOKUP_NGRAM = 3


def lookup_tau(prompts: list[list[int]], outputs: list[list[int]], block_size: int, ngram: int = LOOKUP_NGRAM) -> float:
    """Committed tokens over verify steps of prompt lookup with B-1 drafts a step, over every output."""
    committed = steps = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        seq, start = prompt + out, len(prompt)
        j = 0
        while j < len(out) - 1:  # out[j] is committed; the step drafts out[j+1:]
            draft = _draft(seq, start + j + 1, block_size - 1, ngram)
            run = next((i for i, t in enumerate(draft) if start + j + 1 + i >= len(seq) or seq[start + j + 1 + i] != t),
                       len(draft))
            take = min(run + 1, len(out) - 1 - j)
            committed, steps, j = committed + take, steps + 1, j + take
    return committed / steps if steps else 1.0


def _draft(seq: list[int], end: int, width: int, ngram: int) -> list[int]:
    """Up to `width` committed tokens (before `end`) after the first occurrence of seq[end-n:end] that has
    one, the longest n <= ngram."""
    for n in range(min(ngram, end - 1), 0, -1):
        key = seq[end - n:end]
        for i in range(end - n):  # occurrences before the key itself: each has a token after it
            if seq[i:i + n] == key:
                return seq[i + n:min(i + n + width, end)]
    return []
