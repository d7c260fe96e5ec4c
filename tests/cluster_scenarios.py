"""The scenarios tests/test_cluster_inference.py runs in one process and tests/cluster_worker.py in
each process of a two-process cluster, alike: only the mesh and the output directories differ."""
from pathlib import Path

NEW = 8
PROMPTS = ["ROMEO:", "JULIET: O Romeo", "HAMLET: To be, or not"]
LORA = "r=4,alpha=8,targets=attention"


def generation(root: Path, mesh) -> list[list[int]]:
    """Greedy tokens of the released directory, its weights read onto `mesh` (None: one device)."""
    from train.generation.generator import Generator, open_for_generation
    from train.generation.sampling import SamplingConfig

    model, _, weights = open_for_generation(root / "hf")
    assert weights is not None and all(p.is_meta for p in model.parameters())      # nothing on the host
    # Any id of the model (no tokenizer): eager PyTorch's greedy margins judge the choices.
    generator = Generator(model, mesh=mesh, weights=weights)
    return generator.generate(prompt_ids(root), SamplingConfig(max_new_tokens=NEW, temperature=0)).tokens


def prompt_ids(root: Path) -> list[list[int]]:
    from formats.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(root / "hf" / "tiktoken")
    return [[0] + tokenizer.encode_ordinary(p) for p in PROMPTS]


def loglikelihoods(root: Path, mesh) -> list[float]:
    """The compiled scorer's log-likelihood of each prompt's second half after its first."""
    from train.evaluation.requests import LoglikelihoodRequest
    from train.evaluation.scorer import load_scorer

    scorer, _, _ = load_scorer(root / "hf", mesh=mesh, batch_size=4, progress=False)
    requests = [LoglikelihoodRequest(tuple(ids[:len(ids) // 2]), tuple(ids[len(ids) // 2:])) for ids in prompt_ids(root)]
    return [r.logprob for r in scorer.loglikelihood(requests)]


def cli_runs(root: Path, name: str, mesh_args: list[str], process: str = "") -> None:
    """`eval --tasks`, `lm-eval` and `train --init-from --lora` through the CLI, each writing into
    ROOT/<command>-<name> (the eval JSON: <name><process>, to see which process writes it)."""
    from tests.helpers import lm_eval_reads_only_the_included_tasks
    from train.cli import main

    hf = str(root / "hf")
    assert main(["eval", "--checkpoint", hf, "--tasks", str(root / "plays.jsonl"), "--json",
                 str(root / f"eval-{name}{process}.json"), "--no-progress", *mesh_args]) == 0
    lm_args = ",".join(filter(None, [f"checkpoint={hf}", *(f"mesh={a.replace(',', ':')}" for a in mesh_args[1:])]))
    with lm_eval_reads_only_the_included_tasks():
        assert main(["lm-eval", "--model_args", lm_args, "--tasks", "tl_mc", "--include_path",
                     str(root / "lm_tasks"), "--batch_size", "4", "--log_samples", "--output_path",
                     str(root / f"lm-eval-{name}")]) == 0
    assert main(["train", "--init-from", hf, "--lora", LORA, "--data", str(root / "data"), "--out",
                 str(root / f"lora-{name}"), "--steps", "3", "--batch-size", "4", "--seq-len", "16",
                 "--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--samples", "0",
                 "--compute-dtype", "float32", "--kernels", "xla", *mesh_args]) == 0
