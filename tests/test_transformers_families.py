"""Every decoder family of the named sweep (tests/transformers_configs.py: 29 families)
trains as transformers computes it or is refused in one line, checked eagerly in this one process:
each family's tiny config built (each layer described from transformers' own model, the routed
forward held to transformers' eager forward on two packed documents longer than the window, each
run alone through transformers), its description without weights equal to the one with, one
cached greedy step past the window, the optimizer's parameter groups. Then the lowered parity
suite on a few of them, and Mistral's window through plan, the FLOP count, the KV cache and
`generate`. `scripts/transformers_families.py` runs the same sweep over every registered family."""
import pytest
import torch
from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                        chunked_causal_mask_function, sliding_window_causal_mask_function)

from tests.transformers_configs import (EXPECTED, FAMILIES, OPTIMIZER_REFUSED, TRAINS, family_config,
                                        sweep_family)
from torch_model import transformers_lm
from torch_model.transformers_truth import mask_window


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_computes_transformers_model_or_is_refused_in_one_line(family):
    result = sweep_family(family_config(family))
    expected = EXPECTED[family]
    if expected != TRAINS:
        assert expected in result["verdict"] and "\n" not in result["verdict"], result["verdict"]
        return
    assert result["verdict"] == TRAINS
    assert result["cached_error"] <= 1e-5, result
    assert (result["optimizer"] is not None) == (family in OPTIMIZER_REFUSED), result["optimizer"]


def test_the_window_is_read_from_transformers_own_mask_functions():
    assert mask_window(causal_mask_function) == 0
    assert mask_window(sliding_window_causal_mask_function(5)) == 5
    assert mask_window(sliding_window_causal_mask_function(4096)) == 4096
    with pytest.raises(ValueError, match="chunked"):
        mask_window(chunked_causal_mask_function(16, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(ValueError, match="bidirectional"):
        mask_window(bidirectional_mask_function)
    with pytest.raises(ValueError, match="bidirectional"):         # Gemma 3's bidirectional window
        mask_window(and_masks(lambda b, h, q, kv: (q - kv).abs() < 4, bidirectional_mask_function))


# Each a part of the description that Llama, Qwen3 and Qwen3-MoE (tests/test_transformers_models.py)
# lack: Mistral's window passed at call time, Gemma 3's rotary per layer type (sliding and full
# layers), StableLM's layers that do not pass keyword arguments on (the packed rows' segment ids
# reach the attention through its module).
# apertus: buffers inside its layers (its activation's constants), which the layer stack's nested
# calls once replaced by zeros (jax_bridge/lowering._buffer_value), and one-element parameters,
# also in bf16 (their gradients bounded in float32, reported in bf16: parity.tolerances); glm4:
# k_proj bias entries whose gradient is a rounding zero (parity.tolerances.ROUNDING_ZERO).
@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "stablelm", "apertus", "glm4"])
def test_lowered_float32_parity_on_packed_rows_longer_than_the_window(family):
    from parity.runs import FAST_COMPILE
    from parity.suite import run_parity

    spec = transformers_lm.TransformersSpec(family_config(family))
    sets = {"float32": ["xla"], **({"bfloat16": ["xla"]} if family == "apertus" else {})}
    report = run_parity(spec, compiler_options=FAST_COMPILE, kernel_sets=sets, seq_len=24)
    assert report.passed, report.format()
    assert report.setup["windows"] == list(spec.shape.windows)
    if family == "apertus":
        scalars = {(r.dtype, r.status) for r in report.rows if r.category == "grad" and ".act_fn.alpha_" in r.name}
        assert scalars == {("float32", "PASS"), ("bfloat16", "INFO")}, scalars


def test_mistral_window_reaches_plan_flops_the_kv_cache_and_generate():
    """Mistral passes its window at call time (its attention module has no `sliding_window`):
    the description has it, so the shapes `plan` reads, the FLOP count behind MFU and the KV
    cache (a ring of the window's slots) see it, and compiled generation gives transformers'
    own greedy tokens well past the window."""
    from helpers import assert_generates_as
    from transformers import AutoModelForCausalLM

    from parity.report import attention_summary
    from torch_model import kv_cache
    from train.generation.generator import Generator
    from train.run.flops import flops_per_token

    spec = transformers_lm.TransformersSpec(family_config("mistral"))
    assert spec.shape.windows == (8, 8) and spec.shape.layer_types == ("sliding_attention",) * 2
    full = transformers_lm.TransformersSpec({**family_config("mistral"), "sliding_window": None})
    assert full.shape.windows == (0, 0)
    assert flops_per_token(spec, 64) < flops_per_token(full, 64) and flops_per_token(spec, 8) == flops_per_token(full, 8)
    assert kv_cache.init_cache(spec.shape, 1, 64).sliding_positions.shape == (1, 8)
    assert attention_summary(list(spec.shape.windows)) == "window 8 on 2 sliding layers"
    torch.manual_seed(0)
    ours = spec.build()
    with torch.no_grad():           # weights far from their tiny init: clear greedy margins
        for p in ours.parameters():
            p.normal_(0, 0.3)
    reference = AutoModelForCausalLM.from_config(spec.hf_config(), attn_implementation="eager")
    reference.load_state_dict(ours.state_dict(), strict=False)
    out = assert_generates_as(Generator(ours), reference, [[5, 9, 17, 33, 2, 8, 11, 3, 7, 19], [40, 41]], new=10)
    assert len(set(out.tokens[0])) > 2
