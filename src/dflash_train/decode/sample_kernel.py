"""A draw from each row's tempered softmax in one Triton pass over its logits (the Gumbel-max trick).

Regeneration samples 2,048 rows a step at T > 0. The eager draw (`sampling.pick`'s other path) is a
chain of full passes over [rows, vocabulary] float32: the cast, the division by T, the softmax (two
reads), and torch.multinomial's own Gumbel-max (exponential noise written, p / noise, its argmax):
~46 bytes an entry. Counted for SmolLM2-135M's 49,152-token vocabulary that is ~4.6 GB a step at
2,048 rows, ~1 ms of an H200's bandwidth in a ~12 ms regeneration step; for Gemma 3's 262,144 tokens
~25 GB, ~5 ms. Here one program takes one row: it reads the logits once in their own dtype, draws its
uniforms in registers (Philox, four per call) and keeps the running argmax of logit / T + Gumbel
noise, which is a draw from softmax(logits / T) (the Gumbel-max trick: argmax_i (x_i + g_i),
g_i = -log(-log(u_i)) i.i.d., picks i with probability exp(x_i) / sum_j exp(x_j)). ~0.2 GB read at
2,048 x 49,152 in bf16.

The same distribution as the eager path, not the same draws: a seed gives other tokens than torch.multinomial
does. A row whose logits are all -inf or NaN draws token 0 (torch.multinomial raises there). Counted from its
loop compiled for sm_90 (nvdisasm), the kernel is bound by instruction issue, not memory: ~64 instructions an
entry (84 with both logarithms from libdevice; the outer one is the hardware's lg2.approx), ~1.2 ms predicted
at 2,048 x 262,144 against a 0.3 ms memory floor; measured 1.30 ms against torch.multinomial's 11.76 ms (H100,
2026-12-05, benchmarks/sample_speed.py). The seed comes from torch's generator (the one passed, or the
device's global one) as a device tensor, so no host read and a run seeded once draws the same tokens each
time. Rows below MIN_ROWS keep the eager path: one program walks its whole vocabulary alone, which at batch 1
is slower than the eager chain's wide kernels.

Triton is optional: without it (the CPU build of torch ships none) `applies` is False. Under
TRITON_INTERPRET=1 the kernel runs on CPU tensors (how the tests check it without a GPU).
"""

from __future__ import annotations

import torch

from dflash_train.devices import triton_device, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch comes without triton
    triton = None

MIN_ROWS = 128  # about one row a streaming multiprocessor (the H200 has 132): fewer leave the GPU idle
BLOCK = 2048  # columns a program reads per iteration: four sub-blocks of 512, one Philox call for all four
_LOG2E = 1.4426950408889634  # the scores are kept in base 2: argmax(x / T + g) = argmax(log2(e) (x / T + g))


def applies(logits: torch.Tensor) -> bool:
    """Whether `pick` draws from these logits [rows, V] with the kernel: floating logits of at least
    MIN_ROWS rows, on CUDA (or the CPU under the interpreter)."""
    return (triton is not None and logits.dim() == 2 and logits.shape[0] >= MIN_ROWS and logits.shape[1] > 0
            and logits.is_floating_point() and triton_runs_on(logits.device))


def seed_for(device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh 62-bit seed on `device`, drawn from `generator` (or torch's global one for the device)."""
    return torch.randint(1 << 62, (1,), device=device, dtype=torch.int64, generator=generator)


def sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """logits [rows, V] -> tokens [rows] (int64): each a draw from softmax(logits[row] / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 4 columns, got {block}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    with triton_device(logits.device):
        _gumbel_argmax_kernel[(rows,)](logits, seed, out, logits.stride(0), _LOG2E / temperature, VOCAB=vocab,
                                       QUARTER=block // 4, FAST_LOG=logits.is_cuda, num_warps=8)
    return out


if triton is not None:
    @triton.jit
    def _keep_best(best, best_col, base, cols, u, vocab, scale, FAST_LOG: tl.constexpr):
        """The running per-lane argmax of (logit / T + Gumbel noise) * log2(e), over one sub-block of
        columns: x * scale - log2(-ln(u)), scale = log2(e) / T."""
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        e = -tl.log(u)  # exponential noise; accurate: as u -> 1 it is tiny, the Gumbel tail's precision
        if FAST_LOG:  # the hardware's approximate log2 (one instruction; ~2^-22 relative, e > 0 here)
            log2_e = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [e], dtype=tl.float32,
                                               is_pure=True, pack=1)
        else:  # the interpreter runs no PTX
            log2_e = tl.log2(e)
        z = x * scale - log2_e  # u = 0 gives e = inf, z = -inf: never picked
        better = z > best
        return tl.where(better, z, best), tl.where(better, cols, best_col)

    @triton.jit
    def _gumbel_argmax_kernel(Logits, Seed, Out, stride, scale, VOCAB: tl.constexpr, QUARTER: tl.constexpr,
                              FAST_LOG: tl.constexpr):
        # VOCAB is a constant of the kernel (one build per model): a loop bound, which older Triton
        # interpreters (3.6) cannot take from a runtime scalar
        vocab = VOCAB
        row = tl.program_id(0).to(tl.int64)
        seed = tl.load(Seed)
        base = Logits + row * stride
        q = tl.arange(0, QUARTER)
        groups = tl.cdiv(vocab, 4 * QUARTER) * QUARTER  # Philox counters a row uses: QUARTER an iteration
        best = tl.full([QUARTER], float("-inf"), tl.float32)
        best_col = tl.zeros([QUARTER], dtype=tl.int64)
        for start in range(0, vocab, 4 * QUARTER):
            # one counter per lane and iteration, rows apart (no two rows share noise): four uniforms, one per
            # sub-block
            u0, u1, u2, u3 = tl.rand4x(seed, row * groups + start // 4 + q)
            best, best_col = _keep_best(best, best_col, base, start + q, u0, vocab, scale, FAST_LOG)
            best, best_col = _keep_best(best, best_col, base, start + QUARTER + q, u1, vocab, scale, FAST_LOG)
            best, best_col = _keep_best(best, best_col, base, start + 2 * QUARTER + q, u2, vocab, scale, FAST_LOG)
            best, best_col = _keep_best(best, best_col, base, start + 3 * QUARTER + q, u3, vocab, scale, FAST_LOG)
        top = tl.max(best, axis=0)
        tl.store(Out + row, tl.min(tl.where(best == top, best_col, vocab), axis=0))
