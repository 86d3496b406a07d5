"""Speculative decoding with a DFlash drafter (docs/design.md#speculative-decoding-and-tau), and the
target-only baseline.

One step: the drafter sees the features of the newly verified context plus the block
[last token, MASK x (B-1)] and proposes slots 1..B-1 in ONE forward (its cache keeps only
context K/V); the target verifies the whole block in ONE forward. T=0 accepts the longest
prefix equal to the target's argmax plus the target's own next token; T>0 uses rejection
sampling, so the output distribution is exactly the target's.

Batch size 1: acceptance decides control flow, so each step reads a few integers back from
the device (commented `host sync` below). That is inherent to speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_train.decode import greedy_loop, static_drafter, static_lm
from dflash_train.decode.generate import generate, now, until_stop
from dflash_train.decode.limits import check_context
from dflash_train.decode.sampling import pick, probs
from dflash_train.models.drafter import ContextCache, DFlashDrafter
from dflash_train.models.target import Target


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens, prompt excluded, stop token included when hit
    prefill_s: float
    decode_s: float  # wall time after prefill
    committed: list[int] = field(default_factory=list)  # tokens committed per verify step (tau's numerator)
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per step (before stop/length cuts)
    slots: list[int] = field(default_factory=list)  # draft slots proposed per step


def rejection_sample(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                     gen: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al.; Chen et al.) for one block.

    draft [n] tokens drawn from q [n, V]; p [n+1, V] the target's distributions at the n
    draft positions and after them. Returns (accepted count, next token): accept draft i
    with probability min(1, p_i/q_i); on the first rejection draw from norm(max(p_i - q_i, 0));
    if all are accepted draw the bonus from p_n. The committed tokens are distributed
    exactly as the target's own samples.
    """
    n = draft.shape[0]
    idx = torch.arange(n, device=draft.device)
    p_d, q_d = p[idx, draft], q[idx, draft]
    u = torch.rand(n, generator=gen, device=draft.device)
    ok = (u * q_d < p_d).to(torch.int64)  # u < p/q without dividing by a zero q
    accepted = int(ok.cumprod(0).sum().item())  # host sync: acceptance drives control flow
    if accepted == n:
        dist = p[n]
    else:
        dist = (p[accepted] - q[accepted]).clamp_min(0)
        total = dist.sum()
        dist = dist / total if total > 0 else p[accepted]  # p == q at this slot: any rejection is measure-zero
    token = int(torch.multinomial(dist, 1, generator=gen).item())  # host sync: next block's input
    return accepted, token


def _new_cache(target: Target):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window targets must be able to roll back
        cache.activate_past_recording()
    return cache


def _crop(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)  # negative form: valid for sliding-window layers too


@torch.no_grad()  # not inference_mode: compiled decode steps (compile_decode) reject its tensors
def target_generate(target: Target, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                    stop_ids: list[int] | None = None, gen: torch.Generator | None = None) -> DecodeResult:
    """Plain autoregressive decoding with a KV cache: the baseline for losslessness and speedup.

    On a StaticLM target (graph replays on CUDA) when the architecture allows; else HF's forward.
    """
    check_context(target, len(prompt), max_new_tokens)
    lm = static_lm.for_model(target.model)
    if lm is None:
        return hf_target_generate(target, prompt, max_new_tokens, temperature, stop_ids, gen)
    out = generate(lm, [prompt], max_new_tokens, list(stop_ids or []), lambda lg: pick(lg, temperature, gen))
    return DecodeResult(tokens=until_stop(out.rows[0], set(stop_ids or [])), prefill_s=out.prefill_s,
                        decode_s=out.decode_s)


