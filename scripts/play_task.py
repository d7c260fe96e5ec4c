"""A chat task made from the bundled Shakespeare corpus: given a line, name the play it comes from.

`build` writes conversations (OpenAI chat shape) for SFT and held-out items never trained on;
`score` asks a checkpoint each held-out question in the harmony chat format (greedy) and prints
its accuracy (exact title); `pairs` turns the built items into preference pairs (TRL's
prompt / chosen / rejected: chosen the right title, rejected another of the six) for DPO, the
training items' pairs apart from the held-out items' pairs. Used for BENCHMARKS.md's "Post-training
effects" (SFT, DPO, RL):

    python scripts/play_task.py build --out data/play-task-src
    python scripts/play_task.py score --checkpoint runs/tiny --items data/play-task-src/heldout.jsonl
    python scripts/play_task.py pairs --src data/play-task-src --out data/play-pairs-src
    python scripts/play_task.py prefer --checkpoint runs/tiny-sft --pairs data/play-pairs-src/val/heldout_pairs.jsonl

`prefer` is the held-out preference accuracy of a model by itself: the share of pairs whose
chosen answer has the higher log-probability (summed over the answer's tokens, eager torch);
with --reference also TRL's reward accuracy, the share whose log-ratio to the reference is
higher for the chosen answer.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

PLAYS = {"hamlet": "Hamlet", "macbeth": "Macbeth", "romeo_and_juliet": "Romeo and Juliet", "othello": "Othello",
         "tempest": "The Tempest", "julius_caesar": "Julius Caesar"}
QUESTION = "Which play is this line from?\n"
SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,24}\.$")       # "Ham.", "First Witch."


def play_lines(path: Path) -> list[str]:
    """The first line of each speech (a block led by a speaker line), 25-90 characters, unique."""
    lines, seen = [], set()
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace")):
        rows = [r.strip() for r in block.strip().splitlines()]
        if len(rows) >= 2 and SPEAKER.match(rows[0]) and not rows[1].startswith("["):
            line = rows[1]
            if 25 <= len(line) <= 90 and line not in seen:
                seen.add(line)
                lines.append(line)
    return lines


def conversation(line: str, title: str) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION + line}, {"role": "assistant", "content": title}]}


def prompt_record(conv: dict) -> dict:
    """A conversation as an `rl` prompt record: the user's question, the title as field "answer"."""
    return {"messages": conv["messages"][:1], "answer": conv["messages"][1]["content"]}


def build(out: Path, heldout_per_play: int, train_per_play: int, seed: int, rl_per_play: int = 0) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train.data.corpus import extract_plays

    paths = dict(extract_plays())
    rng = random.Random(seed)
    train, heldout, rl = [], [], []
    for name, title in PLAYS.items():
        lines = play_lines(paths[name])
        rng.shuffle(lines)
        heldout += [conversation(line, title) for line in lines[:heldout_per_play]]
        rl += [conversation(line, title) for line in lines[heldout_per_play:heldout_per_play + rl_per_play]]
        start = heldout_per_play + rl_per_play
        train += [conversation(line, title) for line in lines[start:start + train_per_play]]
    rng.shuffle(train)
    rng.shuffle(rl)
    out.mkdir(parents=True, exist_ok=True)
    (out / "val").mkdir(exist_ok=True)
    for path, items in ((out / "train.jsonl", train), (out / "val" / "heldout.jsonl", heldout)):
        path.write_text("".join(json.dumps(c) + "\n" for c in items))
    print(f"{len(train)} training conversations in {out / 'train.jsonl'}, {len(heldout)} held-out in "
          f"{out / 'val' / 'heldout.jsonl'} ({len(PLAYS)} plays: chance {1 / len(PLAYS):.1%})")
    if rl_per_play:       # the `rl` split: prompts with their answer, disjoint from both
        (out / "rl_prompts.jsonl").write_text("".join(json.dumps(prompt_record(c)) + "\n" for c in rl))
        (out / "val" / "heldout_prompts.jsonl").write_text("".join(json.dumps(prompt_record(c)) + "\n" for c in heldout))
        print(f"{len(rl)} rl prompts in {out / 'rl_prompts.jsonl'}; the held-out items as rl prompts in "
              f"{out / 'val' / 'heldout_prompts.jsonl'}")


def pair(conv: dict, rng: random.Random) -> dict:
    """A conversation's preference pair: its title chosen, another play's title rejected."""
    question, title = conv["messages"][0]["content"], conv["messages"][1]["content"]
    other = rng.choice(sorted(t for t in PLAYS.values() if t != title))
    return {"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": title}],
            "rejected": [{"role": "assistant", "content": other}]}


def pairs(src: Path, out: Path, seed: int) -> None:
    rng = random.Random(seed)
    (out / "val").mkdir(parents=True, exist_ok=True)
    for source, target in ((src / "train.jsonl", out / "train.jsonl"),
                           (src / "val" / "heldout.jsonl", out / "val" / "heldout_pairs.jsonl")):
        convs = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        target.write_text("".join(json.dumps(pair(c, rng)) + "\n" for c in convs))
        print(f"{len(convs)} pairs in {target} (from {source})")


