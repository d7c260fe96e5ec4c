"""Tiny transformers configs: the families the suite trains in depth (tests/test_transformers_models.py,
tests/mesh_worker.py), and the named sweep of every decoder family the product takes or refuses
(tests/test_transformers_families.py, scripts/transformers_families.py), with the procedure both run."""
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

VOCAB = 128
# Tiny copies of the families: Llama with llama3 rope scaling and a tied head; Qwen3 with head_dim
# not hidden / heads, an untied head and sliding layers after full ones (layers from
# max_window_layers on slide; the window is shorter than the rows the tests use); Qwen3-MoE with a
# dense layer between MoE ones (mlp_only_layers), normalised top-k weights and its router loss.
CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}),
    "qwen3": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, tie_word_embeddings=False, use_sliding_window=True, sliding_window=5,
        max_window_layers=1, max_position_embeddings=64),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.01,
        tie_word_embeddings=False, max_position_embeddings=64),
}

# ---- the sweep of decoder families -------------------------------------------------------------
# A family's config shrunk to 2 layers, hidden 64, 4 heads / 2 KV heads of 16, MoE 4 experts top-2,
# a window of `window` where the config takes one: each field set only where the family's
# config has it (under any of the names transformers' configs use), the rest its defaults.
SHRUNK = {
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("hidden_size", "n_embd", "d_model"): 64,
    ("intermediate_size", "ffn_hidden_size", "n_inner"): 96,
    ("num_attention_heads", "n_head", "num_heads"): 4,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads"): 2,
    ("head_dim", "kv_channels"): 16,
    ("moe_intermediate_size", "expert_intermediate_size"): 32,
    ("shared_expert_intermediate_size",): 48,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "moe_k", "top_k"): 2,
    ("kv_lora_rank",): 16, ("q_lora_rank",): 32, ("qk_rope_head_dim",): 8, ("qk_nope_head_dim",): 8,
    ("v_head_dim",): 16,
    ("max_position_embeddings", "n_positions"): 256,
}
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tiny_config(model_type: str, vocab: int = VOCAB, window: int = 8, **overrides) -> dict:
    """The JSON config (`model_type` and the fields set) of a tiny `model_type`, as
    `train --model-config` takes it."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    config = {"model_type": model_type}
    for names, value in SHRUNK.items():
        config.update({name: value for name in names if name in defaults})
    if "vocab_size" in defaults:
        config["vocab_size"] = vocab
    if "qk_rope_head_dim" in config and "head_dim" in config:    # multi-head latent attention: rotary dims
        config["head_dim"] = config["qk_rope_head_dim"]
    if "n_shared_experts" in defaults:
        config["n_shared_experts"] = 1
    if defaults.get("sliding_window"):
        config["sliding_window"] = window
    for key in SPECIAL_IDS:
        ids = defaults.get(key)
        if isinstance(ids, int) and ids >= vocab or isinstance(ids, list) and any(i >= vocab for i in ids):
            config[key] = 1
    config.update(overrides)
    return config


# The named sweep (29 families): each family's changes to tiny_config (`"sliding_window":
# True`: the sweep's window, for a family whose default config has none) and what the product must
# answer: TRAINS, or refused with the reason's words.
TRAINS = "trains"
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {"use_sliding_window": True, "sliding_window": True, "max_window_layers": 1},
    "qwen3_moe": {}, "gemma": {}, "olmo2": {}, "granite": {}, "smollm3": {}, "ministral": {}, "ernie4_5": {},
    "exaone4": {}, "arcee": {}, "gpt_oss": {}, "cohere": {},
    "deepseek_v3": {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "dots1": {}, "gemma2": {}, "seed_oss": {}, "mistral": {}, "mixtral": {"sliding_window": True},
    "olmoe": {"sliding_window": True}, "stablelm": {}, "phi3": {}, "glm4": {}, "starcoder2": {}, "qwen2_moe": {},
    "granitemoe": {}, "apertus": {}, "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]},
}


def family_config(family: str, vocab: int = VOCAB, window: int = 8) -> dict:
    """The sweep's tiny config of a named family."""
    changes = {k: window if v is True and k == "sliding_window" else v for k, v in FAMILIES[family].items()}
    return tiny_config(family, vocab=vocab, window=window, **changes)


