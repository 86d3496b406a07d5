"""The DFlash objective against brute-force definitions: anchors, mask, labels, weights, backends."""

import math

import pytest
import torch
from conftest import interpreted, run_interpreted

from dflash_train.data.packing import PackedBatch
from dflash_train.objective.anchors import eligible_anchors, sample_anchors, sample_packed_anchors
from dflash_train.objective.blocks import IGNORE, build_blocks, gamma_for, slot_weights
from dflash_train.objective.loss import expected_acceptance_length, weighted_block_loss
from dflash_train.objective.masks import MaskSpec, dense_mask, flex_block_mask, structured_block_mask
from dflash_train.objective.objective import DFlashObjective, ObjectiveConfig


def _packed(lens=(13, 9, 11), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 200, (sum(lens),), generator=g)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    mask = torch.cat([(torch.arange(n) >= n // 3).long() for n in lens])
    mask[4] = 0  # a hole inside the first sequence's assistant span
    return PackedBatch(ids, mask, seq, pos)


def test_anchor_eligibility():
    m = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1])
    assert eligible_anchors(m).tolist() == [1, 4, 5]


def test_anchor_sampling_is_sorted_unique_and_bounded():
    m = torch.ones(100, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(m, 10, g)
    assert a.numel() == 10 and torch.equal(a, a.sort().values) and a.unique().numel() == 10
    assert (a < 99).all()
    b = sample_anchors(m, 10, g)
    assert not torch.equal(a, b)  # fresh anchors each time a sequence is seen
    assert sample_anchors(torch.tensor([1, 1, 0]), 10).tolist() == [0]  # fewer eligible than asked: all of them


def test_packed_anchors_stay_inside_their_sequence():
    b = _packed()
    anchors = sample_packed_anchors(b, 100, torch.Generator().manual_seed(0))
    expect = [i for i in range(b.num_tokens - 1)
              if b.loss_mask[i] and b.loss_mask[i + 1] and b.seq_ids[i] == b.seq_ids[i + 1]]
    assert anchors.tolist() == expect


def test_labels_are_same_position_and_respect_sequence_and_mask():
    b = _packed()
    anchors = sample_packed_anchors(b, 100, torch.Generator().manual_seed(0))
    B, MASK = 4, 999
    blk = build_blocks(b, anchors, B, MASK, gamma=4.0)
    for j, a in enumerate(anchors.tolist()):
        assert blk.input_ids[j * B] == b.input_ids[a] and (blk.input_ids[j * B + 1:(j + 1) * B] == MASK).all()
        for k in range(B):
            assert blk.positions[j * B + k] == b.positions[a] + k
            t = a + k
            ok = k >= 1 and t < b.num_tokens and b.seq_ids[t] == b.seq_ids[a] and b.loss_mask[t] == 1
            assert blk.labels[j * B + k] == (b.input_ids[t] if ok else IGNORE), (j, k)
            assert (blk.weights[j * B + k] > 0) == ok
    assert MASK not in blk.labels.tolist()


def test_target_labels_count_only_while_the_text_follows_the_target():
    b = _packed()
    g = torch.Generator().manual_seed(1)
    # the target's greedy tokens: the text's own token ~60% of the time, else another
    b.labels = torch.where(torch.rand(b.num_tokens, generator=g) < 0.6, b.input_ids, b.input_ids + 1000)
    anchors = sample_packed_anchors(b, 100, torch.Generator().manual_seed(0))
    B = 5
    blk = build_blocks(b, anchors, B, 999, gamma=4.0)
    counted = 0
    for j, a in enumerate(anchors.tolist()):
        for k in range(1, B):
            t = a + k
            ok = t < b.num_tokens and b.seq_ids[t] == b.seq_ids[a] and b.loss_mask[t] == 1
            ok = ok and all(b.input_ids[a + i] == b.labels[a + i] for i in range(1, k))  # followed through a+k-1
            assert blk.labels[j * B + k] == (b.labels[t] if ok else IGNORE), (j, k)
            assert (blk.weights[j * B + k] > 0) == ok
            counted += ok and k >= 2
    assert counted > 0 and (blk.labels.view(-1, B)[:, 0] == IGNORE).all()


def test_slot_weights_and_gamma():
    w = slot_weights(6, gamma=2.0)
    assert w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[1:], torch.exp(-torch.arange(5.0) / 2.0))
    assert (gamma_for(16), gamma_for(10), gamma_for(8)) == (7.0, 5.0, 4.0)
    assert gamma_for(16, 3.0) == 3.0


def _brute_mask(b: PackedBatch, anchors, B, window=None):
    S, n = b.num_tokens, anchors.numel()
    out = torch.zeros(n * B, S + n * B, dtype=torch.bool)
    for q in range(n * B):
        j, k = divmod(q, B)
        a = int(anchors[j])
        qpos = int(b.positions[a]) + k
        for kv in range(S + n * B):
            if kv < S:
                ok = b.seq_ids[kv] == b.seq_ids[a] and kv < a
                kpos = int(b.positions[kv])
            else:
                jj, kk = divmod(kv - S, B)
                ok = jj == j
                kpos = int(b.positions[a]) + kk
            if window is not None:
                ok = ok and kpos <= qpos and qpos - kpos < window
            out[q, kv] = bool(ok)
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_mask_matches_brute_force(window):
    b = _packed()
    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(1))
    spec = MaskSpec(b.seq_ids, b.positions, anchors, 4, window)
    assert torch.equal(dense_mask(spec)[0, 0], _brute_mask(b, anchors, 4, window))


