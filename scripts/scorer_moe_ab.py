"""Our lm-eval backend on `bench eval`'s synthetic few-shot task, one process, interleaved repeats:
the MoE kernel of the scoring programs side by side (medians, seconds per 400 requests), and
(`--calls`) each program call timed alone, blocking on its result (not how the scorer runs: it
dispatches batches ahead):

    python scripts/scorer_moe_ab.py SHOTS [--calls]        (e.g. 3; BENCHMARKS.md, issue 23)
"""
import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from train.bench import evaluation as bench
from train.evaluation.lm_eval_backend import TorchlyraLM

KERNELS = ("moe=loop", "moe=xla")


def timed_calls(lm, instances):
    """Median ms per call of each shared-context program, each call waited for."""
    programs, times = lm.scorer.context_programs, collections.defaultdict(list)
    for name in ("prefill_and_score", "score"):
        call = getattr(programs, name)

        def wrapped(*args, call=call, name=name, **kwargs):
            started = time.perf_counter()
            out = jax.block_until_ready(call(*args, **kwargs))
            times[name].append(time.perf_counter() - started)
            return out
        setattr(programs, name, wrapped)
    lm.loglikelihood(instances, disable_tqdm=True)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("shots", type=int)
    parser.add_argument("--calls", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "tasks").mkdir()
    name = bench.synthetic_task(tmp / "tasks", 100, 4, args.shots)
    hf_dir, _ = bench.exported_model(argparse.Namespace(checkpoint=None, preset="tiny"), tmp, tmp / "tasks")
    instances = bench.task_instances(tmp / "tasks", name)
    for batch in (1, 16):
        lms = {k: TorchlyraLM(checkpoint=str(hf_dir), kernels=k, batch_size=batch) for k in KERNELS}
        seconds = {k: [] for k in lms}
        for lm in lms.values():
            lm.scorer.progress = False
            lm.loglikelihood(instances, disable_tqdm=True)          # untimed: compiling
        for _ in range(5):
            for k, lm in lms.items():
                started = time.perf_counter()
                lm.loglikelihood(instances, disable_tqdm=True)
                seconds[k].append(time.perf_counter() - started)
        print(f"shots {args.shots} batch {batch}: "
              + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in seconds.items()), flush=True)
        if args.calls:
            for k, lm in lms.items():
                print(f"  {k} per call, waited for: "
                      + ", ".join(f"{n} {ms:.2f} ms" for n, ms in timed_calls(lm, instances).items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