EXPECTED = {
    **{family: TRAINS for family in FAMILIES},
    "cohere": "forward does more than embed",
    "deepseek_v3": "routing weights are none of",
    "dots1": "routing weights are none of",
    "gemma2": "softcap=50.0",
    "seed_oss": "no kernel applies dropout",
    "olmoe": "but transformers' own mask for the layer has no window",
}
# Families whose parameters the optimizer's groups (torch_model/optim.py) refuse: none of the 29
# (fused projections, shared experts, expert stacks under other names and scalar parameters are
# placed by role and shape).
OPTIMIZER_REFUSED: set[str] = set()


def sweep_family(config: dict) -> dict:
    """One family through the product and against transformers' own model, eagerly: built
    (which reads each layer's description from transformers and holds the routed forward on two
    packed documents longer than the window to transformers' eager forward per document), its
    description without weights (what `plan` and a loader read) equal to the one with weights,
    one cached greedy step past the window against transformers' eager forward, and the
    optimizer's parameter groups. Returns {"verdict": TRAINS or the refusal's line,
    "optimizer": None or its error (and "optimizer_one_line": whether it is a one-line refusal),
    "cached_error": relative error of the cached logits, "windows": per layer}."""
    import torch

    from formats.errors import UserError
    from torch_model.config import ConfigError
    from torch_model.optim import plan_parameters
    from torch_model.transformers_lm import TransformersSpec, UnsupportedModel

    spec = TransformersSpec(config)
    torch.manual_seed(0)
    try:
        model = spec.build()
        planned = spec.structure().cfg
    except UnsupportedModel as e:
        return {"verdict": str(e)}
    assert planned.windows == model.cfg.windows and planned.layer_types == model.cfg.layer_types, (
        planned, model.cfg)
    result = {"verdict": TRAINS, "windows": model.cfg.windows, "optimizer": None}
    result["cached_error"] = cached_step_error(model, spec.hf_config())
    try:
        plan_parameters(model)
    except Exception as e:  # noqa: BLE001 - what the optimizer answers is the record
        result["optimizer"] = f"{type(e).__name__}: {e}"
        result["optimizer_one_line"] = isinstance(e, (UserError, ConfigError))   # exit 2, not a traceback
    return result


def cached_step_error(model, hf_config) -> float:
    """Our cached generation (a prompt longer than the window prefilled, then one greedy token
    decoded through the KV cache, eagerly) against transformers' eager forward on the whole
    sequence: the largest relative error of the two steps' logits (inf when a greedy token differs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from torch_model import kv_cache

    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", experts_implementation="eager")
    hf.load_state_dict(model.state_dict(), strict=False)
    window = max(model.cfg.windows, default=0)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, max(window + 3, 8)), generator=torch.Generator().manual_seed(1))
    n = prompt.shape[1]
    with torch.no_grad():
        cache = kv_cache.init_cache(model.cfg, 1, n + 2)
        first, cache = model.forward_cached(prompt, torch.arange(n)[None], cache, 0)
        token = first.argmax(-1)
        second, _ = model.forward_cached(token[:, None], torch.tensor([[n]]), cache, n)
        theirs = hf(input_ids=torch.cat([prompt, token[:, None]], 1), use_cache=False).logits[0]
    worst = 0.0
    for ours, ref in ((first[0], theirs[n - 1]), (second[0], theirs[n])):
        if ours.argmax() != ref.argmax():
            return float("inf")
        worst = max(worst, ((ours - ref).norm() / ref.norm()).item())
    return worst
