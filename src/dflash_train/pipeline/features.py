"""The target's features of a packed batch: what a target loop computes for every pack.

The target must see each packed sequence alone (causal within it, nothing across). Two ways:

    packed   the packed row itself, with a document mask (causal within each sequence; a
             second one for sliding-window layers, within the window too) and positions
             restarting per sequence: FlexAttention on CUDA, dense masks on CPU. No work on
             padding; the default whenever sequences differ in length, for every target whose
             attention the masks express (Target.takes_document_mask; not soft-capped logits).
    padded   a right-padded [n_seq, longest] batch, valid rows gathered back into packed
             order. Used when it pads nothing (one sequence, or equal lengths: plain causal
             attention, the fastest kernel) and for long rows on CPU (a dense mask is L x L).

Target labels in the same forward (a FeatureSpec with labels, `--labels target` on data without
labels.npy): the target runs to its last layer and its LM head gives, at every position p, the
greedy token after x_<p (data/relabel.py's labels, without relabel's own pass over the data).
They travel beside the hidden states as their own tensor (pipeline/target_features.py).
"""

from __future__ import annotations

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.models.document_attention import DENSE_MASK_MAX_TOKENS, FORWARD_MODES, document_backend, document_row
from dflash_train.models.target import Target
from dflash_train.pipeline.target_features import LABEL_DTYPE, FeatureSpec, TargetFeatures
from dflash_train.profiling.stats import NULL_LOOP


