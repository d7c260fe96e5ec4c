"""Trajectory parity: 100 steps of the micro model on bundled text, the lowered float32 train
step against the committed golden eager trajectory (scripts/make_trajectory_golden.py); a planted
bug breaks it; the golden file fits the code's configuration."""
import pytest

from parity import trajectory


@pytest.fixture(scope="module")
def golden():
    return trajectory.load_golden()


@pytest.fixture(scope="module")
def tokens(golden):
    return trajectory.batches(golden["text"])


def test_golden_trajectory_is_a_real_training_run(golden):
    losses = golden["losses"]
    assert len(losses) == trajectory.STEPS and losses[-1] < losses[0] - 2.0   # it learns
    assert "shakespeare" in golden["source"]


@pytest.fixture(scope="module")
def lowered(tokens):
    return trajectory.lowered_losses(tokens)


def test_lowered_step_follows_the_eager_trajectory_at_every_step(golden, lowered):
    result = trajectory.TrajectoryResult(golden=golden["losses"], lowered=lowered)
    assert result.passed, result.format()
    print("\n" + result.format())


def test_a_planted_bug_breaks_the_trajectory(golden, tokens):
    bugged = trajectory.lowered_losses(tokens, bug="expert_output_x0.9")
    result = trajectory.TrajectoryResult(golden=golden["losses"], lowered=bugged)
    assert not result.passed and result.max_diff > 10 * trajectory.TRAJECTORY_BOUND, result.format()
    print(f"\nplanted expert_output_x0.9: max |loss diff| {result.max_diff:.3e} over {trajectory.STEPS} steps")


def test_trajectory_cli_reports_both_sides_and_exits_by_the_verdict(golden, lowered, monkeypatch, capsys):
    import argparse

    from parity.run import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    good = trajectory.TrajectoryResult(golden=golden["losses"], lowered=lowered, eager=golden["losses"])
    monkeypatch.setattr(trajectory, "run_trajectory", lambda **kw: good)
    assert run(parser.parse_args(["--trajectory"])) == 0
    out = capsys.readouterr().out
    assert "lowered vs eager now" in out and "trajectory parity: PASS" in out
    drifted = trajectory.TrajectoryResult(golden=golden["losses"], lowered=[x + 1e-3 for x in lowered])
    monkeypatch.setattr(trajectory, "run_trajectory", lambda **kw: drifted)
    assert run(parser.parse_args(["--trajectory"])) == 1
    assert "trajectory parity: FAIL" in capsys.readouterr().out


def test_a_golden_file_for_another_configuration_is_refused(golden, tmp_path):
    import json

    other = dict(golden, seq_len=golden["seq_len"] + 1)
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(other))
    with pytest.raises(ValueError, match="regenerate it with scripts/make_trajectory_golden.py"):
        trajectory.load_golden(path)
