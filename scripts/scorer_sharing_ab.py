"""The compiled scorer alone, shared contexts off against on, in one process: interleaved repeats
on the same 400 token requests shaped like `torchlyra bench eval`'s (100 contexts of 14-44
tokens, 4 continuations of 3-15 each; `tiny`, vocabulary 1024, random weights, kernels auto):

    python scripts/scorer_sharing_ab.py BATCH_SIZES REPEATS [KERNELS]     (e.g. 1,16 7 moe=xla)
"""
import statistics
import sys
import time

import numpy as np
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from train.evaluation.scorer import CompiledScorer
from train.evaluation.requests import LoglikelihoodRequest
cfg = get_preset("tiny").replace(vocab_size=1024)
torch.manual_seed(0)
model = GptOssForCausalLM(cfg).eval()
rng = np.random.default_rng(0)
reqs = []
for d in range(100):
    c = tuple(rng.integers(0, 1024, int(rng.integers(14, 45))).tolist())
    for k in range(4):
        reqs.append(LoglikelihoodRequest(c, tuple(rng.integers(0, 1024, int(rng.integers(3, 16))).tolist())))
repeats = int(sys.argv[2])
kernels = sys.argv[3] if len(sys.argv) > 3 else "auto"
for bs in [int(b) for b in sys.argv[1].split(",")]:
    scorers = {share: CompiledScorer(model, batch_size=bs, kernels=kernels, progress=False, share_contexts=share)
               for share in (False, True)}
    times = {share: [] for share in scorers}
    for s in scorers.values():
        s.loglikelihood(reqs)
    for rep in range(repeats):
        for share, s in (scorers.items() if rep % 2 == 0 else list(scorers.items())[::-1]):
            started = time.perf_counter()
            s.loglikelihood(reqs)
            times[share].append(time.perf_counter() - started)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"batch {bs}: sharing off {off:.3f} s, on {on:.3f} s: {off / on:.2f}x "
          f"(off {min(times[False]):.3f}-{max(times[False]):.3f}, on {min(times[True]):.3f}-{max(times[True]):.3f})",
          flush=True)
