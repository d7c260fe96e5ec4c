"""LoRA parity rows: the lowered peft model against eager peft (logits, loss, every adapter
gradient, float32) and the LoRA train step (adapters after a step, frozen base bit-identical) on
the self-test's micro model, and the planted LoRA bug (scaling applied twice) caught by name. (Every
kernel set passes too: `torchlyra parity --lora`; here one set keeps the compile time down.)"""
from parity import planted
from parity.runs import FAST_COMPILE
from parity.selftest import CONTROL, run_lora_selftest


def test_lora_rows_and_step_pass_and_scaling_twice_is_caught():
    result = run_lora_selftest(kernel_set="xla", seq_len=48, train_steps=1, compiler_options=FAST_COMPILE)
    weights = result.weights()[0]
    control = result.outcome(CONTROL, "float32", weights)
    assert control.ok and not control.failing, control
    rows = [r for r in result.report.rows if r.kernels == "attention=xla,cross_entropy=xla,moe=xla +lora"]
    control_rows = rows[:next(i for i, r in enumerate(rows) if i and r.name == "logits (LoRA)")]
    by_category = {c: [r for r in control_rows if r.category == c] for c in ("logits", "grad", "param", "frozen")}
    adapters = 2 * (4 + 2) * 2                                     # layers x adapted tensors x (A, B)
    assert len(by_category["grad"]) == len(by_category["param"]) - 1 == adapters     # + the whole vector
    assert all(r.metrics["rel"] <= 1e-4 for r in by_category["grad"])
    assert by_category["logits"][0].metrics["rel"] <= 1e-5
    assert all(r.metrics["rel"] <= 1e-5 for r in by_category["param"])
    assert len(by_category["frozen"]) > adapters and all(r.metrics["max_abs"] == 0 for r in by_category["frozen"])
    bug = result.outcome(planted.LORA_SCALING_TWICE, "float32", weights)
    assert bug.caught and bug.named, bug
    assert any(".lora_B." in f for f in bug.failing) and any("experts" in f for f in bug.failing)
    assert result.passed