def hf_target_generate(target: Target, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                       stop_ids: list[int] | None = None, gen: torch.Generator | None = None) -> DecodeResult:
    """target_generate through HF's forward and DynamicCache (any architecture; eager)."""
    dev, stops = target.device, set(stop_ids or [])
    ids = torch.tensor([prompt], device=dev)
    cache = _new_cache(target)
    t0 = now(dev)
    out = target.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = int(pick(out.logits[0, -1], temperature, gen).item())  # host sync: per-token control flow
    t1 = now(dev)
    tokens = [tok]
    while len(tokens) < max_new_tokens and tok not in stops:
        pos = torch.tensor([[len(prompt) + len(tokens) - 1]], device=dev)
        out = target.model(torch.tensor([[tok]], device=dev), position_ids=pos, past_key_values=cache, use_cache=True)
        tok = int(pick(out.logits[0, -1], temperature, gen).item())  # host sync: per-token control flow
        tokens.append(tok)
    return DecodeResult(tokens=tokens, prefill_s=t1 - t0, decode_s=now(dev) - t1)


class _HFVerifier:
    """Target prefill and block verification through HF's forward and a DynamicCache (any architecture)."""

    def __init__(self, target: Target, layer_ids: list[int]) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.cache = _new_cache(target)

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.target.capture(self.layer_ids) as features:
            out = self.target.model(ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], features()

    def verify(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + block.shape[1], device=block.device)[None]
        with self.target.capture(self.layer_ids) as features:
            out = self.target.model(block, position_ids=positions, past_key_values=self.cache, use_cache=True)
        return out.logits[0], features()

    def commit(self, length: int) -> None:
        _crop(self.cache, length)  # keep target K/V of the verified tokens only


class _StaticVerifier:
    """The same on a StaticLM: a preallocated cache, each full-block verify one graph replay on CUDA.

    Blocks are always B wide (graphs need fixed shapes); a last block cut short by the token
    limit verifies its unused slots too, which changes nothing before them (causal attention).
    """

    def __init__(self, lm: static_lm.StaticLM, layer_ids: list[int], prompt_len: int, max_new_tokens: int,
                 block: int) -> None:
        self.lm, self.layers = lm, tuple(layer_ids)
        self.cache = lm.cache_for(1, prompt_len + max_new_tokens + block)

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        out = self.lm.forward(ids, pos, self.cache, static_lm.bucket(ids.shape[1]), layers=self.layers, logits="last",
                              prefill=True)
        return out.logits[0, -1], out.features

    def verify(self, block: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + block.shape[1], device=block.device)[None]
        kv_len = static_lm.bucket(start + block.shape[1])
        out = self.lm.step(block, positions, self.cache, kv_len, layers=self.layers, logits="all")
        return out.logits[0], out.features  # graph buffers: consumed before the next verify

    def commit(self, length: int) -> None:
        pass  # slots past `length` are rewritten before any later query can see them


class _EagerDraft:
    """Draft logits from the drafter's own forward and a growing ContextCache (any verifier)."""

    def __init__(self, target: Target, drafter: DFlashDrafter) -> None:
        self.target, self.drafter = target, drafter
        self.dtype = next(drafter.parameters()).dtype
        self.cache = ContextCache()

    def logits(self, feats: torch.Tensor, n: int, block: torch.Tensor, q_len: int, ctx_start: int) -> torch.Tensor:
        """feats [1, >=n, nH] of positions ctx_start.. (the first n committed); block [1, >=q] -> [q-1, V]."""
        block = block[:, :q_len]  # the drafter's block attention is bidirectional: width changes its output
        start = ctx_start + n
        positions = torch.arange(ctx_start, start + q_len, device=block.device)[None]
        hidden = self.drafter(self.target.embed(block).to(self.dtype), feats[:, :n].to(self.dtype), positions,
                              cache=self.cache)
        return self.target.lm_head(hidden[:, 1:].to(self.target.dtype))[0]


