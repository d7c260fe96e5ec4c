"""A user reward for `torchlyra rl --reward python:scripts/rl_text_reward.py:ends_a_line` on plain-text
prompts (a base model continuing "ROMEO:" and the like): 1.0 when the continuation holds a line
that ends with a sentence mark (. ! ?) and then a newline, else 0.0; None for an empty one (left out
of the weighted sum). Used for BENCHMARKS.md's "RL on the play-naming task" (the plain-text run)."""


def ends_a_line(prompt: str, completion: str, record: dict):
    if not completion.strip():
        return None
    lines = completion.split("\n")[:-1]          # the lines a newline closed
    return 1.0 if any(line.rstrip().endswith((".", "!", "?")) for line in lines) else 0.0
