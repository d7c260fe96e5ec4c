"""The reference scorer: log-likelihoods from the eager PyTorch model, one request at a time in
float32. Slow and plain on purpose: it is the oracle the compiled scorer is tested against."""
from __future__ import annotations

from typing import Sequence

from train.evaluation.requests import Loglikelihood, LoglikelihoodRequest, window


class EagerScorer:
    def __init__(self, model, max_length: int | None = None):
        self.model = model.float().eval()
        self.max_length = max_length or model.cfg.max_seq_len

    def loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> list[Loglikelihood]:
        import torch

        results = []
        with torch.no_grad():
            for request in requests:
                tokens, n, dropped = window(request, self.max_length)
                ids = torch.tensor([tokens])
                logprobs = torch.log_softmax(self.model(ids[:, :-1]).float(), dim=-1)[0, -n:]
                targets = ids[0, -n:]
                picked = logprobs.gather(-1, targets[:, None])[:, 0]
                results.append(Loglikelihood(logprob=float(picked.sum()), greedy=bool((logprobs.argmax(-1) == targets).all()),
                                             tokens=n, truncated=dropped))
        return results