class _StaticDraft:
    """The same on a StaticDrafter: each full-width step one graph replay on CUDA."""

    def __init__(self, target: Target, drafter: DFlashDrafter, capacity: int) -> None:
        self.engine = static_drafter.for_drafter(drafter, target.model.get_input_embeddings(), target.lm_head)
        self.cache = self.engine.cache_for(capacity)
        self.width = drafter.block_size

    def logits(self, feats: torch.Tensor, n: int, block: torch.Tensor, q_len: int, ctx_start: int) -> torch.Tensor:
        """block [1, B] always: a block cut short to q_len slots is masked to them (static_drafter)."""
        meta = torch.tensor([ctx_start, n, q_len], device=block.device)  # a small host-to-device copy
        kv_len = static_lm.bucket(ctx_start + n + block.shape[1])
        if feats.shape[1] == block.shape[1] == self.width:  # every step but the first
            return self.engine.step(feats, block, meta, self.cache, kv_len)[:q_len - 1]
        return self.engine.forward(feats, block, meta, self.cache, kv_len)[:q_len - 1]


@torch.no_grad()  # not inference_mode: compiled decode steps (compile_decode) reject its tensors
def speculative_generate(target: Target, drafter: DFlashDrafter, prompt: list[int], max_new_tokens: int,
                         temperature: float = 0.0, block_size: int | None = None, stop_ids: list[int] | None = None,
                         gen: torch.Generator | None = None, device_loop: bool = True) -> DecodeResult:
    """DFlash speculative decoding of one prompt (batch 1).

    At T=0 on a StaticLM target the loop's state stays on the device (greedy_loop: no host
    sync per step); otherwise the host decides each step (the same steps and statistics).
    """
    check_context(target, len(prompt), max_new_tokens)
    dev, stops = target.device, set(stop_ids or [])
    B = block_size or drafter.block_size
    if temperature <= 0 and B == drafter.block_size and device_loop and (loop := greedy_loop.for_pair(target, drafter)):
        return _greedy_generate(loop, prompt, max_new_tokens, stops)
    layer_ids = list(drafter.config.target_layer_ids)
    mask_id = drafter.mask_token_id
    lm = static_lm.for_model(target.model)
    if lm is not None:  # static: always full blocks
        capacity = len(prompt) + max_new_tokens + 2 * B
        verifier, drafts = (_StaticVerifier(lm, layer_ids, len(prompt), max_new_tokens, B),
                            _StaticDraft(target, drafter, capacity))
    else:
        verifier, drafts = _HFVerifier(target, layer_ids), _EagerDraft(target, drafter)

    t0 = now(dev)
    logits, new_ctx = verifier.prefill(torch.tensor([prompt], device=dev))  # new_ctx: features of [ctx_start, start)
    first = int(pick(logits, temperature, gen).item())  # host sync: control flow
    t1 = now(dev)

    res = DecodeResult(tokens=[first], prefill_s=t1 - t0, decode_s=0.0)
    start = len(prompt)  # position of the last committed token (block slot 0)
    ctx_start, n_ctx = 0, len(prompt)
    while not _finished(res, max_new_tokens, stops):
        q_len = min(B, max_new_tokens - len(res.tokens) + 1)  # slots that can still commit a token
        block = torch.full((1, B if lm is not None else q_len), mask_id, device=dev, dtype=torch.long)
        block[0, 0] = res.tokens[-1]
        draft_logits = drafts.logits(new_ctx, n_ctx, block, q_len, ctx_start)  # [q_len-1, V]
        draft = pick(draft_logits, temperature, gen)
        block[0, 1:q_len] = draft

        logits, feats = verifier.verify(block, start)
        logits = logits[:q_len]  # slot i predicts position start+i+1
        accepted, new = _accept(draft, draft_logits, logits, temperature, gen)
        produced = _extend(res, accepted, new, q_len, max_new_tokens, stops)
        # Keep target K/V of the verified slots 0..produced-1; their features feed the next draft.
        ctx_start, start, n_ctx = start, start + produced, produced
        verifier.commit(start)
        new_ctx = feats
    res.decode_s = now(dev) - t1
    return res


