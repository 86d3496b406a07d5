"""The frozen target LLM: its forward, the features DFlash trains on, its embedding and LM head.

Feature convention: layer id L is the OUTPUT of decoder layer L = HF `hidden_states[L + 1]`.
For L = N-1 HF's last hidden state has the final norm applied; `Target.capture` matches that.
Loading is models/loading.py; the chat format (template, stop tokens, MASK) models/chat.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.errors import UsageError
from dflash_train.models.document_attention import (
    as_document_masks,
    attention_windows,
    document_attention_for,
    document_mask_refusal,
    eager_attention,
    is_document_mask,
)

_HEAD_ROWS = 4096  # LM head rows at a time in greedy_labels: [4096, vocab] logits, not a whole row's


@dataclass
class Target:
    """A frozen causal LM with the accessors DFlash needs."""

    model: nn.Module  # a transformers *ForCausalLM, eval mode, requires_grad False
    tokenizer: object
    spec: str

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding (may exceed the tokenizer: spare rows)."""
        return self.embedding_weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embedding_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding_weight.dtype

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_scale(self) -> float:
        """What the input embedding multiplies its rows by (Gemma: sqrt(hidden); 1 elsewhere), rounded to the
        weight's dtype as the module applies it: the drafter's block tokens are embedded the same way."""
        scale = getattr(self.model.get_input_embeddings(), "embed_scale", None)
        if scale is None:
            return 1.0
        return float(torch.as_tensor(scale).to(self.embedding_weight.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows, scale = F.embedding(input_ids, self.embedding_weight), self.embed_scale
        return rows * scale if scale != 1.0 else rows

    @torch.no_grad()
    def greedy_labels(self, final: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
        """The target labels [S] of packed tokens from their final-normed hidden states [S, H]: at a loss
        token with a prefix (position > 0; every packed sequence starts at 0), the target's greedy token
        after that prefix (its LM head one position back); elsewhere the token itself, never a label."""
        pred = torch.cat([self.lm_head(h).argmax(-1) for h in final.split(_HEAD_ROWS)])
        keep = loss_mask.to(final.device).bool() & (positions.to(final.device) > 0)
        return torch.where(keep, pred.roll(1), input_ids.to(final.device))

    def keep_only_head(self, device: torch.device) -> None:
        """Free the decoder layers and move what is left (embedding, final norm, LM head) to `device`.

        For drafter-only workers: they embed block tokens and score with the LM head, and never
        run the target; for Qwen3-8B this leaves 13.9 GB of layers (bf16) off their GPU.
        """
        self.decoder.layers = nn.ModuleList()
        self.model.to(device)

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack (embedding, layers, final norm) without the LM head."""
        return self.model.base_model

    @property
    def attention_windows(self) -> list[int | None]:
        """Each decoder layer's window (keys back, its own included) as transformers runs it; None: full causal."""
        return attention_windows(self.model.config)

    @property
    def takes_document_mask(self) -> bool:
        """A packed row's document masks (models/document_attention.py) give this target's own attention:
        full causal layers, sliding-window ones and attention sinks (gpt_oss) alike."""
        return self.document_mask_refusal is None

    @property
    def padded_attention_reads_all_keys(self) -> bool:
        """Whether this target's own attention, in a padded batch, computes every (query, key) score: eager
        attention (gpt_oss: its sinks keep it off sdpa; the [H, L, L] scores materialized, sliding layers
        masked after the fact) or a sliding window under sdpa (an explicit mask: no tile is skipped). A
        packed row's BlockMask skips the tiles above the diagonal and outside the window instead."""
        return eager_attention(self.model.config) or any(w is not None for w in self.attention_windows)

    @property
    def document_mask_refusal(self) -> str | None:
        """What of this target's attention the document masks cannot express, or None."""
        return document_mask_refusal(self.model.config)

    def check_document_mask(self, mode: str, where: str) -> None:
        """Refuse a forced document-mask mode ('packed', 'flex', 'dense') for a target whose attention it changes."""
        why = self.document_mask_refusal
        if why is not None:
            raise UsageError(f"{where}: mode {mode!r} runs the target under document masks, but target "
                             f"{self.spec} has {why}: use mode 'padded' (or 'auto', which picks it)")

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor, layer_ids: Sequence[int], *,
                 position_ids: torch.Tensor | None = None, attention_mask=None) -> torch.Tensor:
        """Concatenated features [b, n, len(layer_ids) * H]; runs layers 0..max(layer_ids) only, no LM head.

        attention_mask: None (causal), a [b, n] padding mask, or a packed row's document masks
        (models/document_attention.py: DocumentMasks, or one [b, 1, n, n] boolean mask (True = may
        attend) or FlexAttention BlockMask for every layer), each layer's used as given, with this
        forward's attention run through the document attention (FlexAttention for a BlockMask).
        """
        self.check_layer_ids(layer_ids, "target_layer_ids")
        if is_document_mask(attention_mask):
            masks = as_document_masks(attention_mask).model_kwargs()
        else:
            masks = {"attention_mask": attention_mask}
        with self.capture(layer_ids) as features, self._truncated(max(layer_ids) + 1), \
                document_attention_for(self.model.config, attention_mask):
            self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **masks)
        return features()

    @contextlib.contextmanager
    def capture(self, layer_ids: Sequence[int]) -> Iterator[Callable[[], torch.Tensor]]:
        """Inside: forwards record the outputs of decoder layers `layer_ids`; the function yielded
        concatenates the last ones recorded, [b, n, len(layer_ids) * H], in the order of `layer_ids`.

        The one feature extractor, for any forward: the truncated one above and a decode or verify
        forward with a KV cache and logits. Hooks rather than HF's output_hidden_states: those keep
        every layer's states, and under truncation HF would final-norm the last layer run instead
        of layer N-1. Id N-1 gets the final norm here, as HF's hidden_states[N] has it.
        """
        captured: dict[int, torch.Tensor] = {}
        layers = self.decoder.layers
        hooks = [layers[i].register_forward_hook(_capture(captured, i)) for i in set(layer_ids)]

        def features() -> torch.Tensor:
            return torch.cat([self.decoder.norm(captured[i]) if i == self.num_layers - 1 else captured[i]
                              for i in layer_ids], dim=-1)

        try:
            yield features
        finally:
            for h in hooks:
                h.remove()

    @contextlib.contextmanager
    def compiled_layers(self, enabled: bool = True, backend: str = "inductor") -> Iterator[None]:
        """Inside: the decoder layers' forward under torch.compile (the feature forwards of training).

        Only `forward` is compiled, so the capture hooks stay outside the graph; every layer runs
        the same code with its parameters as inputs, so all layers of a kind (full, sliding) share
        one graph (recompiled once as dynamic when the pack length first changes). The graph guards on the attention
        implementation, so packed rows (FlexAttention, traced into the graph) and unpadded
        batches (sdpa) each get their own. On exit the layers are eager again, so decoding
        (eval, regeneration) never compiles its many cache shapes.
        """
        if not enabled:
            yield
            return
        from dflash_train.models.compiled import compiled_forwards

        with compiled_forwards(self.decoder.layers, backend=backend):
            yield

    @contextlib.contextmanager
    def _truncated(self, n_layers: int) -> Iterator[None]:
        """Temporarily keep only the first n_layers decoder layers (not thread-safe: one target per worker)."""
        full = self.decoder.layers
        if n_layers >= len(full):
            yield
            return
        self.decoder.layers = nn.ModuleList(list(full)[:n_layers])
        try:
            yield
        finally:
            self.decoder.layers = full

    def check_layer_ids(self, layer_ids: Sequence[int], name: str) -> None:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise UsageError(f"{name}: {bad} out of range for target {self.spec} with {self.num_layers} layers "
                             f"(valid 0..{self.num_layers - 1})")


def _capture(store: dict[int, torch.Tensor], idx: int):
    def hook(_module, _args, output):
        store[idx] = output[0] if isinstance(output, tuple) else output
    return hook
