"""The lm-evaluation-harness backend `torchlyra`: lm-eval 0.4.13's `LM` on our compiled scorer
(`torchlyra lm-eval ARGS...`, train/evaluation/lm_eval_cli.py, registers it and runs lm-eval).

BOS policy, as lm-eval's `hf` backend by default: text is encoded with no BOS; an empty context
becomes the model's BOS (`bos_token_id`: lm-eval's prefix token), or, when the continuation
already starts with it, its first token. `add_bos_token=True` prepends BOS to every encoding.
Model arguments: checkpoint (run, step or Hugging Face dir; required), kernels (default auto),
mesh (axes joined by ':', e.g. fsdp=4:tensor=2), max_length, add_bos_token, prefix_token_id,
compile_cache (a directory or off; default as for generate: jax_bridge/compile_cache.py), merge
and base_dtype (as `eval --merge --base-dtype`), module (a module run's code, as `eval --module`;
its arguments are the run's). Any other argument is refused by name, and so are
lm-eval's `--device` given another value than its default and `--max_batch_size` (the backend runs
on JAX's devices, in batches of `--batch_size` rows).
"""
from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from formats.errors import UserError
from train.evaluation.requests import GenerationRequest, LoglikelihoodRequest

NAME = "torchlyra"


# What lm-eval's own options hand every backend (`--device`, `--max_batch_size`), and why this one
# takes neither. lm-eval leaves out an option that is None, but hands every backend its default
# device (0.4.13: "cuda:0", EvaluatorConfig), so that one value stands for "not given".
LM_EVAL_OPTIONS = {"device": "the backend runs on JAX's devices (the model argument mesh= places it)",
                   "max_batch_size": "batches are --batch_size rows (a number; auto is refused)"}
LM_EVAL_DEFAULT_DEVICE = "cuda:0"
MODEL_ARGUMENTS = ("checkpoint", "kernels", "mesh", "max_length", "add_bos_token", "prefix_token_id", "max_gen_toks",
                   "compile_cache", "merge", "base_dtype", "module")


def check_unknown_arguments(unknown: dict) -> None:
    """A model argument this backend does not take is refused by name, never ignored."""
    if unknown.get("device") == LM_EVAL_DEFAULT_DEVICE:
        unknown = {k: v for k, v in unknown.items() if k != "device"}
    for name, why in LM_EVAL_OPTIONS.items():
        if name in unknown:
            raise UserError(f"lm-eval --{name} {unknown[name]}: not taken by the torchlyra backend: {why}")
    if unknown:
        raise UserError(f"lm-eval --model_args: unknown argument(s) {', '.join(sorted(unknown))} for the torchlyra "
                        f"backend (it takes {', '.join(MODEL_ARGUMENTS)})")


class TorchlyraLM(TemplateLM):
    """lm-eval requests -> token requests for the compiled scorer (`scorer.load_scorer`)."""

    def __init__(self, checkpoint: str | None = None, kernels: str = "auto", mesh: str | None = None,
                 max_length: int | None = None, add_bos_token: bool = False, prefix_token_id: int | None = None,
                 batch_size: int | str | None = 16, max_gen_toks: int = 256, compile_cache: str | None = None,
                 merge: bool = False, base_dtype: str = "compute", module: str | None = None, **unknown):
        from formats.model_checks import take_module_from
        from jax_bridge import compile_cache as compile_cache_module
        from formats.mxfp4 import BASE_DTYPES
        from train.evaluation.scorer import load_scorer

        super().__init__()
        check_unknown_arguments(unknown)
        if not checkpoint:
            raise UserError("lm-eval --model torchlyra: give --model_args checkpoint=DIR (a run, step or Hugging Face "
                            "directory)")
        if base_dtype not in BASE_DTYPES:
            raise UserError(f"lm-eval --model_args base_dtype: expected one of {', '.join(BASE_DTYPES)}, "
                            f"found {base_dtype!r}")
        if not isinstance(merge, bool):
            raise UserError(f"lm-eval --model_args merge: expected True or False, found {merge!r}")
        compile_cache_module.enable(compile_cache)
        take_module_from(module)
        try:
            rows = int(16 if batch_size is None else batch_size)
        except ValueError:
            raise UserError(f"lm-eval --batch_size: the torchlyra backend takes a number of rows, "
                            f"found {batch_size!r}") from None
        from train.cluster.join import command_mesh, say_inference_mesh

        placed = command_mesh(mesh.replace(":", ",") if isinstance(mesh, str) else mesh)
        self.scorer, self.tokenizer, self.info = load_scorer(str(checkpoint), kernels=kernels, mesh=placed,
                                                             batch_size=rows, max_length=max_length, merge=merge,
                                                             base_dtype=base_dtype)
        say_inference_mesh("lm-eval", placed, self.scorer.mesh)
        from train import startup

        startup.mark("lm-eval's set-up and loading the model")
        if self.tokenizer is None:
            raise UserError(f"checkpoint {checkpoint}: no tokenizer, and lm-eval sends text")
        self.cfg = self.scorer.cfg
        self.add_bos_token = bool(add_bos_token)
        self._prefix = self.cfg.bos_token_id if prefix_token_id is None else int(prefix_token_id)
        self.max_gen_toks = int(max_gen_toks)

    # ---- tokens ------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.cfg.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # Special-token text is encoded as the special token, as a transformers tokenizer does.
        ids = self.tokenizer.encode(string, allowed_special="all")
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens and self.add_bos_token
        return [self._prefix, *ids] if bos and ids[:1] != [self._prefix] else ids

    def tok_decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    # ---- requests ----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        token_requests = [LoglikelihoodRequest(tuple(context), tuple(continuation))
                          for _, context, continuation in requests]
        results = self.scorer.loglikelihood(token_requests)
        out = []
        for (key, _, _), result in zip(requests, results):
            answer = (result.logprob, result.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each string's log-likelihood over disjoint windows of the model's length (lm-eval's
        rolling windows, the first conditioned on the prefix token), all windows in one scoring run."""
        windows, owners = [], []
        for i, (string,) in enumerate(tqdm([r.args for r in requests], desc="rolling windows", disable=disable_tqdm)):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations through the scorer's `generate` (train.evaluation.greedy), cut
        before the first `until` string or the end-of-text token's text."""
        generate = getattr(self.scorer, "generate", None)
        if generate is None:
            raise UserError("lm-eval generate_until: this build's scorer has no greedy generation "
                            "(train/evaluation/greedy.py)")
        eos = self.tokenizer.decode([self.eot_token_id])
        token_requests = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise UserError(f"lm-eval generate_until: the torchlyra backend decodes greedily only, the task "
                                f"asks for sampling ({gen_kwargs})")
            prompt = self.tok_encode(context) or [self.prefix_token_id]
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            token_requests.append(GenerationRequest(tuple(prompt), int(kwargs["max_gen_toks"]), tuple(until)))
        results = generate(token_requests)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("generate_until", request.args, result.text)
        return [result.text for result in results]


def register() -> None:
    """Register the backend as `torchlyra`, after lm-eval's own (it fills its registry only while
    the registry is empty: registering first would hide `hf` and the rest)."""
    import lm_eval.models  # noqa: F401  (fills the registry)
    from lm_eval.api.registry import model_registry, register_model

    if NAME not in model_registry:
        register_model(NAME)(TorchlyraLM)
