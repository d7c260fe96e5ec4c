"""The compiled scorer against its oracles: the eager scorer (ragged and truncated requests, a
batch of 3 rows, greedy flags both ways; requests sharing contexts at batch sizes 1, 3 and 16),
transformers on the exported model, and itself on an 8-device mesh (subprocess); each bucket
compiles once; a shared context is computed once; bad requests are one-line errors."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.errors import UserError
from train.evaluation.eager_scorer import EagerScorer
from train.evaluation.requests import LoglikelihoodRequest
from train.evaluation.scorer import CompiledScorer, checkpoint_info, length_bucket, load_scorer, rows_bucket
from train.evaluation.shared_context import plan_batches

from tests.worker_env import PYTHONPATH

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 24
CFG = get_preset("tiny").replace(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                 n_experts=4, expert_dim=32, sliding_window=8, max_seq_len=MAX_LENGTH)
# (context, continuation) lengths: ragged, longer than the window, and (last three) truncated.
SHAPES = [(1, 1), (2, 5), (6, 3), (9, 1), (11, 6), (15, 2), (20, 4), (23, 2), (30, 3), (26, 8)]


def random_model(seed: int = 0) -> GptOssForCausalLM:
    """Every tensor random and larger than the init's (sharper distributions: some argmax chains)."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.eval()


def greedy_continuation(model, context: list[int], n: int) -> tuple[int, ...]:
    """The model's argmax chain as the scorer will see it: after the request's own truncation."""
    ids, start = list(context), max(0, len(context) + n - (MAX_LENGTH + 1))
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids[start:]]))[0, -1].argmax()))
    return tuple(ids[len(context):])


def fresh_requests(model, seed: int) -> list[LoglikelihoodRequest]:
    """SHAPES with random ids, plus two whose continuation is the model's own greedy chain."""
    rng = np.random.default_rng(seed)
    out = [LoglikelihoodRequest(tuple(rng.integers(0, CFG.vocab_size, c).tolist()),
                                tuple(rng.integers(0, CFG.vocab_size, k).tolist())) for c, k in SHAPES]
    for c, k in [(4, 3), (28, 2)]:
        context = rng.integers(0, CFG.vocab_size, c).tolist()
        out.append(LoglikelihoodRequest(tuple(context), greedy_continuation(model, context, k)))
    return out


def shared_requests(model, seed: int) -> list[LoglikelihoodRequest]:
    """Multiple-choice-like groups: contexts of 1-20 tokens (some longer than the sliding window
    of 8) with 1-5 continuations of 1-6 tokens each, one group's continuations the model's greedy
    chain and a wrong one, and fresh_requests' truncated ones mixed in; shuffled."""
    rng = np.random.default_rng(seed)
    out = []
    for length in (1, 3, 9, 12, 17, 20):
        context = tuple(rng.integers(0, CFG.vocab_size, length).tolist())
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, min(6, MAX_LENGTH + 1 - length) + 1))
            out.append(LoglikelihoodRequest(context, tuple(rng.integers(0, CFG.vocab_size, n).tolist())))
    context = rng.integers(0, CFG.vocab_size, 10).tolist()
    chain = greedy_continuation(model, context, 4)
    wrong = chain[:2] + ((chain[2] + 1) % CFG.vocab_size,)
    out += [LoglikelihoodRequest(tuple(context), chain), LoglikelihoodRequest(tuple(context), wrong)]
    out += [r for r in fresh_requests(model, seed) if len(r.context) + len(r.continuation) > MAX_LENGTH + 1]
    return [out[i] for i in rng.permutation(len(out))]


def logprob_close(got: float, want: float) -> bool:
    """float32 agreement of two log-likelihoods: 1e-4 relative (the bound against transformers),
    1e-4 absolute near zero. Over 40 seeds of these requests the compiled scorer differed from the eager
    one by at most 1.0e-5 relative (2.5e-5 absolute per token): a pure 1e-5 relative bound failed in CI.
    A wrong position or cache row is off by more than 0.01."""
    return abs(got - want) <= 1e-4 * max(1.0, abs(want))


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def scorer(model):
    return CompiledScorer(model, batch_size=3, max_length=MAX_LENGTH, progress=False)


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_the_head_matmul_takes_the_programs_precision(precision):
    """The scoring head runs outside the model forward's precision scope in the shared-context
    programs (it once ran there at the platform's default, one bf16 pass on TPU, in a float32
    run): request_scores takes the precision as an argument, whatever scope it is traced in."""
    import jax
    import jax.numpy as jnp

    from tests.helpers import dot_precisions
    from train.evaluation.target_logprobs import request_scores

    hidden, head = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32)
    targets, scored = jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2, 4), jnp.bool_)
    other = "default" if precision == "highest" else "highest"
    with jax.default_matmul_precision(other):
        lowered = jax.jit(lambda h, w, t, s: request_scores(h, w, t, s, 2, precision)).lower(hidden, head, targets,
                                                                                              scored)
    assert set(dot_precisions(lowered)) == {f"{precision.upper()}, {precision.upper()}"}


