"""Rollout speed of `rl` beside transformers' `generate`: the same weights (a checkpoint, exported
for transformers by `torchlyra export`), the same prompt records, G samples per prompt at
temperature 1 with no top-k / top-p, at most --max-new-tokens each, stopping at the harmony stop
tokens. One timed run each after one untimed (ours: compiled then; transformers: warm caches).
Tokens/s counts each completion's tokens up to and including its stop. Used for BENCHMARKS.md's
"RL on the play-naming task"; prints one table and writes --json.

    python scripts/rl_rollout_speed.py --checkpoint runs/tiny-sft --prompts rl_prompts.jsonl --json speed.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from formats.hf_export import export_checkpoint
    from parity.generation import load_transformers
    from train.generation.generator import Generator, load_for_generation
    from train.generation.sampling import SamplingConfig
    from train.rl.prompts import read_prompts
    from train.rl.rollout import sample_groups, stop_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--n-prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()

    model, enc = load_for_generation(args.checkpoint)
    prompts = read_prompts(args.prompts, enc, 512)[:args.n_prompts]
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    gen = Generator(model, tokenizer=enc)
    rows = {}
    for label, seed in (("untimed", 1), ("ours", 2)):
        started = time.perf_counter()
        samples, g = sample_groups(gen, prompts, args.group_size, sampling.__class__(**{**sampling.__dict__, "seed": seed}), enc)
        seconds = time.perf_counter() - started
        rows[label] = {"seconds": seconds, "tokens": sum(len(s.tokens) for s in samples),
                       "compile_s": g.compile_seconds, "prefill_s": g.prefill_seconds, "decode_s": g.decode_seconds,
                       "bucket": list(g.bucket)}
    stops = list(stop_ids(enc, True))
    with tempfile.TemporaryDirectory() as tmp:
        export_checkpoint(args.checkpoint, Path(tmp) / "hf")
        hf = load_transformers(Path(tmp) / "hf")
    width = max(len(p.tokens) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p.tokens):], mask[r, width - len(p.tokens):] = torch.tensor(p.tokens), 1
    for label in ("untimed-hf", "hf"):
        torch.manual_seed(0)
        started = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              num_return_sequences=args.group_size, max_new_tokens=args.max_new_tokens,
                              eos_token_id=stops, pad_token_id=stops[0])
        seconds = time.perf_counter() - started
        new = out[:, width:].tolist()
        tokens = sum(next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in new)
        rows[label] = {"seconds": seconds, "tokens": tokens}
    table = {k: {**v, "tokens_per_s": v["tokens"] / v["seconds"]} for k, v in rows.items() if not k.startswith("untimed")}
    table["ours"]["vs_hf"] = table["ours"]["tokens_per_s"] / table["hf"]["tokens_per_s"]
    print(f"{len(prompts)} prompts x G {args.group_size}, at most {args.max_new_tokens} new tokens, T 1.0")
    print("| path | seconds | completion tokens | tokens/s |\n|---|---|---|---|")
    for k, v in table.items():
        print(f"| {k} | {v['seconds']:.2f} | {v['tokens']} | {v['tokens_per_s']:.0f} |")
    ours = table["ours"]
    print(f"ours / transformers: {ours['vs_hf']:.1f}x (ours compiled once first: {rows['untimed']['compile_s']:.1f} s); "
          f"ours: prefill {ours['prefill_s']:.2f} s, decode loop {ours['decode_s']:.2f} s, the rest (tokenizing, "
          f"rewards' text) {ours['seconds'] - ours['prefill_s'] - ours['decode_s']:.2f} s; bucket (rows, prompt, "
          f"length) {tuple(ours['bucket'])}, transformers prefills {width} positions")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": table,
                                               "compile_s": rows["untimed"]["compile_s"]}, indent=2))


if __name__ == "__main__":
    main()