def test_mask_never_shows_the_anchor_itself_or_later_context():
    b = _packed()
    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(2))
    m = dense_mask(MaskSpec(b.seq_ids, b.positions, anchors, 4))[0, 0]
    for j, a in enumerate(anchors.tolist()):
        assert not m[j * 4:(j + 1) * 4, a:b.num_tokens].any()  # strictly before the anchor


def test_flex_block_mask_equals_dense_mask():
    b = _packed()
    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(1))
    spec = MaskSpec(b.seq_ids, b.positions, anchors, 4)
    bm = flex_block_mask(spec)
    dense = bm.to_dense()  # [1, 1, q_blocks, kv_blocks] tile occupancy
    assert dense.any()
    q = torch.arange(spec.num_queries)[:, None]
    kv = torch.arange(spec.context_len + spec.num_queries)[None, :]
    torch.testing.assert_close(bm.mask_mod(0, 0, q, kv), dense_mask(spec)[0, 0])


def _four_sequences():
    lens = [37, 5, 60, 22]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    gen = torch.Generator().manual_seed(0)
    return PackedBatch(torch.randint(0, 50, (seq.numel(),), generator=gen),
                       (torch.rand(seq.numel(), generator=gen) > 0.2).long(), seq, pos)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tile", [8, 16, 128])
