"""The training path against the decode path on one device, for a real target: do they compute the same?

For a few eval prompts and the target's greedy continuation of each:
  features  the target's features as training computes them (the packed row: FlexAttention on CUDA,
            dense masks on the CPU) and as the decode engine does (StaticLM: the prompt's prefill, then
            verify steps of B tokens), each against a float32 forward of transformers;
  labels    training's target labels against the greedy tokens themselves;
  drafts    a drafter's block at every B-th output position (the decode's anchors when every draft is
            accepted) through the objective's training forward on training's features, and through the
            decode engine (StaticDrafter, one step per block as the host-side decode loop takes them; eval's
            T=0 loop on the device fills the drafter's cache in a first step of its own, which tau_replay
            covers) on the decode's features: the logits' relative difference and how often the two
            argmaxes agree.
On CUDA three more figures bisect the paths: training's drafts under dense masks against FlexAttention
(training's backend there), its features from the padded batch against the packed row's FlexAttention, and the
decode's features from a StaticLM without graphs, Triton chains or decode kernel against float32. At float32
on a CPU every pair agrees to rounding (tests/test_benchmarks.py). On a GPU in bfloat16 the figures say how
far apart the two paths are; a drafts agreement far below the features' suggests a decode path that does not
compute what training does (eval's tau_replay tells the same with a trained drafter, end to end). The drafter:
--drafter DIR, else a fresh one initialised from the target's layers.

    python3 benchmarks/train_serve_gap.py --target gemma3-270m [--drafter RUN/drafter] [--limit 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from record_json import write_json  # the sibling module: benchmarks/ is on the path of a script run

from dflash_train.data.packing import PackedBatch
from dflash_train.decode import static_lm
from dflash_train.decode.speculative import target_generate
from dflash_train.decode.static_drafter import StaticDrafter
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import render_chat
from dflash_train.models.checkpoint import load_drafter, parse_dtype
from dflash_train.models.drafter import DFlashDrafter
from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter
from dflash_train.models.loading import load_target
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig
from dflash_train.pipeline.features import target_features
from dflash_train.pipeline.target_features import FeatureSpec
from dflash_train.training.replay import block_outputs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a - b| / |b| (float32)."""
    a, b = a.float(), b.float()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)).mean())


def packed(seqs: list[list[int]], starts: list[int], device: torch.device) -> PackedBatch:
    """The sequences as training packs them; loss on each one's output (from `starts`)."""
    ids = torch.tensor([t for s in seqs for t in s])
    seq = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    loss = torch.cat([(torch.arange(len(s)) >= p).long() for s, p in zip(seqs, starts, strict=True)])
    return PackedBatch(ids, loss, seq, pos).to(device)


def packed_replies(prompts: list[list[int]], replies: list[list[int]],
                   device: torch.device) -> tuple[list[list[int]], PackedBatch]:
    """Each prompt followed by its reply, packed with the loss on the replies: (the sequences, the pack)."""
    seqs = [p + r for p, r in zip(prompts, replies, strict=True)]
    return seqs, packed(seqs, [len(p) for p in prompts], device)


@torch.no_grad()
def decode_features(target, ids: list[int], prompt_len: int, layers: tuple[int, ...], B: int) -> torch.Tensor:
    """[n, k*H]: the prompt's prefill, then verify-sized steps of B tokens, as the decode loop feeds them."""
    lm = static_lm.for_model(target.model)
    x = torch.tensor([ids], device=target.device)
    cache = lm.cache_for(1, len(ids) + B)
    parts = [lm.forward(x[:, :prompt_len], torch.arange(prompt_len, device=x.device)[None], cache,
                        static_lm.bucket(prompt_len), layers=layers, logits="none", prefill=True).features[0]]
    for s in range(prompt_len, len(ids), B):
        e = min(s + B, len(ids))
        step = lm.step(x[:, s:e], torch.arange(s, e, device=x.device)[None], cache, static_lm.bucket(e),
                       layers=layers, logits="none")  # a graph replay on CUDA, as the decode's verify
        parts.append(step.features[0].clone())  # the graph's output buffer: the next replay rewrites it
    return torch.cat(parts)


def plain_decode_features(target, seqs: list[list[int]], prompts: list[list[int]], layers: tuple[int, ...],
                          B: int) -> torch.Tensor:
    """decode_features from a StaticLM without its CUDA parts (graphs, Triton chains, decode kernel): the
    PyTorch math on the same device, which bisects a decode gap between those parts and the rest."""
    engine = static_lm.for_model(target.model)
    static_lm.use(static_lm.StaticLM(target.model, graphs=False, attention_kernel=False, fused=False))
    try:
        return torch.cat([decode_features(target, s, len(p), layers, B) for s, p in zip(seqs, prompts, strict=True)])
    finally:
        static_lm.use(engine)


@torch.no_grad()
def decode_drafts(target, drafter, ids: list[int], feats: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """The decode engine's draft logits [len(anchors), B-1, V]: each anchor's block on the features before it."""
    B = drafter.block_size
    engine = StaticDrafter(drafter, target.model.get_input_embeddings(), target.lm_head)
    cache, ctx, out = engine.cache_for(len(ids) + B), 0, []
    for a in anchors:
        block = torch.tensor([[ids[a]] + [drafter.mask_token_id] * (B - 1)], device=feats.device)
        meta = torch.tensor([ctx, a - ctx, B], device=feats.device)
        logits = engine.step(feats[None, ctx:a], block, meta, cache, static_lm.bucket(a + B))[:B - 1]
        out.append(logits.to(torch.float32, copy=True))  # a graph's output buffer: the next replay rewrites it
        ctx = a
    return torch.stack(out)


@torch.no_grad()
def training_drafts(target, drafter, batch: PackedBatch, feats: torch.Tensor, anchors: torch.Tensor,
                    attention: str = "auto") -> torch.Tensor:
    """The objective's training forward at `anchors` (indices into the packed row): logits [n, B-1, V]."""
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention=attention),
                          embed_scale=target.embed_scale)
    rows = block_outputs(obj, batch, feats, anchors, drafter.block_size)[0]
    return target.lm_head(rows.to(target.lm_head.weight.dtype)).float()


