"""Per-GPU memory of a target placement, estimated before anything is loaded.

    plan = plan_memory(config, tp=4, device_bytes=139e9, token_budget=8192, n_features=5,
                       name="Qwen3-235B-A22B")   # refuses in one line naming the fix when it cannot fit
    print(plan.describe())

Counted per GPU of a TP group (every rank holds the same amounts):
    weights          the model built on the meta device (no storage): parameters the TP plan
                     splits count 1/tp, the rest (embedding, norms, routers, LM head) whole
    activations      the feature forward of one pack of `token_budget` tokens: the residual
                     stream and the larger of one layer's attention transients (q/k/v, q and k
                     after RoPE, its output) and MLP transients (or routed experts'), split over
                     TP, the captured features, and an LM-head chunk when labels come from the target
    feature_buffers  queue_depth packs of features waiting for hand-off:
                     queue_depth x token_budget x n_features x hidden x dtype bytes
    drafter          a drafter trained on the same GPU: fp32 weights, gradients and AdamW's two
                     moments (16 bytes a parameter); 0 when the drafter has GPUs of its own
Attention is assumed memory-efficient (FlexAttention or an sdpa kernel: no tokens x tokens
scores): on CUDA every feature forward of a target the document masks can express runs through
FlexAttention, gpt_oss's eager attention included. A target they cannot express and transformers runs
eagerly materialises [heads/tp, L, L] scores in each padded row of the pack's longest sequence L, a
few copies at once (eager_score_bytes). A dense CPU document mask adds token_budget^2 bytes, not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train.errors import UsageError
from dflash_train.models.document_attention import document_mask_refusal, eager_attention
from dflash_train.models.shapes import head_dim
from dflash_train.models.tp_plan import SPLIT_SIZES, check_tp_size, has_tensor_plan, split_parameters, tensor_plan

ADAMW_BYTES = 16  # fp32 weight + gradient + exp_avg + exp_avg_sq
HEAD_ROWS = 4096  # Target.greedy_labels' LM-head chunk
# [rows, heads, L, L] tensors alive at once at the peak of gpt_oss's eager attention: the masked scores,
# [scores, sink] less its row max, and the softmax of that (the concatenation before the max is freed by then)
EAGER_SCORE_COPIES = 3
GB = 1e9


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    active: int  # what one token's forward uses: all but the unrouted experts' share
    embedding: int  # the input embedding (a lookup; some model cards leave it out of "active")
    split: int  # what the TP plan splits over the group (0 without a plan)

    def per_gpu(self, tp: int) -> int:
        return self.total - self.split + self.split // tp


@dataclass(frozen=True)
class MemoryPlan:
    tp: int
    device_bytes: int
    weights: int
    activations: int
    feature_buffers: int
    drafter: int
    weights_total: int  # the whole target's weights, all ranks together

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.feature_buffers + self.drafter

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    def describe(self) -> str:
        return (f"per GPU at --target-tp {self.tp}: weights {self.weights / GB:.1f} GB + activations "
                f"{self.activations / GB:.1f} GB + feature buffers {self.feature_buffers / GB:.1f} GB + drafter "
                f"{self.drafter / GB:.1f} GB = {self.total / GB:.1f} GB of {self.device_bytes / GB:.0f} GB")


def plan_memory(config, *, tp: int, device_bytes: float, token_budget: int, n_features: int,
                queue_depth: int = 2, drafter_parameters: int = 0, dtype: torch.dtype = torch.bfloat16,
                labels: bool = False, name: str | None = None, flag: str = "--target-tp") -> MemoryPlan:
    """The per-GPU estimate of a target `config` (a transformers config) split over `tp` GPUs of
    `device_bytes` each, with one drafter of `drafter_parameters` per GPU if it shares them.

    name: check the plan too, refusing in one line that names the fix (e.g. the smallest TP
    size that fits) when it cannot fit; None only estimates.
    """
    if tp > 1:
        tensor_plan(config, flag)
    check_tp_size(config, tp, flag)
    size = torch.finfo(dtype).bits // 8
    counts = parameter_counts(config)
    plan = MemoryPlan(
        tp=tp, device_bytes=int(device_bytes), weights=counts.per_gpu(tp) * size,
        activations=activation_bytes(config, tp, token_budget, n_features, size, labels),
        feature_buffers=queue_depth * token_budget * n_features * config.hidden_size * size,
        drafter=drafter_parameters * ADAMW_BYTES, weights_total=counts.total * size)
    if name is not None and not plan.fits:
        sizes = [t for t in tp_sizes(config) if t > tp]
        fix = next((t for t in sizes if _replan(plan, config, counts, t, token_budget, n_features, size, labels)), None)
        gpu, need = f"{plan.device_bytes / GB:.0f} GB GPUs", f"{name} needs {plan.weights_total / GB:.0f} GB of weights"
        if fix is not None:
            raise UsageError(f"{need}: use {flag} {fix} or more on {gpu} ({plan.describe()})")
        raise UsageError(f"{need}; {plan.describe()}, and no {flag} up to {max(tp_sizes(config))} (the most its "
                         "shape divides into) fits: lower the token budget or feature queue depth, give the drafter "
                         "its own GPUs, or use larger GPUs")
    return plan


def _replan(plan: MemoryPlan, config, counts: ParameterCounts, tp: int, tokens: int, n_features: int, size: int,
            labels: bool) -> bool:
    """Whether `plan` fits at TP size `tp` instead."""
    weights = counts.per_gpu(tp) * size
    acts = activation_bytes(config, tp, tokens, n_features, size, labels)
    return weights + acts + plan.feature_buffers + plan.drafter <= plan.device_bytes


def parameter_counts(config) -> ParameterCounts:
    """Parameters of the target, counted on a model built on the meta device (no storage)."""
    model = meta_model(config)
    split = split_parameters(model.base_model, tensor_plan(config)) if has_tensor_plan(config) else set()
    prefix = model.base_model_prefix + "."
    total = split_n = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        split_n += p.numel() if name.removeprefix(prefix) in split else 0
        experts += p.numel() if ".experts." in name else 0
    n_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    unused = experts * (n_experts - config.num_experts_per_tok) // n_experts if n_experts else 0
    return ParameterCounts(total=total, active=total - unused,
                           embedding=model.get_input_embeddings().weight.numel(), split=split_n)


def activation_bytes(config, tp: int, tokens: int, n_features: int, size: int, labels: bool) -> int:
    """Peak transient bytes of one feature forward (see the module docstring)."""
    h = config.hidden_size
    q, kv = (n * head_dim(config) // tp for n in (config.num_attention_heads, config.num_key_value_heads))
    attention = q + 2 * kv + (q + kv) + q  # q, k, v; q and k after RoPE; the attention's output
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k:  # routed tokens: each token's k copies of its input, gate/up, output and weighted output rows
        # (grouped_mm's, measured; dflash_grouped's combine keeps no weighted copy: counted anyway, the safe side)
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # gpt_oss: the latter
        mlp = top_k * (_gate_widths(config) * width // tp + 3 * h)
    else:  # act(gate), up and their product live together
        mlp = 3 * config.intermediate_size // tp
    # the features captured so far; the residual, the normed input, a layer's output and sums (4 h: on an H200
    # about 2 measured live beside the larger of the attention's and the MLP's transients, on a CPU about 3)
    per_token = n_features * h + 4 * h + max(attention, mlp)
    head = HEAD_ROWS * config.vocab_size * size if labels else 0
    return tokens * per_token * size + head + eager_score_bytes(config, tp, tokens, size)


def _gate_widths(config) -> int:
    """How many [rows, width] tensors a routed expert's activation holds at its peak. A SwiGLU: gate/up (two
    widths) and their product. gpt_oss's clamped gate (transformers' GptOssExperts._apply_gate) holds
    gate/up, the clamped gate and up, glu, up + 1 and their product at once: 7
    (one H100, 2026-12-05: gpt-oss-20b's 8,192-token feature forward peaked at 2.22 GB where 3 widths
    gave 1.56; benchmarks/results/h100-moe-dflash-grouped-2026-12-05/memory-plan-gpt-oss-20b.json)."""
    return 7 if config.model_type == "gpt_oss" else 3


def eager_score_bytes(config, tp: int, tokens: int, size: int) -> int:
    """The attention scores eager attention materialises in one layer of a padded feature forward; 0 elsewhere.

    On CUDA a target the document masks can express runs every feature forward through FlexAttention
    (pipeline/features.py feature_mode: packed rows, and a pack of one sequence too where the model's own
    attention is eager), so only a target they cannot express (models/document_attention.py
    document_mask_refusal) runs padded through eager attention. Each padded row holds [heads/tp, L, L]
    scores, L the pack's longest sequence; a pack of `tokens` is about tokens / L such rows, so rows x L^2
    ~ tokens x L <= tokens^2 (one sequence filling the budget). Rows of padding beyond tokens / L (one long
    sequence among many short ones) are not counted.
    """
    if not eager_attention(config) or document_mask_refusal(config) is None:
        return 0
    return EAGER_SCORE_COPIES * (config.num_attention_heads // tp) * tokens * tokens * size


def tp_sizes(config) -> list[int]:
    """TP sizes the architecture splits into evenly (heads, KV heads, MLP widths); [1] without a plan."""
    if not has_tensor_plan(config):
        return [1]
    kv = getattr(config, "num_key_value_heads", None)
    sizes = [n for field, _ in SPLIT_SIZES if field != "num_key_value_heads" and (n := getattr(config, field, None))]
    # past the KV heads, a multiple of them: each rank holds a copy of one (tp_plan.kv_repeats)
    return [t for t in range(1, min(sizes) + 1) if all(n % t == 0 for n in sizes)
            and (not kv or kv % t == 0 or t % kv == 0)]


def meta_model(config):
    """The causal LM of `config` on the meta device: shapes and names, no storage, built in well under a second."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
