"""decode/sample_kernel.py: the one-pass Gumbel-max draw regeneration's wide batches take, checked under
Triton's interpreter: its tokens follow the tempered softmax, neighbouring rows draw independently, masked
tokens are never drawn, a seed repeats its draws, and sampling.pick routes wide batches to it and narrow
ones to torch.multinomial."""

import pytest
import torch
from conftest import run_interpreted

from dflash_train.decode import sample_kernel
from dflash_train.decode.sampling import pick


def check_the_kernel(device: str) -> None:
    """The kernel's checks on `device` (CUDA, or the CPU under the interpreter)."""
    dev = torch.device(device)
    cpu = torch.device("cpu")
    # the distribution: 2,000 rows of the same logits, chi-square against softmax(logits / T)
    x = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0, -0.5])
    seed = sample_kernel.seed_for(cpu, torch.Generator().manual_seed(0)).to(dev)
    tokens = sample_kernel.sample(x.repeat(2000, 1).to(dev), 0.7, seed, block=16).cpu()
    observed = torch.bincount(tokens, minlength=7).double()
    expected = 2000 * torch.softmax(x.double() / 0.7, -1)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 22.46, (chi2, observed, expected)  # p = 0.001 at 6 degrees of freedom

    # flat logits over 40 columns, three iterations of 16 (the last one part masked): uniform draws
    flat = sample_kernel.sample(torch.zeros(2000, 40, device=dev), 1.0, seed, block=16).cpu()
    observed = torch.bincount(flat, minlength=40).double()
    chi2 = float(((observed - 50) ** 2 / 50).sum())
    assert chi2 < 72.05, (chi2, observed)  # p = 0.001 at 39 degrees of freedom

    # neighbouring rows draw independently: the pairs (row r, row r + 1) of 3,000 flat rows of 10 columns
    # (a width that leaves a row's last Philox counters unused: they must not be the next row's)
    tokens = sample_kernel.sample(torch.zeros(3000, 10, device=dev), 1.0, seed, block=16).cpu()
    pairs = torch.bincount(tokens[:-1] * 10 + tokens[1:], minlength=100).double()
    expected = 2999 / 100
    chi2 = float(((pairs - expected) ** 2 / expected).sum())
    assert chi2 < 148.2, (chi2, pairs.view(10, 10))  # p = 0.001 at 99 degrees of freedom

    # a peak wherever it falls among several iterations and sub-blocks, a row stride wider than the
    # vocabulary, bf16 logits; half the vocabulary masked (-inf) is never drawn
    wide = torch.full((6, 200), -4.0, dtype=torch.bfloat16)
    peaks = torch.tensor([0, 3, 4, 63, 64, 149])
    wide[torch.arange(6), peaks] = 30.0
    assert sample_kernel.sample(wide.to(dev)[:, :150], 1.0, seed, block=16).tolist() == peaks.tolist()
    masked = torch.zeros(400, 40)
    masked[:, 1::2] = float("-inf")
    assert (sample_kernel.sample(masked.to(dev), 2.0, seed, block=16) % 2 == 0).all()

    # a seed repeats its draws, another seed draws others
    rows = torch.randn(300, 90, generator=torch.Generator().manual_seed(1)).to(dev)
    again = sample_kernel.sample(rows, 1.0, seed.clone(), block=32)
    assert torch.equal(sample_kernel.sample(rows, 1.0, seed, block=32), again)
    assert not torch.equal(sample_kernel.sample(rows, 1.0, seed + 1, block=32), again)

    # pick: a batch of MIN_ROWS rows goes through the kernel, seeded from the generator it is given (its
    # default block); a narrower one through torch.multinomial
    wide_rows = rows.repeat(sample_kernel.MIN_ROWS // 300 + 1, 1)[:sample_kernel.MIN_ROWS]
    assert sample_kernel.applies(wide_rows) and not sample_kernel.applies(wide_rows[:-1])
    got = pick(wide_rows, 0.8, torch.Generator(dev).manual_seed(5))
    want = sample_kernel.sample(wide_rows, 0.8, sample_kernel.seed_for(dev, torch.Generator(dev).manual_seed(5)))
    assert torch.equal(got, want)
    narrow = wide_rows[:10]
    p = torch.softmax(narrow / 0.8, -1)
    assert torch.equal(pick(narrow, 0.8, torch.Generator(dev).manual_seed(5)),
                       torch.multinomial(p, 1, generator=torch.Generator(dev).manual_seed(5))[:, 0])


@pytest.mark.slow
@pytest.mark.skipif(sample_kernel.triton is None, reason="triton is not installed")
def test_the_kernel_draws_from_the_tempered_softmax():
    assert run_interpreted("from test_sample_kernel import check_the_kernel; check_the_kernel('cpu'); print('ok')",
                           timeout=600).strip().endswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernel_draws_from_the_tempered_softmax_on_cuda():
    check_the_kernel("cuda")


def test_the_cpu_keeps_torch_multinomial_and_zero_temperature_the_argmax(monkeypatch):
    """Without the interpreter the kernel does not run on the CPU: pick draws as torch.multinomial does."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.randn(sample_kernel.MIN_ROWS, 11, generator=torch.Generator().manual_seed(2))
    assert not sample_kernel.applies(logits)
    want = torch.multinomial(torch.softmax(logits / 0.5, -1), 1, generator=torch.Generator().manual_seed(3))[:, 0]
    assert torch.equal(pick(logits, 0.5, torch.Generator().manual_seed(3)), want)
    assert torch.equal(pick(logits, 0.0), logits.argmax(-1))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_kernel.sample(logits, 0.0, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="block must be a power of two"):
        sample_kernel.sample(logits, 1.0, torch.zeros(1, dtype=torch.int64), block=24)