def drafter_for(target, path: str | None, num_layers: int, block_size: int, intermediate_size: int | None = None,
                init: bool = True) -> DFlashDrafter:
    """The drafter at `path` in the target's device and dtype, else a fresh one of `num_layers`, `block_size` and
    `intermediate_size`, initialised from the target's layers when `init`; in eval mode."""
    if path:
        drafter = load_drafter(path, device=target.device, dtype=target.dtype)
    else:
        cfg = drafter_config_for(target, num_layers=num_layers, block_size=block_size,
                                 intermediate_size=intermediate_size, dtype=str(target.dtype).removeprefix("torch."))
        drafter = new_drafter(cfg, seed=0).to(target.device, target.dtype)
        if init:
            init_from_target(drafter, target)
    return drafter.eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the run's dtype (float32 compares exactly)")
    ap.add_argument("--drafter", help="a drafter directory (default: a fresh one from the target's layers)")
    ap.add_argument("--num-layers", type=int, default=2, help="the fresh drafter's layers")
    ap.add_argument("--block-size", type=int, default=8, help="the fresh drafter's block size")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    dtype = parse_dtype(args.dtype)
    target = load_target(args.target, device=args.device, dtype=dtype)
    ref = target if dtype == torch.float32 else load_target(args.target, device=args.device, dtype=torch.float32)
    drafter = drafter_for(target, args.drafter, args.num_layers, args.block_size)
    B, layers = drafter.block_size, tuple(drafter.config.target_layer_ids)

    prompts = [render_chat(target, m) for m in load_prompts(args.dataset, args.limit)]
    replies = [target_generate(ref, p, args.new_tokens).tokens for p in prompts]  # float32 greedy: the truth
    seqs, batch = packed_replies(prompts, replies, target.device)
    spec = FeatureSpec(layers=layers, labels=True)
    train = target_features(target, batch, spec)  # as a target loop computes them for a pack
    truth = target_features(ref, batch, FeatureSpec(layers=layers)).hidden
    starts = torch.cumsum(torch.tensor([0] + [len(s) for s in seqs]), 0).tolist()
    keep = batch.loss_mask.bool() & (batch.positions > 0)

    cuda = target.device.type == "cuda"
    H, out, agree, diffs, dense_agree = target.hidden_size, {}, [], [], []
    decode = []
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        dec = decode_features(target, s, len(p), layers, B)
        decode.append(dec)
        anchors = list(range(len(p), len(s) - 1, B))
        packed_anchors = torch.tensor(anchors, device=target.device) + starts[i]
        want = training_drafts(target, drafter, batch, train.hidden, packed_anchors)
        got = decode_drafts(target, drafter, s, dec, anchors)
        agree.append((got.argmax(-1) == want.argmax(-1)).float().flatten())
        diffs.append(rel(got.flatten(0, 1), want.flatten(0, 1)))
        if cuda:  # training's drafts under dense masks: FlexAttention's share of any gap
            dense = training_drafts(target, drafter, batch, train.hidden, packed_anchors, attention="dense")
            dense_agree.append((dense.argmax(-1) == want.argmax(-1)).float().flatten())
    decode, plain = torch.cat(decode), None
    if cuda:  # the padded batch's features against the packed row's (FlexAttention's document masks)
        padded = target_features(target, batch, FeatureSpec(layers=layers), mode="padded").hidden
        out["features_padded_vs_packed"] = round(rel(padded, train.hidden), 5)
        out["drafts_dense_vs_flex_agree"] = float(torch.cat(dense_agree).mean())
        plain = plain_decode_features(target, seqs, prompts, layers, B)
    for j, layer in enumerate(layers):
        cols = slice(j * H, (j + 1) * H)
        out[f"layer {layer}"] = {"training_vs_float32": round(rel(train.hidden[:, cols], truth[:, cols]), 5),
                                 "decode_vs_float32": round(rel(decode[:, cols], truth[:, cols]), 5),
                                 "decode_vs_training": round(rel(decode[:, cols], train.hidden[:, cols]), 5)}
        if plain is not None:  # the decode without its CUDA parts: which of the two sides of a gap
            out[f"layer {layer}"]["decode_plain_vs_float32"] = round(rel(plain[:, cols], truth[:, cols]), 5)
    out["labels_equal_greedy"] = float((train.labels.long()[keep] == batch.input_ids[keep]).float().mean())
    out["drafts_argmax_agree"] = float(torch.cat(agree).mean())
    out["drafts_logits_rel_diff"] = sum(diffs) / len(diffs)
    figures = {"target": args.target, "device": torch.cuda.get_device_name(target.device) if target.device.type ==
               "cuda" else "cpu", "dtype": args.dtype, "drafter": args.drafter or f"fresh, {args.num_layers} layers",
               "prompts": len(prompts), "date": datetime.date.today().isoformat(), **out}
    print(json.dumps(figures, indent=1))
    write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