def compile_decode(target: Target, drafter: DFlashDrafter, *, target_steps: bool = True) -> bool:
    """torch.compile the decode steps of the target (its one-token steps and block verifies) and
    of the drafter, for target-only and DFlash decoding alike; False off StaticLM targets.
    target_steps=False: the drafter's steps only (the target keeps its graphed eager steps, the path
    its target-only baseline runs; a step of the device loop then attends over the whole cache).

    A batch-1 step of a small model costs about its kernel count times a few microseconds;
    inductor fuses the elementwise kernels and roughly halves each part (docs/evaluation.md).
    The first call of each step kind compiles (tens of seconds), so do it outside any clock.
    """
    lm = static_lm.for_model(target.model)
    if lm is None:
        return False
    if target_steps:
        lm.compile()
    static_drafter.for_drafter(drafter, target.model.get_input_embeddings(), target.lm_head).compile()
    return True


def _greedy_generate(loop: greedy_loop.GreedyLoop, prompt: list[int], max_new_tokens: int,
                     stops: set[int]) -> DecodeResult:
    """The T=0 decode on the device; the host reads each step back one step late (on CUDA) and applies
    the host loop's rules."""
    dev, B = loop.device, loop.B
    t0 = now(dev)
    res = DecodeResult(tokens=[loop.start(prompt, max_new_tokens)], prefill_s=0.0, decode_s=0.0)
    t1 = now(dev)
    res.prefill_s = t1 - t0
    done = _finished(res, max_new_tokens, stops)
    if not done:
        loop.first_step()
    while not done:
        while not loop.reads.due() and _more(res, max_new_tokens, len(loop.reads), B):
            loop.queue(static_lm.bucket(len(prompt) + len(res.tokens) - 1 + (len(loop.reads) + 1) * B))
        accepted, *pred = loop.read()
        # The accepted drafts equal the target's argmaxes; then comes its next token.
        q_len = min(B, max_new_tokens - len(res.tokens) + 1)
        _extend(res, accepted, pred[:accepted + 1], q_len, max_new_tokens, stops)
        done = _finished(res, max_new_tokens, stops)
    res.decode_s = now(dev) - t1  # includes the lag's steps queued past the end
    return res


def _more(res: DecodeResult, max_new_tokens: int, unread: int, B: int) -> bool:
    """Whether to queue another step before reading: always when none is queued, else only while the
    queued ones cannot reach the token limit. A step queued past the end costs a whole step; not
    queueing one costs the GPU only the read's round trip (then the host queues it)."""
    return unread == 0 or max_new_tokens - len(res.tokens) > unread * B


def _finished(res: DecodeResult, max_new_tokens: int, stops: set[int]) -> bool:
    return len(res.tokens) >= max_new_tokens or res.tokens[-1] in stops


def _extend(res: DecodeResult, accepted: int, new: list[int], q_len: int, max_new_tokens: int,
            stops: set[int]) -> int:
    """Commit a step's tokens (`accepted` drafts and the target's next token) up to the limit or a stop token."""
    produced = min(len(new), max_new_tokens - len(res.tokens))
    for i, t in enumerate(new[:produced]):
        if t in stops:
            produced = i + 1
            break
    res.tokens.extend(new[:produced])
    res.committed.append(produced)
    res.accepted.append(accepted)
    res.slots.append(q_len - 1)
    return produced


def _accept(draft: torch.Tensor, draft_logits: torch.Tensor, logits: torch.Tensor, temperature: float,
            gen: torch.Generator | None) -> tuple[int, list[int]]:
    """(accepted drafts, the tokens to commit: the accepted drafts and the target's next token).

    T=0 copies drafts and target argmaxes to the host once and compares them there: one sync
    per step instead of three.
    """
    if temperature > 0:
        accepted, token = rejection_sample(draft, probs(draft_logits, temperature), probs(logits, temperature), gen)
        return accepted, draft[:accepted].tolist() + [token]  # host sync: committed tokens
    both = torch.cat([draft, logits.argmax(-1)]).tolist()  # host sync: acceptance drives control flow
    n = draft.shape[0]
    drafted, pred = both[:n], both[n:]
    accepted = next((i for i in range(n) if drafted[i] != pred[i]), n)
    return accepted, drafted[:accepted] + [pred[accepted]]
