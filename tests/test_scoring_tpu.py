"""The scoring program compiles for TPU by the real TPU compiler (deviceless, nothing runs): a
2-layer `tiny` sharded over a v6e-4 slice as `eval` splits it, the train step's TPU defaults (bf16, Pallas kernels)."""
from train.evaluation.scoring_plan import plan_scoring


def test_scoring_program_compiles_for_a_v6e_slice():
    result = plan_scoring("tiny", "v6e:2x2", rows=4, positions=128, scored=16, model_overrides={"n_layers": 2})
    assert result["fits"] and result["mesh"] == "fsdp=2,tensor=2"     # eval's split: heads 4 / 2 fold fsdp twice
    assert (result["compute_dtype"], result["matmul_precision"]) == ("bfloat16", "default")
    assert result["kernels"]["attention"] == "pallas" and result["mosaic_kernels"] >= 2   # attention and MoE
    # bf16 weights split four ways (norms, biases and sinks whole: a little slack)
    assert result["params"] * 2 / 4 <= result["param_bytes_per_chip"] <= result["params"] * 2 / 4 * 1.05
    assert result["argument_bytes"] >= result["param_bytes_per_chip"]