def pad_packed(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side padding of a packed batch: ids [n_seq, width], attention mask, flat indices of valid slots.

    Done on the host copy of the batch (the loader's), so the device never has to tell us the
    padded width (no sync) and gathering the valid rows back is an index_select, not a boolean mask.
    """
    seq = batch.seq_ids.cpu()
    n_seq = int(seq[-1]) + 1 if seq.numel() else 0
    lengths = torch.bincount(seq, minlength=n_seq)
    width = int(lengths.max()) if n_seq else 0
    rows = torch.arange(width)[None, :] < lengths[:, None]  # [n_seq, width] valid slots
    padded = torch.zeros(n_seq, width, dtype=torch.long)
    padded[rows] = batch.input_ids.cpu()
    return padded, rows.long(), torch.nonzero(rows.flatten()).flatten()


def sequence_lengths(batch: PackedBatch) -> torch.Tensor:
    """[n_seq] host tensor (the loader's host copy of the batch: no device sync)."""
    seq = batch.seq_ids.cpu()
    return torch.bincount(seq, minlength=int(seq[-1]) + 1) if seq.numel() else seq.new_zeros(0)


def feature_mode(lengths: torch.Tensor, device: torch.device, reads_all_keys: bool = False) -> str:
    """'padded' when padding costs nothing (one sequence or equal lengths) or a CPU row is long, else the packed row.

    The same for full-attention and sliding-window targets: a sliding layer's window only narrows
    what each row reads, so the packed row saves the padded batch's pads either way. reads_all_keys
    (Target.padded_attention_reads_all_keys): the target's own attention computes every score of a
    padded batch, so on CUDA the packed row's FlexAttention, which skips the tiles no query sees, wins
    even without pads: gpt-oss-20b's 3,072-token forward spent 96 of its 157 ms in eager attention
    (H100, --compile-target, 2026-12-05).
    """
    flex = document_backend(device) == "flex"
    if lengths.numel() <= 1 or bool((lengths == lengths[0]).all()):
        return "flex" if flex and reads_all_keys and lengths.numel() else "padded"
    if flex:
        return "flex"
    return "dense" if int(lengths.sum()) <= DENSE_MASK_MAX_TOKENS else "padded"


def target_features(target: Target, batch: PackedBatch, spec: FeatureSpec, prof=NULL_LOOP,
                    mode: str = "auto") -> TargetFeatures:
    """What a target loop hands on for one pack: the spec's hidden states and, when it asks for them,
    the target's greedy labels (module docstring), on the target's device."""
    layers = list(spec.layers)
    if not spec.labels:
        return TargetFeatures(packed_features(target, batch, layers, prof, mode))
    H = target.hidden_size
    feats = packed_features(target, batch, [*layers, target.num_layers - 1], prof, mode)  # final-normed last
    with prof.span("target_labels", device=True):  # Target.greedy_labels runs without autograd
        labels = target.greedy_labels(feats[:, -H:], batch.input_ids, batch.loss_mask, batch.positions)
        # contiguous: the hidden states alone, without the last layer's columns (the cache keeps them)
        return TargetFeatures(feats[:, :-H].contiguous(), labels.to(LABEL_DTYPE))


def packed_features(target: Target, batch: PackedBatch, layer_ids: list[int], prof=NULL_LOOP,
                    mode: str = "auto") -> torch.Tensor:
    """Target features [S, n*H] of the packed context tokens (sequences kept apart), on the target's device.

    mode: 'auto' (see feature_mode), 'padded', 'packed' (flex on CUDA, dense elsewhere), or
    'flex' / 'dense' to force one document-mask backend (tests, benchmarks).
    """
    if mode not in FORWARD_MODES:
        raise ValueError(f"packed_features: mode {mode!r} not in {FORWARD_MODES}")
    if mode == "auto":
        mode = (feature_mode(sequence_lengths(batch), target.device, target.padded_attention_reads_all_keys)
                if target.takes_document_mask else "padded")
    elif mode == "packed":
        mode = document_backend(target.device)
    if mode == "padded":
        return padded_features(target, batch, layer_ids, prof)
    target.check_document_mask(mode, "packed_features")  # a forced mode; 'auto' never picks it for such targets
    return document_features(target, batch, layer_ids, prof, flex=mode == "flex")


def padded_features(target: Target, batch: PackedBatch, layer_ids: list[int], prof=NULL_LOOP) -> torch.Tensor:
    """Features [S, n*H] through a right-padded [n_seq, longest] batch."""
    padded, attn, flat = pad_packed(batch)
    # No padding (one sequence, or equal lengths): no mask, so attention takes the causal fast path.
    attn = None if bool(attn.all()) else attn.to(target.device, non_blocking=True)  # host tensor: no sync
    padded, flat = padded.to(target.device, non_blocking=True), flat.to(target.device, non_blocking=True)
    with prof.span("target_forward", device=True):
        feats = target.features(padded, layer_ids, attention_mask=attn)  # runs under inference mode
    with prof.span("pack_hidden", device=True):
        # indexing outside inference mode gives a normal tensor autograd can save
        return feats.flatten(0, 1).index_select(0, flat)  # [S, n*H]


def document_features(target: Target, batch: PackedBatch, layer_ids: list[int], prof=NULL_LOOP,
                      flex: bool = True) -> torch.Tensor:
    """Features [S, n*H] of the packed row in one forward, each sequence causal within itself.

    flex: FlexAttention BlockMasks over the row padded to a multiple of FLEX_TILE (CUDA; on
    CPU FlexAttention runs eagerly, a reference); else dense [1, 1, S, S] masks (sdpa; with
    attention sinks the softmax written out). One mask per kind of layer the target has (full,
    sliding), built once for the row. Attention sinks are kept either way.
    Everything is built from the loader's host copy of the batch: no host sync.
    """
    ids, pos, mask = document_row(batch.input_ids.cpu(), batch.seq_ids.cpu(), batch.positions.cpu(),
                                  target.device, flex=flex, windows=target.attention_windows)
    S = batch.num_tokens
    with prof.span("target_forward", device=True):
        feats = target.features(ids, layer_ids, position_ids=pos, attention_mask=mask)  # [1, L, n*H], inference mode
    with prof.span("pack_hidden", device=True):
        # a copy outside inference mode gives a normal tensor autograd can save
        return feats[0, :S].clone()  # [S, n*H]
