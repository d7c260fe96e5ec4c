"""`torchlyra plan`: the real train step compiled for a TPU slice without weights (jax_bridge/plan.py)."""
import json

from train.cli import main


def test_plan_reports_a_step_that_does_not_fit_the_chip(tmp_path, capsys):
    """The all-xla kernel set's train step (2-layer tiny at sequence 8192, 8 rows per v5e chip)
    materializes [T, T] attention scores: the TPU compiler refuses it for a 16 GiB chip, and the
    plan says so with the compiler's figure instead of failing."""
    out = tmp_path / "plan.json"
    rc = main(["plan", "--preset", "tiny", "--layers", "2", "--topology", "v5e:2x2", "--seq-len", "8192",
               "--batch-size", "32", "--kernels", "xla", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "DOES NOT FIT" in printed and "4 x TPU v5 lite" in printed and "8 rows per chip" in printed
    plan = json.loads(out.read_text())
    assert plan["fits"] is False and plan["kernels"] == {"attention": "xla", "cross_entropy": "xla", "moe": "xla"}
    assert plan["temp_bytes"] > plan["hbm_bytes"] > 15 << 30
    assert "exceeds available HBM" in plan["error"]


def test_plan_bad_input_is_one_line(capsys):
    assert main(["plan", "--preset", "tiny", "--topology", "v9z:2x2"]) == 2
    assert "unknown TPU topology 'v9z:2x2'" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--topology", "v5e:2x2", "--batch-size", "6"]) == 2
    assert "multiple of the 4 chips" in capsys.readouterr().err
    assert main(["plan", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err
