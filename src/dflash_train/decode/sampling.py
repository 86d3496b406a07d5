"""The one token sampler: argmax at T=0, a draw from the tempered softmax otherwise.

Regeneration, the target-only baseline and speculative decoding all pick tokens here, so a
reply regenerated at T and a decode evaluated at T draw from the same distribution the same way.
"""

from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The tempered distribution over the last dimension, in float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def pick(logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [..., V] -> tokens [...]: argmax at T <= 0, else one sample per row (from `generator`,
    or torch's global one)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    p = probs(logits, temperature)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """pick at T=0: the default picker of generate()."""
    return pick(logits)
