"""Target tensor parallelism on CPU (gloo): TP=2 features equal TP=1's, sharded loading, refusals."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.data.packing import PackedBatch
from dflash_train.errors import UsageError
from dflash_train.models.loading import byte_tokenizer, load_target
from dflash_train.models.sharded_loading import SafetensorsShards, load_sharded_target
from dflash_train.models.tp_plan import check_tp_size, tensor_plan
from dflash_train.pipeline.features import packed_features

LAYERS = [0, 1, 2]  # id 2 = the last layer: the final norm is applied there too
_SMALL = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256)


def tiny_configs() -> dict:
    from transformers import Gemma3TextConfig, GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    return {
        "llama": LlamaConfig(intermediate_size=96, **_SMALL),
        "qwen3": Qwen3Config(intermediate_size=96, **_SMALL),
        "qwen3_moe": Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True, **_SMALL),
        "gemma3": Gemma3TextConfig(intermediate_size=96, sliding_window=8, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], **_SMALL),
        "gpt_oss": GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                **_SMALL),
        # every layer full attention: the document attention with sinks and no sliding mask
        "gpt_oss_full": GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["full_attention"] * 3, **_SMALL),
    }


TP_ARCHS = ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss", "gpt_oss_full"]


def save_tiny(model_type: str, out) -> str:
    """A tiny random model as an HF directory in several safetensors shards."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_configs()[model_type], dtype=torch.float32)
    # biases and gpt_oss's sinks random: the initializer's zeros (sinks near zero) would let a wrong sink slice
    # or a bias summed on every rank pass
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 1.0)
    model.save_pretrained(str(out), max_shard_size="40KB")
    byte_tokenizer().save_pretrained(str(out))
    return str(out)


def packed_batch() -> PackedBatch:
    lengths = [11, 7, 14]  # unequal: a document mask (dense on CPU) keeps them apart; 11 and 14 outrun the window of 8
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (sum(lengths),), generator=gen)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(ids, torch.ones_like(ids), seq, pos)


def _tp_worker(rank: int, world: int, rdv: str, dirs: dict[str, str], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
    try:
        results = {}
        for name, path in dirs.items():
            target = load_sharded_target(path, dist.group.WORLD, "cpu", dtype=torch.float32)
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                        for p in target.model.parameters())
            # the packed row's document masks for every architecture here: full and sliding layers (gemma3,
            # gpt_oss), each rank with its heads' sinks
            assert target.takes_document_mask
            modes = ("padded", "dense")
            feats = {mode: packed_features(target, packed_batch(), LAYERS, mode=mode) for mode in modes}
            layer = target.decoder.layers[0]
            experts, sinks = getattr(layer.mlp, "experts", None), getattr(layer.self_attn, "sinks", None)
            results[name] = dict(feats=feats, local=local, total=sum(p.numel() for p in target.model.parameters()),
                                 experts=None if experts is None else experts.gate_up_proj.to_local().shape,
                                 sinks=None if sinks is None else sinks.to_local().tolist())
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # Without interpreter teardown, as the launcher's workers end (pipeline/worker.py): with the group's
    # threads alive at exit, a gloo rank can abort in std::terminate after its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    return {name: save_tiny(name, root / name) for name in TP_ARCHS}


