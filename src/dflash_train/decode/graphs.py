"""Replay a fixed-shape function as a CUDA graph: one capture per shape key, then one launch per call.

A small model's decode step is hundreds of tiny kernels; launching them one by one from Python
costs more than running them. Both decode engines (`static_lm` for the target, `static_drafter`
for the drafter) run their steps over preallocated buffers so that every step of one shape can
be captured once and replayed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GraphStore:
    """The graphs bound to one set of buffers (a cache), and their shared memory pool."""

    graphs: dict = field(default_factory=dict)
    pool: tuple | None = None  # the graphs replay one at a time, so they share one pool


def replay(store: GraphStore, key: Any, fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """fn(*inputs) as a replay of the graph captured for `key` (captured on its first call).

    `fn` must read only `inputs` and buffers that outlive the graph. Its outputs live in the
    graph's memory: the next replay of the same key overwrites them, so read (or clone) them
    before calling again.
    """
    graph = store.graphs.get(key)
    if graph is None:
        static_inputs = tuple(x.clone() for x in inputs)
        graph = store.graphs[key] = (*_capture(store, fn, static_inputs, static_inputs[0].device), static_inputs)
    g, out, static_inputs = graph
    for dst, src in zip(static_inputs, inputs, strict=True):
        dst.copy_(src)
    g.replay()
    return out


def advance(store: GraphStore, key: Any, fn: Callable[[], None], device: torch.device) -> None:
    """fn(), a step that reads and updates buffers in place, as a replay of the graph captured for `key`.

    The first call of a key runs fn once, as the capture's warm-up: that run is this call's
    step (capturing executes nothing), so every call advances the buffers exactly once.
    """
    graph = store.graphs.get(key)
    if graph is None:
        store.graphs[key] = _capture(store, fn, (), device)
        return
    graph[0].replay()


def _capture(store: GraphStore, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...], device: torch.device):
    """(graph, outputs) of fn(*inputs), after one warm-up run of it."""
    # Warm up on a side stream: lazy cuBLAS/allocator/compiler set-up must not happen during
    # capture. replay's warm-up writes are the same writes its replays make: harmless.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    if store.pool is None:
        store.pool = torch.cuda.graph_pool_handle()  # per store: a handle outliving its graphs is invalid
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=store.pool):
        out = fn(*inputs)
    return g, out
