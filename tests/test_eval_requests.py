"""The request contract of evaluation (window truncation as lm-eval's hf backend) and the eager
reference scorer against the model's own cross-entropy."""
import pytest
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.errors import UserError
from train.evaluation.eager_scorer import EagerScorer
from train.evaluation.requests import LoglikelihoodRequest, window


def test_window_keeps_the_last_tokens_and_counts_the_dropped_context():
    tokens, n, dropped = window(LoglikelihoodRequest((1, 2, 3, 4, 5), (6, 7)), max_length=4)
    assert (tokens, n, dropped) == ([3, 4, 5, 6, 7], 2, 2)
    assert window(LoglikelihoodRequest((1,), (2,)), max_length=4) == ([1, 2], 1, 0)
    for bad, message in [(LoglikelihoodRequest((), (1,)), "empty context"),
                         (LoglikelihoodRequest((1,), ()), "empty continuation"),
                         (LoglikelihoodRequest((1,), (1,) * 5), "longer than the model's window of 4")]:
        with pytest.raises(UserError, match=message):
            window(bad, max_length=4)


def test_eager_scorer_sums_the_continuations_log_probabilities():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=97, n_layers=2, max_seq_len=16)
    model = GptOssForCausalLM(cfg)
    scorer = EagerScorer(model, max_length=8)
    generator = torch.Generator().manual_seed(1)
    requests = [LoglikelihoodRequest(tuple(torch.randint(0, 97, (c,), generator=generator).tolist()),
                                     tuple(torch.randint(0, 97, (k,), generator=generator).tolist()))
                for c, k in [(1, 1), (3, 2), (7, 3), (12, 4)]]          # the last one is truncated
    for request, result in zip(requests, scorer.loglikelihood(requests)):
        tokens = (list(request.context) + list(request.continuation))[-9:]
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = model(ids[:, :-1])[0]
        n = len(request.continuation)
        nll = torch.nn.functional.cross_entropy(logits[-n:], ids[0, -n:], reduction="sum")
        assert result.logprob == pytest.approx(-float(nll), rel=1e-5)
        assert result.tokens == n and result.truncated == max(0, len(request.context) + n - 9)
        assert result.greedy == bool((logits[-n:].argmax(-1) == ids[0, -n:]).all())
    # a continuation made of the model's own argmax tokens is greedy
    context = (5, 9, 2)
    with torch.no_grad():
        best = int(model(torch.tensor([context]))[0, -1].argmax())
    assert scorer.loglikelihood([LoglikelihoodRequest(context, (best,))])[0].greedy