@pytest.mark.slow
def test_tp2_features_equal_tp1_for_every_architecture_with_a_plan(tiny_dirs, tmp_path):
    specs = {**tiny_dirs, "random:tiny": "random:tiny"}
    mp.start_processes(_tp_worker, args=(2, str(tmp_path / "rdv"), specs, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    with _group_of_one(tmp_path / "rdv1"):  # random weights: drawn per parameter, equal for every TP size
        whole = load_sharded_target("random:tiny", dist.group.WORLD, "cpu", dtype=torch.float32)
        ref = packed_features(whole, packed_batch(), LAYERS, mode="dense")
        for r in ranks:
            torch.testing.assert_close(r["random:tiny"]["feats"]["dense"], ref, atol=1e-5, rtol=1e-5)
    for name, path in tiny_dirs.items():
        whole = load_target(path, dtype=torch.float32)
        total = sum(p.numel() for p in whole.model.parameters())
        assert list(ranks[0][name]["feats"]) == ["padded", "dense"]
        refs = {mode: packed_features(whole, packed_batch(), LAYERS, mode=mode) for mode in ranks[0][name]["feats"]}
        for mode, ref in refs.items():
            torch.testing.assert_close(ref, refs["padded"], atol=1e-5, rtol=1e-5)  # the document mask is exact
            for r in ranks:  # replicated: every rank has the full features
                torch.testing.assert_close(r[name]["feats"][mode], ref, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, n=name, md=mode: f"{n} {md}: {m}")
        assert ranks[0][name]["local"] < total  # the split weights are held once across the group
    assert ranks[0]["random:tiny"]["local"] < ranks[0]["random:tiny"]["total"]
    assert ranks[0]["qwen3_moe"]["experts"] == (4, 32, 64)  # [E, 2I/2, H]: half of gate and of up per rank
    assert ranks[0]["gpt_oss"]["experts"] == (4, 64, 32)  # [E, H, 2I/2]: interleaved, half of the units per rank
    sinks = load_target(tiny_dirs["gpt_oss"], dtype=torch.float32).decoder.layers[0].self_attn.sinks.tolist()
    assert [ranks[0]["gpt_oss"]["sinks"], ranks[1]["gpt_oss"]["sinks"]] == [sinks[:2], sinks[2:]]  # with their heads


@pytest.mark.slow
def test_a_group_larger_than_the_kv_heads_repeats_them_and_keeps_the_features(tiny_dirs, tmp_path):
    """TP=4 over 2 KV heads: each rank holds one copy of its query heads' KV head; features equal TP=1's."""
    names = ("llama", "qwen3_moe", "gpt_oss")
    specs = {name: tiny_dirs[name] for name in names}
    mp.start_processes(_tp_worker, args=(4, str(tmp_path / "rdv"), specs, str(tmp_path)), nprocs=4,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for name in names:
        ref = packed_features(load_target(tiny_dirs[name], dtype=torch.float32), packed_batch(), LAYERS, mode="padded")
        for r in ranks:
            torch.testing.assert_close(r[name]["feats"]["padded"], ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_the_sharded_loader_reads_several_shards_and_equals_the_ordinary_loader(tiny_dirs, tmp_path):
    """A group of one: the meta build and the per-slice reads give the same target as load_target."""
    assert len(list(os.scandir(tiny_dirs["qwen3_moe"]))) > 4  # several safetensors shards
    with _group_of_one(tmp_path / "rdv"):
        for name in ("qwen3_moe", "gemma3"):
            sharded = load_sharded_target(tiny_dirs[name], dist.group.WORLD, "cpu", dtype=torch.float32)
            whole = load_target(tiny_dirs[name], dtype=torch.float32)
            torch.testing.assert_close(packed_features(sharded, packed_batch(), LAYERS, mode="padded"),
                                       packed_features(whole, packed_batch(), LAYERS, mode="padded"))


@contextlib.contextmanager
def _group_of_one(rdv):
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_architecture_without_a_plan_is_refused_in_one_line():
    from transformers import GPT2Config

    with pytest.raises(UsageError, match=r"no tensor-parallel plan for gpt2.*--target-tp 1") as e:
        tensor_plan(GPT2Config(n_layer=1))
    assert "\n" not in str(e.value)


def test_mxfp4_experts_are_refused_in_one_line_naming_the_fix(tmp_path):
    """The published gpt-oss checkpoints store experts as MXFP4 blocks and scales, not the module's weights."""
    from safetensors.torch import save_file

    name = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({f"{name}_blocks": torch.zeros(2, 8, 2, 16, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UsageError, match="MXFP4.*bf16") as e:
        SafetensorsShards(tmp_path, "--target").read(name, torch.Size([2, 64, 8]), None)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field, tp, numbers", [("num_key_value_heads", 3, ("3", "8 KV heads")),
                                                ("num_attention_heads", 3, ("3", "4 attention heads")),
                                                ("moe_intermediate_size", 3, ("3", "32 expert MLP"))])
def test_a_tp_size_that_does_not_divide_is_refused_naming_both_numbers(field, tp, numbers):
    cfg = tiny_configs()["qwen3_moe"]
    if field == "moe_intermediate_size":
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 6, 3, 96
    if field == "num_key_value_heads":  # neither a divisor nor a multiple of 8 (a multiple repeats the KV heads)
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size = 12, 8, 96
    with pytest.raises(UsageError) as e:
        check_tp_size(cfg, tp)
    msg = str(e.value)
    assert "\n" not in msg and f"--target-tp {numbers[0]}" in msg and numbers[1] in msg
