"""The one token sampler: argmax at T=0, a draw from the tempered softmax otherwise.

Regeneration, the target-only baseline and speculative decoding all pick tokens here, so a
reply regenerated at T and a decode evaluated at T draw from the same distribution. Wide batches
on the GPU (regeneration's) draw in one Triton pass (decode/sample_kernel.py, the Gumbel-max
trick); the rest through torch.multinomial: the same distribution, other draws for a seed.
"""

from __future__ import annotations

import torch

from dflash_train.decode import sample_kernel


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The tempered distribution over the last dimension, in float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def pick(logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [..., V] -> tokens [...]: argmax at T <= 0, else one sample per row (from `generator`,
    or torch's global one)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    rows = logits.reshape(-1, logits.shape[-1])
    if sample_kernel.applies(rows):
        seed = sample_kernel.seed_for(rows.device, generator)  # on the device: no host read
        return sample_kernel.sample(rows, temperature, seed).reshape(logits.shape[:-1])
    return multinomial(logits, temperature, generator)


def multinomial(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """pick's draw at T > 0 without the kernel: torch.multinomial over the tempered softmax."""
    p = probs(logits, temperature)
    return torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=generator).reshape(p.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """pick at T=0: the default picker of generate()."""
    return pick(logits)
