"""`torchlyra lm-eval` end to end, as a user runs it, side by side with lm-eval's own `hf` backend on
the same exported model: our backend with an empty compilation cache, again with the cache the
first run filled, and `hf`. Each is one fresh process on a local multiple-choice task of N items
built from the bundled corpus; prints the wall seconds and the accuracies.

    PYTHONPATH=$PWD python scripts/lm_eval_startup.py --checkpoint runs/tiny --items 86 --out runs/lm_eval_startup
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

TASK = "startup_mc"


def write_task(directory: Path, items: int, seed: int = 0) -> None:
    """N questions from the bundled corpus: a line's first four words, its true rest and the rests
    of three other lines as choices."""
    from train.data.corpus import extract_plays

    lines = [line.split() for _, path in extract_plays() for line in path.read_text().splitlines()
             if 8 <= len(line.split()) <= 14]
    rng = random.Random(seed)
    picked = rng.sample(lines, items * 4)
    docs = []
    for i in range(items):
        group = picked[4 * i:4 * i + 4]
        answer = " ".join(group[0][4:])
        choices = [answer] + [" ".join(g[4:]) for g in group[1:]]
        rng.shuffle(choices)
        docs.append({"question": " ".join(group[0][:4]), "choices": choices, "gold": choices.index(answer)})
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\nmetric_list:\n  - metric: acc\n')


def timed(argv: list[str], out: Path, env: dict) -> tuple[float, float]:
    """(wall seconds, accuracy) of one `torchlyra lm-eval` process."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "train.cli", "lm-eval", *argv, "--output_path", str(out)], check=True,
                   env=env, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    return seconds, results["acc,none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/tiny")
    parser.add_argument("--items", type=int, default=86)
    parser.add_argument("--out", default="runs/lm_eval_startup")
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "train.cli", "export", "--checkpoint", args.checkpoint, "--out",
                    str(out / "hf"), "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
    write_task(out / "tasks", args.items)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "TORCHLYRA_COMPILE_CACHE")}
    env["HF_DATASETS_OFFLINE"] = "1"
    common = ["--tasks", TASK, "--include_path", str(out / "tasks"), "--batch_size", "16"]
    ours = ["--model_args", f"checkpoint={out / 'hf'},compile_cache={out / 'cache'}", *common]
    rows = [("torchlyra, empty compilation cache", *timed(ours, out / "first", env)),
            ("torchlyra, the cache of the first run", *timed(ours, out / "second", env)),
            ("lm-eval's hf backend", *timed(["--model", "hf", "--model_args", f"pretrained={out / 'hf'},dtype=float32",
                                             *common], out / "hf_run", env))]
    print(f"\nlm-eval end to end, one process each, {args.items}-item multiple-choice task ({args.checkpoint}):")
    print("| backend | wall s | acc |\n| --- | --- | --- |")
    for name, seconds, acc in rows:
        print(f"| {name} | {seconds:.1f} | {acc:.4f} |")
    print(f"second run / first: {rows[1][1] / rows[0][1]:.2f}; second run / hf: {rows[1][1] / rows[2][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
