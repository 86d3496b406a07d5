"""Decoding: the target-only baseline, regeneration's batched replies and DFlash speculative decoding.

Engines over preallocated KV caches (static_lm for the target, with its per-family table in
architectures; static_drafter for the drafter),
replayed as CUDA graphs (graphs) and optionally compiled (compiled_steps), with Triton kernels for
the target's wide steps (attention_kernel, fused_target); the loops that drive them (generate,
speculative, greedy_loop), their sampler (sampling), late host reads (host_reads) and the bounds
checked before a decode (limits). docs/evaluation.md says which path runs where.
"""