def test_buckets_round_rows_and_positions():
    assert [length_bucket(n, 24) for n in (1, 16, 17, 23, 24)] == [16, 16, 24, 24, 24]
    assert [length_bucket(n, 4096) for n in (32, 33, 48, 49, 65, 96, 97, 3000)] == [32, 48, 48, 64, 96, 96, 128, 3072]
    assert [rows_bucket(n, 12, 1) for n in (1, 3, 5, 12, 20)] == [1, 4, 8, 12, 12]
    assert rows_bucket(3, 12, 4) == 4 and rows_bucket(12, 6, 4) == 8


def test_report_card_info_names_the_run_and_counts_its_token_slots():
    meta = {"step_dir": "/x/runs/tiny/checkpoints/300", "step": 300,
            "train_config": {"preset": "tiny", "micro_batches": 2, "batch_size": 8, "seq_len": 256}}
    assert checkpoint_info(meta) == {"model": "tiny", "preset": "tiny", "checkpoint": "/x/runs/tiny/checkpoints/300",
                                     "step": 300, "tokens_seen": 300 * 2 * 8 * 256}


def test_compiled_scorer_equals_the_eager_scorer_request_by_request(model, scorer):
    requests = fresh_requests(model, seed=int(np.random.SeedSequence().entropy % 2**32))
    got = scorer.loglikelihood(requests)
    want = EagerScorer(model, max_length=MAX_LENGTH).loglikelihood(requests)
    for i, (g, w) in enumerate(zip(got, want)):
        assert logprob_close(g.logprob, w.logprob), (i, g, w)
        assert (g.greedy, g.tokens, g.truncated) == (w.greedy, w.tokens, w.truncated), (i, g, w)
    assert [r.truncated > 0 for r in got].count(True) >= 3
    assert got[-2].greedy and got[-1].greedy and not all(r.greedy for r in got)


@pytest.fixture(scope="module")
def shared_case(model):
    """Fresh random requests sharing contexts and the eager scorer's answers to them."""
    requests = shared_requests(model, seed=int(np.random.SeedSequence().entropy % 2**32))
    return requests, EagerScorer(model, max_length=MAX_LENGTH).loglikelihood(requests)


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_requests_sharing_contexts_equal_the_eager_scorer(model, scorer, shared_case, batch_size, monkeypatch):
    requests, want = shared_case
    if batch_size != scorer.batch_size:
        scorer = CompiledScorer(model, batch_size=batch_size, max_length=MAX_LENGTH, progress=False)
    prefilled = []
    original = scorer.context_programs.prefill_and_score
    monkeypatch.setattr(scorer.context_programs, "prefill_and_score", lambda *a: prefilled.append(a) or original(*a))
    got = scorer.loglikelihood(requests)
    for i, (g, w) in enumerate(zip(got, want)):
        assert logprob_close(g.logprob, w.logprob), (i, g, w)
        assert (g.greedy, g.tokens, g.truncated) == (w.greedy, w.tokens, w.truncated), (i, g, w)
    truncated = [r.truncated > 0 for r in got].count(True)
    contexts = {r.context for r, g in zip(requests, got) if not g.truncated}
    assert truncated >= 3 and any(g.greedy for g in got) and not all(g.greedy for g in got)
    shared = [i for i, g in enumerate(got) if not g.truncated]
    batches = plan_batches([r.context for r in requests], [len(r.continuation) for r in requests], shared, batch_size)
    # One prefill per batch, except a batch with the previous batch's contexts (it reads the kept cache).
    assert len(prefilled) == 1 + sum(a.contexts != b.contexts for a, b in zip(batches, batches[1:])) < len(shared)
    if batch_size == 1:     # each context computed once across its continuations
        assert len(prefilled) == len(contexts)


