"""How to choose tokens: the user's sampling settings, checked, and the static mode they compile to
(the on-device sampling itself is jax_bridge/sampling.py, inside the decode loop)."""
from __future__ import annotations

from dataclasses import dataclass

from formats.errors import UserError


@dataclass(frozen=True)
class SamplingConfig:
    """How to choose tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those off;
    repetition_penalty 1 is none (transformers' convention: > 1 discourages repeats)."""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    logprobs: bool = False      # also return each token's log-probability and entropy (Generation.logprobs)

    def __post_init__(self):
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        checks = [("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
                  ("temperature", self.temperature >= 0, ">= 0 (0 = greedy)"),
                  ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 = off)")]
        for name, ok, expected in checks:
            if not ok:
                raise UserError(f"sampling: {name} must be {expected}, found {getattr(self, name)!r}")

    def mode(self, vocab_size: int):
        from jax_bridge.sampling import SamplingMode
        greedy = self.temperature == 0
        return SamplingMode(greedy=greedy, top_k=0 if greedy else min(self.top_k, vocab_size),
                            top_p=not greedy and self.top_p < 1, penalty=self.repetition_penalty != 1,
                            logprobs=self.logprobs)