def test_structured_block_mask_covers_the_predicate_and_full_tiles_are_full(window, tile):
    b = _four_sequences()
    spec = MaskSpec(b.seq_ids, b.positions, sample_packed_anchors(b, 9, torch.Generator().manual_seed(3)), 4, window)
    bm = structured_block_mask(spec, tile)
    dense = dense_mask(spec)[0, 0]
    used = bm.to_dense()[0, 0]  # partial or full tiles
    q, k = torch.nonzero(dense, as_tuple=True)
    assert used[q // tile, k // tile].all()  # no allowed pair falls in a skipped tile
    n_full, full = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for i in range(n_full.numel()):  # a full tile skips mask_mod: every pair in it must be allowed
        for j in full[i, :n_full[i]].tolist():
            assert dense[i * tile:(i + 1) * tile, j * tile:(j + 1) * tile].all()
    if window is None and tile == 8:
        assert n_full.sum() > 0  # the test exercises full tiles too
    torch.testing.assert_close(bm.mask_mod(0, 0, torch.arange(spec.num_queries)[:, None],
                                           torch.arange(dense.shape[1])[None, :]), dense)


@pytest.mark.parametrize("own_blocks", [True, False])
def test_compiled_mask_tiles_equal_the_eager_ones_with_one_graph_per_layer_kind(own_blocks):
    """--compile-masks: the tiles of packs of other sizes come from one graph per window setting (every size
    dynamic from the first call), in either grad mode, and equal the eager tiles; over [context | own blocks]
    (flex) and over the context alone (flex-split), the flag passed as the masks pass it."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.objective.masks import compiled_mask_tiles, mask_tiles

    tiles = compiled_mask_tiles(backend="eager")  # the plumbing; inductor is what runs on the GPU
    torch._dynamo.reset()
    counters.clear()
    for seed, lens in enumerate([(13, 9, 11), (40, 7, 22, 30), (90, 5)]):
        b = _packed(lens, seed)
        anchors = sample_packed_anchors(b, 9, torch.Generator().manual_seed(seed))
        for window in (None, 5):
            args = (b.seq_ids, b.positions, anchors, 4, window, 16, own_blocks)
            with torch.set_grad_enabled(seed % 2 == 0):
                got = tiles(*args)
            for g, want in zip(got, mask_tiles(*args), strict=True):
                assert torch.equal(g, want)
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("kind", ["tiles", "intervals"])
def test_masks_the_compiler_fails_on_are_made_eagerly_after_one_line(kind, capsys):
    """--compile-masks where torch.compile cannot compile the mask (torch 2.11's Inductor failed on mask_tiles on a
    GPU): the eager tensors, the line said once; an error of the masks' own still raises."""
    from dflash_train.objective.masks import compiled_interval_tables, compiled_mask_tiles, interval_tables, mask_tiles

    def failing(gm, example_inputs):
        raise RuntimeError("CantSplit: no such split")

    compiled, eager = ((compiled_mask_tiles, mask_tiles) if kind == "tiles" else
                       (compiled_interval_tables, interval_tables))
    masks, last = compiled(backend=failing), (16, True) if kind == "tiles" else (16, 16)
    for seed, lens in enumerate([(13, 9, 11), (40, 7, 22, 30)]):
        b = _packed(lens, seed)
        args = (b.seq_ids, b.positions, sample_packed_anchors(b, 9, torch.Generator().manual_seed(seed)), 4, None,
                *last)
        for got, want in zip(masks(*args), eager(*args), strict=True):
            assert torch.equal(got, want)
    err = capsys.readouterr().err
    assert err.count("failed to compile") == 1 and "CantSplit: no such split" in err, err
    with pytest.raises(IndexError):
        masks(b.seq_ids, b.positions, torch.tensor([10**6]), 4, None, *last)  # an anchor past the pack


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: inductor's GPU code, what training runs"))])
def test_compiled_interval_masks_equal_the_eager_ones_with_one_graph_per_layer_kind(backend):
    """--compile-masks with the interval kernels: rows and dK/dV tables of packs of other token and anchor counts
    come from one graph per window setting, in either grad mode, and equal the eager mask's, at the recipe's
    head width's launches."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.objective.masks import compiled_interval_tables, interval_mask

    device = "cuda" if backend == "inductor" else "cpu"
    # inductor's is the objective's own (the cache's default entry), so the last check below reuses its graphs
    tables = compiled_interval_tables() if backend == "inductor" else compiled_interval_tables(backend=backend)
    torch._dynamo.reset()
    counters.clear()
    for seed, lens in enumerate([(130, 90, 111), (400, 70, 220, 300), (900, 50)]):
        b = _packed(lens, seed).to(device)
        anchors = sample_packed_anchors(b, 40, torch.Generator().manual_seed(seed)).to(device)
        for window in (None, 5):
            spec = MaskSpec(b.seq_ids, b.positions, anchors, 8, window)
            want = interval_mask(spec, 64)
            with torch.set_grad_enabled(seed % 2 == 0):
                got = tables(b.seq_ids, b.positions, anchors, 8, window, 64, 64)
            assert torch.equal(got[0], want.rows) and torch.equal(got[1], want.tile_table)
            assert got[0].dtype == got[1].dtype == torch.int32
    assert counters["stats"]["unique_graphs"] == 2
    if backend == "inductor":  # what the objective builds with --compile-masks
        compiled = interval_mask(spec, 64, compiled=True)
        assert torch.equal(compiled.rows, want.rows) and torch.equal(compiled.tile_table, want.tile_table)
        assert compiled.launch == want.launch and counters["stats"]["unique_graphs"] == 2


def test_compiled_flex_compiles_once():
    """Eager draft layers' FlexAttention (CUDA, without --compile-drafter): packs of other token, anchor and
    tile counts run on one graph, with the eager attention's output."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.models.attention import compiled_flex

    gen, cases = torch.Generator().manual_seed(0), []
    for seed, (lens, n) in enumerate([((13, 9, 11), 4), ((40, 7, 22, 30), 6), ((90, 5), 9)]):
        b = _packed(lens, seed)
        spec = MaskSpec(b.seq_ids, b.positions, sample_packed_anchors(b, n, torch.Generator().manual_seed(seed)), 4)
        q = torch.randn(1, 4, spec.num_queries, 8, generator=gen)
        k, v = (torch.randn(1, 2, spec.context_len + spec.num_queries, 8, generator=gen) for _ in range(2))
        args = (q, k, v)
        kw = {"block_mask": structured_block_mask(spec, 16), "enable_gqa": True}
        # eager FlexAttention compiles a wrapper of its own: first
        cases.append((args, kw, flex_attention(*args, **kw)))
    flex = compiled_flex(backend="eager")  # the plumbing; inductor is what runs on the GPU
    torch._dynamo.reset()
    counters.clear()
    for args, kw, want in cases:
        torch.testing.assert_close(flex(*args, **kw), want)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("window", [None, 5])
def test_structured_and_evaluated_block_masks_give_the_same_attention(window):
    """The structured mask's interval mask_mod and its tiles against MaskSpec.allowed on every pair."""
    from torch.nn.attention.flex_attention import flex_attention

    b = _four_sequences()
    spec = MaskSpec(b.seq_ids, b.positions, sample_packed_anchors(b, 9, torch.Generator().manual_seed(3)), 4, window)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, spec.num_queries, 16, generator=gen)
    kv = torch.randn(2, 1, 2, spec.context_len + spec.num_queries, 16, generator=gen)
    out = [flex_attention(q, kv[0], kv[1], block_mask=m) for m in (structured_block_mask(spec, 16),
                                                                   flex_block_mask(spec))]
    torch.testing.assert_close(out[0], out[1])


def test_loss_weights_normalise_over_labelled_slots():
    torch.manual_seed(0)
    H, V, B = 8, 11, 3
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    hidden = torch.randn(2 * B, H)
    labels = torch.tensor([IGNORE, 3, 4, IGNORE, 5, IGNORE])
    w = slot_weights(B, 2.0).repeat(2) * (labels != IGNORE)
    out = weighted_block_loss(hidden, labels, w, head, B, chunk_rows=2)
    logp = torch.log_softmax(head(hidden), -1)
    ce = torch.stack([-logp[i, labels[i]] for i in (1, 2, 4)])
    ws = torch.tensor([1.0, math.exp(-0.5), 1.0])
    torch.testing.assert_close(out.loss, (ce * ws).sum() / ws.sum())
    assert out.labelled.tolist() == [0, 2, 1]