def test_plan_batches_holds_each_context_once_per_batch():
    contexts = [(1, 2), (3,), (1, 2), (4, 5, 6), (1, 2), (3,)]
    batches = plan_batches(contexts, [1, 2, 3, 1, 2, 1], range(6), batch_size=4)
    assert [b.rows for b in batches] == [(3, 2, 4, 0), (1, 5)]        # longest context first, then longest continuation
    assert [b.contexts for b in batches] == [((4, 5, 6), (1, 2)), ((3,),)]
    assert [b.context_of_row for b in batches] == [(0, 1, 1, 1), (0, 0)]


def test_each_bucket_compiles_once(model, scorer):
    requests = fresh_requests(model, seed=1)
    scorer.loglikelihood(requests)
    compiled = list(scorer.compilations)
    assert len({c.bucket for c in compiled}) == len(compiled)
    again = scorer.loglikelihood(requests[::-1])          # the same shapes in another order
    assert scorer.compilations == compiled
    first = scorer.loglikelihood(requests)        # other batch-mates: equal up to float rounding
    assert all(abs(a.logprob - b.logprob) <= 1e-6 * abs(b.logprob) for a, b in zip(again[::-1], first))


def test_bad_requests_are_one_line_errors(scorer):
    with pytest.raises(UserError, match=r"request 1: token id 128 is outside the model's vocabulary \[0, 128\)"):
        scorer.loglikelihood([LoglikelihoodRequest((1,), (2,)), LoglikelihoodRequest((1,), (128,))])
    with pytest.raises(UserError, match="empty context"):
        scorer.loglikelihood([LoglikelihoodRequest((), (2,))])
    with pytest.raises(UserError, match="max_length must be in"):
        CompiledScorer(GptOssForCausalLM(CFG), max_length=CFG.max_position_embeddings + 1)


def test_equals_transformers_on_the_exported_model(tmp_path, model):
    from parity.generation import load_transformers
    from formats.hf_export import export_checkpoint
    from formats.checkpoint import save_checkpoint
    from train.evaluation.requests import window

    save_checkpoint(tmp_path / "ck", model.state_dict(), CFG, step=7)
    export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    hf = load_transformers(tmp_path / "hf")
    requests = fresh_requests(model, seed=2)
    ours, _, info = load_scorer(tmp_path / "hf", batch_size=len(requests), max_length=MAX_LENGTH, progress=False)
    assert info["model"] == "hf" and info["step"] == 0
    for i, (request, result) in enumerate(zip(requests, ours.loglikelihood(requests))):
        tokens, n, _ = window(request, MAX_LENGTH)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids[:, :-1]).logits.float(), -1)[0, -n:]
        expected = float(logprobs.gather(-1, ids[0, -n:, None]).sum())
        assert abs(result.logprob - expected) <= 1e-4 * abs(expected), (i, result, expected)
        assert result.greedy == bool((logprobs.argmax(-1) == ids[0, -n:]).all())
    _, _, info = load_scorer(tmp_path / "ck", max_length=MAX_LENGTH)
    assert (info["model"], info["step"], info["tokens_seen"]) == ("ck", 7, None)


MESH_WORKER = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.getcwd())
    import jax
    from tests.test_eval_scorer import MAX_LENGTH, fresh_requests, random_model
    from train.evaluation.scorer import CompiledScorer
    assert len(jax.devices()) == 8
    model = random_model()
    scorer = CompiledScorer(model, mesh=sys.argv[1], batch_size=12, max_length=MAX_LENGTH, progress=False)
    results = scorer.loglikelihood(fresh_requests(model, seed=3))
    print("RESULT " + json.dumps({"results": [[r.logprob, r.greedy] for r in results],
                                  "specs": sorted({str(p.sharding.spec) for p in scorer.params.values()})}))
""")


def test_sharded_on_eight_devices_equals_one_device(model, scorer):
    mesh = "fsdp=2,tensor=2,expert=2"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", MESH_WORKER, mesh], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert any("tensor" in spec for spec in out["specs"]), out["specs"]      # the weights really are split
    one_device = scorer.loglikelihood(fresh_requests(model, seed=3))
    assert len(out["results"]) == len(one_device)
    for i, ((logprob, greedy), want) in enumerate(zip(out["results"], one_device)):
        assert logprob_close(logprob, want.logprob) and greedy == want.greedy, (i, logprob, want)