def answer_logps(checkpoint: str, records: list[dict]) -> list[tuple[float, float]]:
    """(chosen, rejected) log-probabilities of each pair: the answer tokens' sum, eager torch."""
    import torch

    from train.data import preferences
    from train.generation.generator import load_for_generation

    model, tokenizer = load_for_generation(checkpoint)        # eval mode; a LoRA checkpoint: base + adapters
    out = []
    with torch.no_grad():
        for record in records:
            prompt, chosen, rejected = preferences.parse_pair(record)
            logps = []
            for answer in (chosen, rejected):
                ids, weights = preferences.render_side(tokenizer, prompt, answer)
                ids = torch.tensor(ids[None].astype("int64"))
                token_logps = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]
                logps.append(float((token_logps * torch.tensor(weights[1:], dtype=torch.float32)).sum()))
            out.append((logps[0], logps[1]))
    return out


def prefer(checkpoint: str, pairs_path: Path, reference: str | None, beta: float) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    records = [json.loads(line) for line in pairs_path.read_text().splitlines() if line.strip()]
    policy = answer_logps(checkpoint, records)
    wins = sum(c > r for c, r in policy)
    margin = sum(c - r for c, r in policy) / len(policy)
    line = (f"{checkpoint}: prefers the chosen answer in {wins}/{len(records)} = {wins / len(records):.1%} of held-out "
            f"pairs; mean log-probability margin {margin:.3f} nats")
    if reference:
        ref = answer_logps(reference, records)
        rewards = [beta * ((c - rc) - (r - rr)) for (c, r), (rc, rr) in zip(policy, ref)]
        won = sum(m > 0 for m in rewards)
        line += (f"; against {reference} (beta {beta:g}): reward accuracy {won}/{len(records)} = "
                 f"{won / len(records):.1%}, mean reward margin {sum(rewards) / len(rewards):.3f}")
    print(line)
    return wins / len(records)


def score(checkpoint: str, items: Path, batch: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from train.generation import chat
    from train.generation.generator import Generator, load_for_generation
    from train.generation.sampling import SamplingConfig

    model, tokenizer = load_for_generation(checkpoint)
    convs = [json.loads(line) for line in items.read_text().splitlines() if line.strip()]
    prompts = [chat.render(tokenizer, [chat.Message("user", c["messages"][0]["content"])]) for c in convs]
    answers = [c["messages"][1]["content"] for c in convs]
    sampling = SamplingConfig(max_new_tokens=16, temperature=0.0,
                              stop_tokens=(*chat.stop_tokens(tokenizer), model.cfg.eos_token_id))
    generator = Generator(model)
    replies = []
    for i in range(0, len(prompts), batch):
        result = generator.generate(prompts[i:i + batch], sampling)
        replies += [chat.reply_text(tokenizer, ids)[0].strip() for ids in result.tokens]
    correct = sum(r == a for r, a in zip(replies, answers))
    titled = sum(r in PLAYS.values() for r in replies)
    print(f"{checkpoint}: {correct}/{len(answers)} correct = {correct / len(answers):.1%} (chance "
          f"{1 / len(PLAYS):.1%}); {titled} replies name one of the {len(PLAYS)} plays; examples: "
          + " | ".join(repr(r) for r in replies[:3]))
    return correct / len(answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write train.jsonl and val/heldout.jsonl")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--heldout-per-play", type=int, default=40)
    b.add_argument("--train-per-play", type=int, default=400)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--rl-per-play", type=int, default=0, help="also an `rl` prompt split of this many lines per play")
    p = sub.add_parser("pairs", help="preference pairs (chosen: the right play) of the built items")
    p.add_argument("--src", type=Path, required=True, help="the directory `build` wrote")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    f = sub.add_parser("prefer", help="held-out preference accuracy: chosen more likely than rejected")
    f.add_argument("--checkpoint", required=True)
    f.add_argument("--pairs", type=Path, required=True)
    f.add_argument("--reference", help="also TRL's reward accuracy against this checkpoint (DPO's reference)")
    f.add_argument("--beta", type=float, default=0.1)
    s = sub.add_parser("score", help="accuracy of a checkpoint on held-out items")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--items", type=Path, required=True)
    s.add_argument("--batch", type=int, default=48)
    args = parser.parse_args()
    if args.command == "build":
        build(args.out, args.heldout_per_play, args.train_per_play, args.seed, args.rl_per_play)
    elif args.command == "pairs":
        pairs(args.src, args.out, args.seed)
    elif args.command == "prefer":
        prefer(args.checkpoint, args.pairs, args.reference, args.beta)
    else:
        score(args.checkpoint, args.items, args.batch)


if __name__ == "__main__":
    main()