def test_expected_acceptance_length():
    correct = torch.tensor([0.0, 8, 4, 1])
    labelled = torch.tensor([0.0, 10, 10, 10])
    assert math.isclose(expected_acceptance_length(correct, labelled).item(), 1 + 0.8 + 0.8 * 0.4 + 0.8 * 0.4 * 0.1,
                        rel_tol=1e-6)


def _objective(tiny_target, make_drafter, backend, **kw):
    drafter = make_drafter(num_layers=2, block_size=4, **kw)
    return DFlashObjective(drafter, tiny_target.embedding_weight, tiny_target.lm_head,
                           ObjectiveConfig(attention=backend, loss_chunk_rows=7))


@pytest.mark.parametrize("window", [None, 5, 2])
def test_split_attention_equals_the_joint_mask(window):
    """flex-split: FlexAttention over the context and each block's own keys apart, merged by log-sum-exp, gives
    the one-mask attention; window 2 at B=4 leaves slots 2 and 3 of some blocks no context key."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.models.attention import SplitBlockMask, attend
    from dflash_train.objective.masks import row_intervals, split_block_mask

    b = _four_sequences()
    spec = MaskSpec(b.seq_ids, b.positions, sample_packed_anchors(b, 9, torch.Generator().manual_seed(3)), 4, window)
    if window == 2:
        lo, hi = row_intervals(b.seq_ids, b.positions, spec.anchors, 4, window)[:2]
        assert (lo >= hi).any()  # rows whose context is empty
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, spec.num_queries, 16, generator=gen)
    k, v = (torch.randn(1, 2, spec.context_len + spec.num_queries, 16, generator=gen) for _ in range(2))
    split = split_block_mask(spec, 16)
    assert isinstance(split, SplitBlockMask) and split.context.seq_lengths == (spec.num_queries, spec.context_len)
    want = flex_attention(q, k, v, block_mask=structured_block_mask(spec, 16), enable_gqa=True, scale=0.25)
    torch.testing.assert_close(attend(q, k, v, split, 0.25), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sliding", [False, True])
def test_flex_and_dense_give_the_same_loss(tiny_target, make_drafter, sliding):
    """FlexAttention's keys are the context padded to a multiple of the tile (key_context: pads of no sequence,
    zero features), then the blocks; the dense backend's exact per-sequence predicate needs no pads."""
    from dflash_train.objective.masks import MASK_TILE

    kw = {"num_sliding_layers": 1, "sliding_window": 5} if sliding else {}
    b = _packed()
    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(1))
    feats = torch.randn(b.num_tokens, 3 * 64)
    dense = _objective(tiny_target, make_drafter, "dense", **kw)
    assert dense.key_context(b) is b
    for backend in ("flex", "flex-split"):
        flex = _objective(tiny_target, make_drafter, backend, **kw)
        assert flex.key_context(b).num_tokens == MASK_TILE > b.num_tokens
        with torch.no_grad():  # FlexAttention has no CPU backward; gradients are compared on CUDA below
            torch.testing.assert_close(dense(b, anchors, feats).loss, flex(b, anchors, feats).loss, rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("flex", ["flex", "flex-split", "intervals"])
def test_flex_and_dense_give_the_same_gradients_on_cuda(sliding, flex):
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.models.loading import load_target

    target = load_target("random:tiny", device="cuda", dtype=torch.float32)
    kw = {"num_sliding_layers": 1, "sliding_window": 5} if sliding else {}
    cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", **kw)
    b = _packed().to("cuda")
    anchors = sample_packed_anchors(_packed(), 4, torch.Generator().manual_seed(1)).cuda()
    feats = torch.randn(b.num_tokens, 3 * 64, device="cuda")
    grads = {}
    for backend in ("dense", flex):
        drafter = new_drafter(cfg, seed=1).float().cuda()
        obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention=backend))
        loss = obj(b, anchors, feats).loss
        loss.backward()
        grads[backend] = (loss.detach(), [p.grad for p in drafter.parameters()])
    torch.testing.assert_close(grads["dense"][0], grads[flex][0], rtol=1e-4, atol=1e-4)
    for gd, gf in zip(grads["dense"][1], grads[flex][1], strict=True):
        torch.testing.assert_close(gd, gf, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("chunk_rows", [3, 7])  # 15 rows: 5 chunks of 3; 7 + 6 + 2, not 7 + 7 + 1
def test_fused_head_loss_matches_autograd_reference(chunk_rows):
    """The chunked head+CE with its in-forward gradient equals plain autograd through F.cross_entropy."""
    torch.manual_seed(1)
    H, V, B, n = 16, 37, 4, 5
    head = torch.nn.Linear(H, V, bias=True).requires_grad_(False)
    hidden = torch.randn(n * B, H, requires_grad=True)
    labels = torch.randint(0, V, (n * B,))
    labels[::B] = IGNORE
    w = slot_weights(B, 2.0).repeat(n) * (labels != IGNORE)
    out = weighted_block_loss(hidden, labels, w, head, B, chunk_rows=chunk_rows)
    (out.loss * 2.5).backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(head(ref_h), labels.clamp_min(0), reduction="none")
    ref = (ce * w).sum() / w.sum()
    (ref * 2.5).backward()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    with torch.no_grad():
        torch.testing.assert_close(weighted_block_loss(hidden, labels, w, head, B).loss, ref)


def test_no_loss_chunk_has_one_row():
    """torch.compile specializes a size of 1: a one-row chunk would compile the loss chunk again."""
    from dflash_train.objective.loss import row_chunks

    for rows in range(0, 40):
        for chunk in (1, 2, 3, 4, 8):
            parts = row_chunks(rows, chunk)
            assert [i for sl in parts for i in range(sl.start, sl.stop)] == list(range(rows))
            assert all(sl.stop - sl.start <= chunk for sl in parts)
            if chunk > 2 and rows > 1:
                assert all(sl.stop - sl.start > 1 for sl in parts), (rows, chunk, parts)


@pytest.mark.parametrize("kd_weight", [1.0, 0.3])
def test_distillation_loss_matches_autograd_reference(kd_weight):
    """Soft labels: CE against a * softmax(W t + b) + (1 - a) * onehot, gradient included, equals autograd."""
    torch.manual_seed(3)
    H, V, B, n, S = 16, 37, 4, 5, 11
    head = torch.nn.Linear(H, V, bias=True).requires_grad_(False)
    hidden = torch.randn(n * B, H, requires_grad=True)
    states, rows = torch.randn(S, H), torch.randint(0, S, (n * B,))
    labels = torch.randint(0, V, (n * B,))
    labels[::B] = IGNORE
    labels[5] = IGNORE  # an unlabelled slot inside a block: weight 0, no teacher term either
    w = slot_weights(B, 2.0).repeat(n) * (labels != IGNORE)
    out = weighted_block_loss(hidden, labels, w, head, B, chunk_rows=3, teacher=(states, rows, kd_weight))
    out.loss.backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    logq = torch.log_softmax(head(ref_h), -1)
    p = torch.softmax(head(states[rows]), -1)
    soft = -(p * logq).sum(-1)
    hard = torch.nn.functional.nll_loss(logq, labels.clamp_min(0), reduction="none")
    ref = ((kd_weight * soft + (1 - kd_weight) * hard) * w).sum() / w.sum()
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)


