"""The decode's tau replayed through the training path: does serving compute what training learned?

At T=0 a decode emits the target's greedy tokens, so a prompt and its output are a sequence of the
kind training learns from (labels: the target's greedy tokens). Through the training path (the
target's features of the whole sequence, the objective's blocks and masks, the drafter's training
forward) the drafter's block at every output position accepts some run of draft tokens; stepping
from the first output token as the decode does (commit 1 + that run, go on from there) visits the
decode's own anchors on the decode's own prefixes. So the replay's tau is the decode's tau up to
rounding when the two paths compute the same thing. A decode tau well below it points at the
decode path (features, masks, embedding, numerics); equal, a low tau is the drafter's own.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dflash_train.data.packing import PackedBatch
from dflash_train.eval.lookup import decode_commits
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.target import Target
from dflash_train.objective.blocks import IGNORE, Blocks, build_blocks
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
from dflash_train.pipeline.features import target_features
from dflash_train.pipeline.target_features import FeatureSpec

_HEAD_ROWS = 2048  # LM-head rows at a time: [2048, 262,144] bf16 logits are 1 GB
_ANCHORS = 256  # blocks a forward: each sequence's dense mask is [its blocks' B rows, its context + those rows]
_PACK_TOKENS = 8192  # padded tokens a pack of (prompt, output) sequences: one target forward, few drafter forwards


@torch.no_grad()
def replay_commits(target: Target, drafter: DFlashDrafter, prompts: list[list[int]], outputs: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """eval.evaluate's `replay` (eval/ sits below the objective and the target's feature forward, so its callers
    pass this in). Per prompt, the tokens each verify step commits when decoding `outputs` (each prompt's greedy
    tokens, the first from its prefill; at most `max_new_tokens`) with the drafter's blocks from the training
    path, as the decode counts them: their mean is the replay's tau. evaluate() runs it inside
    fused.eager_chains(), outside training's grad mode and autocast."""
    # dense masks: packs of a few sequences of their own lengths (FlexAttention would compile per shape)
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="dense"),
                          embed_scale=target.embed_scale)
    runs = packed_runs(target, obj, list(zip(prompts, outputs, strict=True)), max_new_tokens)
    return [decode_commits(len(out), row.__getitem__) for out, row in zip(outputs, runs, strict=True)]


def accepted_runs(target: Target, obj: DFlashObjective, prompt: list[int], out: list[int],
                  max_new_tokens: int, target_labels: bool = False) -> list[int]:
    """For each output token j as a block's known token: how many of the drafts after it equal out[j+1:].

    Near the token limit the decode drafts a block cut to min(B, max_new_tokens - j) slots, which sees only
    its own slots (block attention is non-causal, so a narrower block drafts other tokens): those anchors
    run as blocks of their own width. target_labels: the drafts are checked against the target's greedy
    tokens instead, as training labels them (--labels target: while `out` agrees with the target), for
    outputs that are not the target's greedy ones (sampled replies)."""
    return packed_runs(target, obj, [(prompt, out)], max_new_tokens, target_labels)[0]


def packed_runs(target: Target, obj: DFlashObjective, pairs: list[tuple[list[int], list[int]]], max_new_tokens: int,
                target_labels: bool = False) -> list[list[int]]:
    """accepted_runs of each (prompt, output) pair. The pairs go through in packs of similar lengths (a sequence
    sees only itself, in the target's padded batch as in the drafter's dense masks), so 40 prompts cost a few
    forwards where one at a time they cost a target forward and up to B drafter forwards each."""
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    runs: list[list[int]] = [[] for _ in pairs]
    pack: list[int] = []
    for k, i in enumerate(order):
        pack.append(i)
        # sorted by length: with the next pair, the pack pads to that pair's length
        if k + 1 == len(order) or (len(pack) + 1) * sum(map(len, pairs[order[k + 1]])) > _PACK_TOKENS:
            for j, row in zip(pack, _pack_runs(target, obj, [pairs[j] for j in pack], max_new_tokens, target_labels),
                              strict=True):
                runs[j] = row
            pack = []
    return runs


def _pack_runs(target: Target, obj: DFlashObjective, pairs: list[tuple[list[int], list[int]]], max_new_tokens: int,
               target_labels: bool) -> list[list[int]]:
    """packed_runs of one pack: its target features in one padded forward, then its blocks grouped by width."""
    dev, B = target.device, obj.drafter.block_size
    ids, loss, seq, pos, starts = [], [], [], [], []
    for i, (prompt, out) in enumerate(pairs):
        n, p = len(prompt) + len(out), len(prompt)
        starts.append(len(ids) + p)  # the packed index of the output's first token
        ids += prompt + out
        loss += [0] * p + [1] * len(out)
        seq += [i] * n
        pos += range(n)
    batch = PackedBatch(*(torch.tensor(t, device=dev) for t in (ids, loss, seq, pos)))
    spec = FeatureSpec(layers=tuple(obj.drafter.config.target_layer_ids), labels=target_labels)
    found = target_features(target, batch, spec, mode="padded")  # no compile, whatever the lengths
    feats, batch = found.hidden, replace(batch, labels=found.labels)
    by_width: dict[int, list[tuple[int, int]]] = {}  # block width -> (sequence, output token) anchors
    for i, (_, out) in enumerate(pairs):
        for j in range(len(out)):
            by_width.setdefault(min(B, max_new_tokens - j), []).append((i, j))
    runs = [[0] * len(out) for _, out in pairs]
    for w, anchors in by_width.items():
        for k in range(0, len(anchors), _ANCHORS):  # blocks see the context, not each other: any grouping is exact
            chunk = anchors[k:k + _ANCHORS]
            at = torch.tensor([starts[i] + j for i, j in chunk], device=dev)
            for (i, j), run in zip(chunk, _runs(obj, batch, feats, at, w), strict=True):
                runs[i][j] = run
    return runs


def block_outputs(obj: DFlashObjective, batch: PackedBatch, feats: torch.Tensor, anchors: torch.Tensor,
                  width: int) -> tuple[torch.Tensor, Blocks]:
    """The training forward's final-normed outputs at the draft slots of blocks `width` wide at `anchors`
    (indices into the packed row), [n, width - 1, H], and the blocks."""
    blocks = build_blocks(batch, anchors, width, obj.drafter.mask_token_id, obj.gamma)
    keys = obj.key_context(batch)  # FlexAttention's padded context; the batch itself under dense masks
    hidden = obj.block_hidden(keys, blocks, obj.masks(keys, blocks), feats)[0]
    return hidden.view(len(anchors), width, -1)[:, 1:], blocks


def _runs(obj: DFlashObjective, batch: PackedBatch, feats: torch.Tensor, anchors: torch.Tensor,
          width: int) -> list[int]:
    """Accepted drafts of blocks `width` wide at `anchors`: the leading slots whose argmax is the label."""
    if width < 2:  # the last token's block: no draft slot
        return [0] * len(anchors)
    hidden, blocks = block_outputs(obj, batch, feats, anchors, width)
    head = obj.lm_head
    drafts = torch.cat([head(h.to(head.weight.dtype)).argmax(-1) for h in hidden.flatten(0, 1).split(_HEAD_ROWS)])
    labels = blocks.labels.view(len(anchors), width)[:, 1:]
    hits = (drafts.view_as(labels) == labels) & (labels != IGNORE)
    return hits.int().cumprod(1).sum(1).tolist()
