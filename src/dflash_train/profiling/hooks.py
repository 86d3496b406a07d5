"""Spans from module forward hooks: the model code never sees the profiler.

    with drafter_spans(drafter, prof):   # a profiled training loop, for its run
        ...                              # every drafter forward records its internals into prof

The drafter's breakdown inside `drafter_forward` (the objective adds `drafter.masks` and
`drafter.lm_head_loss` around it):

    drafter.fc             fc + hidden_norm: the fusion of the target features into the context
    drafter.L{i}.attention layer i from its start to its post-attention norm (input norm, attention, residual)
    drafter.L{i}.mlp       layer i from its post-attention norm to its end (norm, MLP, residual)
    drafter.L{i}           layer i whole, instead of the two above, when its forward is compiled
    drafter.layers         all layers, instead of any of the above, when they are compiled as one graph

Hooks are installed only when profiling is on (a disabled profile costs nothing) and removed
when the block ends. The drafter is read by its module names (fc, hidden_norm, layers[i] with
layer_idx and post_attention_layernorm), which are its checkpoint layout and do not move.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle


def span_hooks(prof, key: str, start: nn.Module, end: nn.Module, *, before_end: bool = False) -> list[RemovableHandle]:
    """Time `key` from the start of start's forward to the end of end's forward (to its start: before_end)."""
    open_spans: list = []  # a stack: the span of the forward running now

    def enter(module, args) -> None:
        span = prof.span(key, device=True)
        span.__enter__()
        open_spans.append(span)

    def leave(module, *args) -> None:
        if open_spans:  # end's forward called alone (outside start's) opened nothing
            open_spans.pop().__exit__(None, None, None)

    closing = end.register_forward_pre_hook(leave) if before_end else end.register_forward_hook(leave)
    return [start.register_forward_pre_hook(enter), closing]


@contextlib.contextmanager
def drafter_spans(drafter: nn.Module, prof, whole_layers: bool = False, whole_stack: bool = False) -> Iterator[None]:
    """Time the drafter's fusion and each layer's attention and MLP into `prof` while the block runs.

    whole_layers: one span per layer (drafter.L{i}), for compiled layers, whose insides are one graph
    that a hook inside would break. whole_stack: one span for all layers (drafter.layers), for layers
    compiled as one graph."""
    if not prof.enabled:
        yield
        return
    handles = span_hooks(prof, "drafter.fc", drafter.fc, drafter.hidden_norm)
    if whole_stack:
        handles += span_hooks(prof, "drafter.layers", drafter.layers, drafter.layers)
    for layer in [] if whole_stack else drafter.layers:
        if whole_layers:
            handles += span_hooks(prof, f"drafter.L{layer.layer_idx}", layer, layer)
            continue
        # attention's end and the MLP's start are both pre-hooks of the post-attention norm: in this order
        handles += span_hooks(prof, f"drafter.L{layer.layer_idx}.attention", layer, layer.post_attention_layernorm,
                              before_end=True)
        handles += span_hooks(prof, f"drafter.L{layer.layer_idx}.mlp", layer.post_attention_layernorm, layer)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