def test_distillation_reads_the_target_at_the_position_before_each_label(tiny_target, make_drafter):
    """With the target's final hidden states appended to the features, slot k of the block at
    anchor a distils the target's logits at a + k - 1: a teacher that puts all its mass on the
    true next token gives exactly the hard-label loss."""
    b = _packed()
    anchors = sample_packed_anchors(b, 4, torch.Generator().manual_seed(1))
    feats = torch.randn(b.num_tokens, 3 * 64)
    drafter = make_drafter(num_layers=2, block_size=4)
    # final[i] is a scaled copy of the head row of token i+1 (the next token in the row), so
    # softmax(W final[i]) is one-hot on that token to float precision
    nxt = torch.cat([b.input_ids[1:], b.input_ids[-1:]])
    final = tiny_target.lm_head.weight[nxt] * 1e4
    hard = DFlashObjective(drafter, tiny_target.embedding_weight, tiny_target.lm_head,
                           ObjectiveConfig(attention="dense"))
    kd = DFlashObjective(drafter, tiny_target.embedding_weight, tiny_target.lm_head,
                         ObjectiveConfig(attention="dense", kd_weight=1.0))
    with torch.no_grad():
        want = hard(b, anchors, feats)
        got = kd(b, anchors, torch.cat([feats, final], dim=1))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.correct, want.correct)


def test_feature_layers_gain_the_last_target_layer_for_distillation(make_drafter):
    from dflash_train.objective.objective import feature_layer_ids

    cfg = make_drafter().config
    assert feature_layer_ids(cfg, kd=False) == list(cfg.target_layer_ids)
    assert feature_layer_ids(cfg, kd=True) == [*cfg.target_layer_ids, cfg.num_target_layers - 1]


def _chunk_inputs(device="cpu", dtype=torch.bfloat16):
    torch.manual_seed(2)
    logits = (torch.randn(9, 301) * 4).to(device=device, dtype=dtype)
    bias = torch.randn(301, device=device, dtype=dtype)
    labels = torch.randint(0, 301, (9,), device=device)
    labels[::4] = IGNORE
    return logits, bias, labels, torch.rand(9, device=device) * (labels != IGNORE)


