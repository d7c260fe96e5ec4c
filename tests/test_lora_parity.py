"""LoRA parity rows: the lowered peft model against eager peft (logits, loss, every adapter
gradient, float32) on the self-test's micro model with a Pallas kernel set, and the planted LoRA
bug (scaling applied twice) caught by name."""
from parity import planted
from parity.runs import FAST_COMPILE
from parity.selftest import CONTROL, run_lora_selftest


def test_lora_rows_pass_on_a_pallas_set_and_scaling_twice_is_caught():
    result = run_lora_selftest(kernel_set="moe=pallas", seq_len=48, compiler_options=FAST_COMPILE)
    weights = result.weights()[0]
    control = result.outcome(CONTROL, "float32", weights)
    assert control.ok and not control.failing, control
    rows = [r for r in result.report.rows if r.kernels == "attention=xla,cross_entropy=xla,moe=pallas +lora"]
    rows = rows[:len(rows) // 2]                                   # the control's (then the bug's)
    grads = [r for r in rows if r.category == "grad"]
    assert len(grads) == 2 * (4 + 2) * 2 and all(r.metrics["rel"] <= 1e-4 for r in grads)   # layers x adapted x A, B
    assert rows[0].name == "logits (LoRA)" and rows[0].metrics["rel"] <= 1e-5
    bug = result.outcome(planted.LORA_SCALING_TWICE, "float32", weights)
    assert bug.caught and bug.named, bug
    assert any(".lora_B." in f for f in bug.failing) and any("experts" in f for f in bug.failing)
    assert result.passed
