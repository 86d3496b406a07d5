"""Metrics through one place: RUN_DIR/metrics.jsonl, TensorBoard (RUN_DIR/tb) and the progress bar
(loss, expected tau, tokens/s and, on CUDA, MFU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True) -> None:
        from torch.utils.tensorboard import SummaryWriter

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        _drop_records_after(self.path, start_step)  # a resumed run rewrites what came after its checkpoint
        self.file = open(self.path, "a", encoding="utf-8")
        self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress,
                        dynamic_ncols=True)

    def advance(self, steps: int = 1) -> None:
        self.bar.update(steps)

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        for key, value in record.items():
            if key == "step":
                continue
            tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"  # held-out values apart
            if isinstance(value, (int, float)):
                self.tb.add_scalar(tag, value, step)
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    self.tb.add_scalar(f"{tag}/{i}", v, step)
        mfu = {"mfu": f"{record['mfu']:.3f}"} if record.get("mfu") is not None else {}  # CUDA only
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}",
                             tok_s=f"{record['target_tokens_per_s']:.0f}", **mfu, refresh=False)

    def close(self) -> None:
        self.bar.close()
        self.tb.close()
        self.file.close()


def _drop_records_after(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line from a killed run
    path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