def test_fused_chunk_math_equals_the_in_place_chunk():
    """The function compiled on CUDA computes what the CPU's in-place code computes."""
    from dflash_train.objective.loss import _chunk_ce, _eager_chunk_ce

    args = _chunk_inputs()
    for a, b in zip(_chunk_ce(*args), _eager_chunk_ce(*args, need_grad=True), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
@interpreted
def test_the_chunk_kernel_computes_the_chunk_math():
    """ce_kernel's one-pass kernel (Triton's interpreter, on the CPU) against _chunk_ce: a vocabulary of several
    blocks and a short last one, with and without a bias, float32 and float16 logits, ignored rows, a tie for the
    maximum (the first index wins, as torch's argmax), a label on the last column."""
    run_interpreted("""
        import torch
        from dflash_train.objective import ce_kernel
        from dflash_train.objective.blocks import IGNORE
        from dflash_train.objective.loss import _chunk_ce

        torch.manual_seed(2)
        vocab = 2 * ce_kernel.BLOCK_V + 301
        for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
            logits = (torch.randn(7, vocab) * 4).to(dtype)
            logits[1, [5, ce_kernel.BLOCK_V + 9]] = 40.0  # a tie across blocks
            labels = torch.randint(0, vocab, (7,))
            labels[1], labels[2], labels[3] = 5, vocab - 1, IGNORE
            weights = torch.rand(7) * (labels != IGNORE)
            for bias in (None, torch.randn(vocab).to(dtype)):
                got = ce_kernel.chunk_ce(logits, bias, labels, weights)
                want = _chunk_ce(logits, bias, labels, weights)
                assert abs(got[0].item() - want[0].item()) <= tol * abs(want[0].item()), (got[0], want[0])
                assert torch.equal(got[1], want[1]) and not got[1][3]
                assert got[1][1] or bias is not None  # the tie's first index, 5, is the label (a bias breaks it)
                assert got[2].dtype == dtype
                torch.testing.assert_close(got[2].float(), want[2].float(), rtol=tol, atol=tol)
        # a first block of -inf logits (a bias masking words out): finite, as the reference
        bias = torch.zeros(vocab)
        bias[:ce_kernel.BLOCK_V] = float("-inf")
        labels = torch.full((7,), vocab - 1)
        got, want = ce_kernel.chunk_ce(logits, bias, labels, weights), _chunk_ce(logits, bias, labels, weights)
        assert torch.isfinite(got[0]) and abs(got[0].item() - want[0].item()) <= 1e-3 * abs(want[0].item())
        torch.testing.assert_close(got[2].float(), want[2].float(), rtol=1e-3, atol=1e-3)
        """)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the chunk kernel runs on CUDA")
def test_the_chunk_kernel_equals_the_eager_chunk_on_cuda():
    from dflash_train.objective import ce_kernel
    from dflash_train.objective.loss import _eager_chunk_ce

    args = _chunk_inputs("cuda")
    ce, correct, grad = ce_kernel.chunk_ce(*args)
    ref_ce, ref_correct, ref_grad = _eager_chunk_ce(*args, need_grad=True)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, ref_correct)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk runs on CUDA")
def test_compiled_distillation_chunk_equals_the_eager_one_on_cuda():
    from dflash_train.objective.loss import _chunk_kd, _compiled_kd

    logits, bias, labels, weights = _chunk_inputs("cuda")
    teacher = torch.randn_like(logits.float()).mul(4).to(logits.dtype)
    got = _compiled_kd()(logits, teacher, bias, labels, weights, 0.5)
    want = _chunk_kd(logits, teacher, bias, labels, weights, 0.5)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_segmented_mask_equals_dense_mask(window):
    from dflash_train.objective.masks import segmented_mask

    b = _packed()
    anchors = sample_packed_anchors(b, 3, torch.Generator().manual_seed(4))
    spec = MaskSpec(b.seq_ids, b.positions, anchors, 4, window)
    assert torch.equal(segmented_mask(spec).to_dense(spec.num_queries), dense_mask(spec)[0, 0])


def test_segmented_attention_equals_dense_attention():
    from dflash_train.models.attention import attend
    from dflash_train.objective.masks import segmented_mask

    b = _packed()
    anchors = sample_packed_anchors(b, 3, torch.Generator().manual_seed(4))
    spec = MaskSpec(b.seq_ids, b.positions, anchors, 4)
    n, m = spec.num_queries, spec.context_len + spec.num_queries
    q, k, v = torch.randn(1, 4, n, 8), torch.randn(1, 2, m, 8), torch.randn(1, 2, m, 8)
    torch.testing.assert_close(attend(q, k, v, segmented_mask(spec), 0.3), attend(q, k, v, dense_mask(spec), 0.3))


def _loss_and_grads(obj, batches):
    out = []
    for b, anchors, feats in batches:
        obj.drafter.zero_grad()
        loss = obj(b, anchors, feats).loss
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in obj.drafter.parameters()]))
    return out


def _batches(device="cpu", width=3 * 64):
    out = []
    for seed, lens in enumerate([(13, 9, 11), (20, 7), (5, 17, 9, 12)]):
        b = _packed(lens, seed).to(device)
        anchors = sample_packed_anchors(_packed(lens, seed), 4, torch.Generator().manual_seed(seed)).to(device)
        out.append((b, anchors, torch.randn(b.num_tokens, width, device=device)))
    return out


