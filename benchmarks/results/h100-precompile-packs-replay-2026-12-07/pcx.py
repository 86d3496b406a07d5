"""precompile's steps, timed, with Inductor's cache counts and torch's compile-time table (the record's commands.txt).

    python3 pcx.py SPEC stack|layers equal|varied SEED
"""

import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402  (timed: the imports are part of a fresh process's cost)
from torch._dynamo.utils import compile_times  # noqa: E402

from dflash_train.app import precompile  # noqa: E402
from dflash_train.data.synthetic import SyntheticSequences  # noqa: E402
from dflash_train.pipeline.stream import PackStream  # noqa: E402
from dflash_train.profiling import compiles  # noqa: E402


def equal_packs(spec: dict) -> list:
    """The pack precompile ran before: one pack of equal sequences of --max-length tokens."""
    n = min(spec["max_length"], spec["token_budget"])
    data = SyntheticSequences(max(1, spec["token_budget"] // n), n, spec["vocab"], spec["seed"])
    return list(PackStream(data, spec["token_budget"], spec["objective"]["num_anchors"], spec["seed"], 1).packs(1))


spec = json.load(open(sys.argv[1]))
spec["compile_stack"] = sys.argv[2] == "stack"
spec["seed"] = int(sys.argv[4])
if sys.argv[3] == "equal":
    precompile.packs = equal_packs
t1 = time.perf_counter()
torch.zeros(1, device="cuda")
t2 = time.perf_counter()
loss = precompile.run(spec)
torch.cuda.synchronize()
t3 = time.perf_counter()
c = compiles.snapshot()
print(f"imports {t1 - t0:.1f} s, cuda init {t2 - t1:.1f} s, steps {t3 - t2:.1f} s, loss {loss:.3f}, "
      f"hits {c['cache_hits']} misses {c['cache_misses']}")
print(compile_times(repr="str", aggregate=True)[:2500])
