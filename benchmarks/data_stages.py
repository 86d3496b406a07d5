"""The train job's host-side data stages on the embedded target: their tokenizer work, batched or not.

    python3 benchmarks/data_stages.py --json OUT.json
    python3 benchmarks/data_stages.py --prepare 3000 --regen-prompts 3000
    # plumbing:
    python3 benchmarks/data_stages.py --target random:tiny --conversations 500 --regen-prompts 20 --prepare 20

Before regeneration the job measures every ShareGPT first prompt against
--regen-max-prompt-tokens (`data/selection.py`); regeneration renders each turn's prompts
(`data/regenerate.py`); preparation tokenizes every conversation with offsets
(`data/dataset.py`). Each is timed here the way the job runs it (one tokenizer call per batch:
chat.render_chats, tokenize.encode_chats) and one conversation at a time (the loops before
2026-12-02: one unbatched apply_chat_template call per prompt; encode_chat, a batch of one, for
preparation, which is the old call's work), with a check that both give the same tokens;
preparation once more in default_workers() processes where that is more than one (data/parallel.py). The
batched selection also skips tokenizing prompts too long by their characters alone; the one at
a time column tokenizes every one, as the old loop did. CPU only, no GPU needed: the tokenizer
spreads a batch over every core, so the ratio grows with the core count (`cores` in the output).
Regeneration's prompts are stood in for by ShareGPT's own first three turns (user, assistant,
user, ...; up to 4,000 characters), the histories the regenerated later turns grow into.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from dflash_train.data.conversations import first_prompt
from dflash_train.data.dataset import prepare_dataset
from dflash_train.data.parallel import default_workers
from dflash_train.data.selection import select_conversations
from dflash_train.data.sources import Conversation, SourceReport, default_split, iter_conversations
from dflash_train.data.tokenize import encode_chat, encode_chats, end_of_turn_ids, template_ids
from dflash_train.files import write_atomic
from dflash_train.models.chat import render_chats
from dflash_train.models.loading import load_target


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 2)


def _histories(convs: list[Conversation], turns: int, max_chars: int) -> list[list[dict[str, str]]]:
    out = []
    for c in convs:
        m = c.messages[:turns]
        if len(m) == turns and m[0]["role"] == "user" and sum(len(x["content"]) for x in m) <= max_chars:
            out.append(m)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--regen-prompts", type=int, default=3000, help="turn-3 prompts rendered (regeneration)")
    ap.add_argument("--prepare", type=int, default=3000, help="three-turn conversations prepared")
    ap.add_argument("--conversations", type=int, default=0,
                    help="ShareGPT's first N train conversations only (default 0: all; a check of the script)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    target = load_target(args.target, device="cpu")
    tok = target.tokenizer
    convs = list(iter_conversations("sharegpt", split=default_split("sharegpt"), on_bad="skip", report=SourceReport(),
                                    require_assistant=False))
    convs = convs[:args.conversations] if args.conversations > 0 else convs
    command = "python3 benchmarks/data_stages.py " + " ".join(sys.argv[1:] if argv is None else argv)
    out: dict[str, object] = {"target": args.target, "cores": os.cpu_count(), "date": date.today().isoformat(),
                              "command": command}

    picked, out["select_batched_s"] = _timed(lambda: select_conversations(
        iter(convs), SourceReport(), topic="any", limit=0, target=target, max_prompt_tokens=args.max_prompt_tokens))
    _, out["select_one_at_a_time_s"] = _timed(
        lambda: [len(template_ids(tok, first_prompt(c.messages), True)) for c in convs])
    out["select_conversations"] = f"{len(picked)} of {len(convs)}"

    prompts = _histories(convs, 5, 4000)[:args.regen_prompts]  # user, assistant, user, assistant, user
    alone, out["regen_render_one_at_a_time_s"] = _timed(lambda: [template_ids(tok, p, True) for p in prompts])
    batched, out["regen_render_batched_s"] = _timed(lambda: render_chats(target, prompts))
    assert alone == batched, "batched rendering must give the same tokens"
    out["regen_prompts"] = len(prompts)
    out["regen_prompt_tokens_mean"] = round(sum(map(len, alone)) / max(len(alone), 1), 1)

    chats = [Conversation(f"p{i}", m) for i, m in enumerate(_histories(convs, 6, 5000)[:args.prepare])]
    stops = end_of_turn_ids(target.tokenizer)
    one_by_one, out["prepare_encode_one_at_a_time_s"] = _timed(
        lambda: [encode_chat(target.tokenizer, c.messages, stop_ids=stops) for c in chats])
    together, out["prepare_encode_batched_s"] = _timed(
        lambda: encode_chats(target.tokenizer, [c.messages for c in chats], stop_ids=stops))
    assert one_by_one == together, "batched encoding must give the same tokens and masks"
    with tempfile.TemporaryDirectory() as tmp:
        rep, out["prepare_dataset_s"] = _timed(lambda: prepare_dataset(target.tokenizer, chats, Path(tmp) / "d",
                                                                       max_length=1024, on_bad="skip"))
        out["prepare_workers"] = workers = default_workers()  # what `prepare` and the train job use here
        if workers > 1:
            _, out["prepare_dataset_workers_s"] = _timed(lambda: prepare_dataset(
                target.tokenizer, chats, Path(tmp) / "w", max_length=1024, on_bad="skip", workers=workers))
    out["prepare"] = rep.summary()

    print(json.dumps(out, indent=1))
    if args.json:
        write_atomic(Path(args.json), lambda f: f.write((json.dumps(out, indent=1) + "\n").encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