@pytest.mark.parametrize("stack", [False, True])
def test_compiled_draft_layers_give_the_same_loss_and_gradients(tiny_target, make_drafter, stack):
    """--compile-drafter's plumbing (inductor is what runs on the GPU): every layer's forward compiled (with
    --compile-stack the loop over them), the same loss and gradients on packs of three shapes, the eager forward
    back on exit."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    obj = _objective(tiny_target, make_drafter, "dense", num_sliding_layers=1, sliding_window=5)
    batches = _batches()
    want = _loss_and_grads(obj, batches)
    torch._dynamo.reset()
    counters.clear()
    with obj.drafter.compiled_layers(backend="eager", stack=stack):
        got = _loss_and_grads(obj, batches)
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    for (lg, gg), (lw, gw) in zip(got, want, strict=True):
        torch.testing.assert_close(lg, lw, rtol=1e-6, atol=1e-6)
        for a, b in zip(gg, gw, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all("forward" not in vars(m) for m in [obj.drafter.layers, *obj.drafter.layers])


@pytest.mark.parametrize("backend,stack", [("flex", False), ("flex-split", False), ("flex", True)])
def test_compiled_draft_layers_compile_once_per_layer_kind(tiny_target, make_drafter, backend, stack):
    """--compile-drafter on packs of new shapes (token counts, tile counts, anchors): one graph per layer kind
    (full, sliding), not a static one first, and under flex-split the block size a constant in them; with
    --compile-stack one graph for both. Forward only: FlexAttention has no CPU backward."""
    import torch._dynamo
    from torch._dynamo.testing import EagerAndRecordGraphs
    from torch._dynamo.utils import counters

    obj = _objective(tiny_target, make_drafter, backend, num_sliding_layers=1, sliding_window=64)
    torch._dynamo.reset()
    counters.clear()
    graphs = EagerAndRecordGraphs()
    with torch.no_grad(), obj.drafter.compiled_layers(backend=graphs, stack=stack):
        for seed, lens in enumerate([(300, 150), (90, 400, 220), (520, 60)]):  # 1-3 tiles of 128 queries
            b = _packed(lens, seed)
            obj(b, sample_packed_anchors(b, 20 + 15 * seed, torch.Generator().manual_seed(seed)),
                torch.randn(b.num_tokens, 3 * 64))
    assert counters["stats"]["unique_graphs"] == (1 if stack else 2)
    # the block size is a constant of the graphs, never a symbol: Inductor's CUDA codegen could not prove
    # the queries a multiple of a symbolic one (CantSplit)
    blocks = [node.meta["example_value"].shape[-2] for g in graphs.graphs for node in g.graph.nodes
              if node.target == "view" and len(node.meta["example_value"].shape) == 5]
    assert [(type(n), int(n)) for n in blocks] == ([(int, 4)] * 3 * 2 if backend == "flex-split" else [])


def test_validation_of_compiled_layers_runs_on_the_training_graphs(tiny_target, make_drafter):
    """Validation under --compile-drafter: torch.compile guards on the grad mode, so a no-grad forward of
    layers compiled in the grad mode compiles a layer graph of its own. The drafter loop validates compiled
    layers in the grad mode instead: new pack sizes compile nothing, and the loss is the eager no-grad one.
    Eager layers validate without grad. (The grad mode without grads: FlexAttention has no CPU backward.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.training.drafter_loop import DrafterTrainLoop

    def mode(compiled: bool) -> bool:  # the grad mode the drafter loop validates in, entered under no_grad
        loop = DrafterTrainLoop.__new__(DrafterTrainLoop)  # its mode alone: no model, no run directory
        loop.compile_drafter = compiled
        with torch.no_grad(), loop._validation_mode():
            return torch.is_grad_enabled()

    assert mode(compiled=True) and not mode(compiled=False)
    obj = _objective(tiny_target, make_drafter, "flex")
    obj.drafter.requires_grad_(False)

    def loss(seed, lens):
        b = _packed(lens, seed)
        return obj(b, sample_packed_anchors(b, 20, torch.Generator().manual_seed(seed)),
                   torch.randn(b.num_tokens, 3 * 64, generator=torch.Generator().manual_seed(seed))).loss

    with torch.no_grad():
        eager = loss(0, (300, 150))
    torch._dynamo.reset()
    counters.clear()
    with obj.drafter.compiled_layers(backend="eager"):
        loss(1, (90, 400, 220))  # training's mode
        graphs = counters["stats"]["unique_graphs"]
        with torch.enable_grad():  # the validation's mode
            torch.testing.assert_close(loss(0, (300, 150)), eager)
            loss(2, (200, 90, 60))
        assert counters["stats"]["unique_graphs"] == graphs
        with torch.no_grad():
            loss(2, (200, 90, 60))  # what the grad mode saves: the layer graph again, for the no-grad mode
        assert counters["stats"]["unique_graphs"] > graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention runs on CUDA")
def test_compiled_draft_layers_equal_the_eager_ones_on_cuda():
    """Inductor with FlexAttention traced into each layer: the loss and gradients of the eager layers."""
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.models.loading import load_target

    target = load_target("random:tiny", device="cuda", dtype=torch.float32)
    cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", num_sliding_layers=1,
                             sliding_window=5)
    drafter = new_drafter(cfg, seed=1).float().cuda()
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="flex"))
    batches = _batches("cuda")
    want = _loss_and_grads(obj, batches)
    with drafter.compiled_layers():
        got = _loss_and_grads(obj, batches)
    for (lg, gg), (lw, gw) in zip(got, want, strict=True):
        torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)
        for a, b in zip(gg, gw, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_a_training_step_is_queued_without_a_host_sync_on_cuda():
    """The step (host pack to the GPU, blocks, masks, forward, backward, clip, AdamW) never waits for the GPU,
    so the host queues step n+1 while the GPU still runs step n (a blocking host-to-device copy would wait)."""
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.models.loading import load_target
    from dflash_train.training.update import Update, cosine_schedule, make_optimizer

    target = load_target("random:tiny", device="cuda", dtype=torch.float32)
    cfg = drafter_config_for(target, num_layers=2, block_size=4, dtype="float32", num_sliding_layers=1,
                             sliding_window=5)
    drafter = new_drafter(cfg, seed=1).float().cuda()
    obj = DFlashObjective(drafter, target.embedding_weight, target.lm_head, ObjectiveConfig(attention="flex"))
    opt = make_optimizer(drafter, 1e-3, 0.0)
    update = Update(obj, opt, torch.optim.lr_scheduler.LambdaLR(opt, cosine_schedule(10, 0.1)), grad_clip=1.0)
    host = _packed()
    anchors = sample_packed_anchors(host, 4, torch.Generator().manual_seed(1))
    feats = torch.randn(host.num_tokens, 3 * 64, device="cuda")

    def step():  # as Trainer._step moves a pack
        update.micro(host.to("cuda"), anchors.to("cuda", non_blocking=True), feats)
        update.step()

    step()  # compiles and creates the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compiled_draft_layers_are_refused_off_cuda(tiny_target, make_drafter, tmp_path):
    """At the flag with --device cpu or --attention dense; at the drafter's device when --device auto lands on a CPU."""
    from dflash_train.errors import UsageError
    from dflash_train.settings.tree import TrainConfig
    from dflash_train.training.drafter_loop import DrafterTrainLoop

    with pytest.raises(UsageError, match="--compile-drafter"):
        TrainConfig.of(run_dir=str(tmp_path), compile_drafter=True, device="cpu")
    with pytest.raises(UsageError, match="--compile-drafter.*--attention dense"):
        TrainConfig.of(run_dir=str(tmp_path), compile_drafter=True, device="cuda", attention="dense")
    with pytest.raises(UsageError, match="--compile-masks.*--device cpu"):
        TrainConfig.of(run_dir=str(tmp_path), compile_masks=True, device="cpu")
    with pytest.raises(UsageError, match="--compile-masks.*--attention dense"):
        TrainConfig.of(run_dir=str(tmp_path), compile_masks=True, device="cuda", attention="dense")
    # --compile-stack shapes what --compile-drafter compiles; without it (a CPU line over the shipped config): inert
    inert = TrainConfig.of(run_dir=str(tmp_path), compile_stack=True, device="cpu")
    loop = DrafterTrainLoop(inert.optimizer, inert.trainer, inert.objective, make_drafter(),
                            tiny_target.embedding_weight, tiny_target.lm_head, tmp_path, 1, compile_drafter=False,
                            compile_stack=True)
    assert not loop.compile_stack
    cfg = TrainConfig.of(run_dir=str(tmp_path), compile_drafter=True, device="auto")
    with pytest.raises(UsageError, match="--compile-drafter"):
        DrafterTrainLoop(cfg.optimizer, cfg.trainer, cfg.objective, make_drafter(), tiny_target.embedding_weight,
                         tiny_target.lm_head, tmp_path, 1, compile_drafter=cfg.trainer.compile_drafter)
    # compiled masks are FlexAttention's and the interval kernels': refused where the resolved backend is another
    # (auto picks dense on a CPU)
    with pytest.raises(UsageError, match="--compile-masks: .* runs dense .*pass --attention intervals or flex"):
        DrafterTrainLoop(cfg.optimizer, cfg.trainer, cfg.objective, make_drafter(), tiny_target.embedding_weight,
                         tiny_target.lm_head, tmp_path, 1, compile_masks=True)


def test_auto_attention_picks_the_interval_kernels_on_cuda_where_they_take_the_heads(monkeypatch):
    """auto: intervals on the GPUs their launches were tuned on, for heads of 16-128 (a power of two);
    FlexAttention on other GPUs and for other heads (Gemma 3's 256); dense off CUDA; a named backend stays."""
    from dflash_train.models import interval_attention
    from dflash_train.objective.objective import resolve_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(interval_attention, "tuned_for", lambda device: True)  # an H100, without a GPU
    assert [resolve_backend("auto", cuda, d) for d in (16, 64, 128)] == ["intervals"] * 3
    assert [resolve_backend("auto", cuda, d) for d in (80, 256)] == ["flex"] * 2
    monkeypatch.setattr(interval_attention, "tuned_for", lambda device: False)  # an L4, an A100
    assert resolve_backend("auto", cuda, 64) == "flex"
    assert resolve_backend("auto", cpu, 64) == "dense"
    assert [resolve_backend(a, cuda, 256) for a in ("flex", "flex-split", "dense")] == ["flex", "flex-split", "dense"]
