"""A decode's bounds, checked before anything is decoded: its positions and its KV caches' memory.

A prompt plus its new tokens past the target's max_position_embeddings decodes positions the target
was never trained on; a token count far past the machine's memory would fail deep inside a decode
after minutes of loading. Both are refused up front, in one line naming the flag.
"""

from __future__ import annotations

from dflash_train.decode.host_reads import LAG
from dflash_train.devices import check_fits
from dflash_train.errors import UsageError
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.shapes import head_dim
from dflash_train.models.target import Target


def check_decode(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int,
                 block_size: int | None = None, flag: str = "--max-new-tokens") -> None:
    """Before any decode: the longest prompt and its new tokens must fit the target's positions, and
    the decode's KV caches the free memory of the target's device. Errors name `flag`."""
    longest = max(len(p) for p in prompts)
    check_context(target, longest, max_new_tokens, flag)
    B = block_size or drafter.block_size
    slots = longest + max_new_tokens + (LAG + 2) * B  # greedy_loop's cache capacity, the largest of the decodes
    check_fits(slots * _bytes_per_slot(target, drafter, B), target.device,
               f"{flag} {max_new_tokens}: a decode of {slots} positions (its KV caches)")


def check_context(target: Target, prompt_len: int, max_new_tokens: int, flag: str = "max_new_tokens") -> None:
    """Positions past the target's max_position_embeddings are outside what it was trained on, and a huge
    token count would size caches and per-step records far past the machine's memory."""
    limit = getattr(target.model.config, "max_position_embeddings", None)
    if limit and prompt_len + max_new_tokens > limit:
        raise UsageError(f"{flag} {max_new_tokens}: a {prompt_len}-token prompt plus {max_new_tokens} new tokens "
                         f"exceed the target's context of {limit} positions (max_position_embeddings)")


def _bytes_per_slot(target: Target, drafter: DFlashDrafter, B: int) -> int:
    """Device bytes one more position of a decode costs: the K and V of every target and draft layer,
    and greedy_loop's step record (1 + B longs, at most one step per token)."""
    def kv(cfg, layers: int) -> int:
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return 2 * layers * kv_heads * head_dim(cfg)

    c, d = target.model.config, drafter.config
    return (kv(c, c.num_hidden_layers) + kv(d, d.num_hidden_layers)) * target.dtype.itemsize + 8 * (1 + B)
