"""The pieces of the lost-host path that need no cluster (tests/test_multihost.py runs the whole
path with two real processes): who the coordination service's words name as lost, the parent's
holding back of C++ log text, and a resumed run's mesh fitted to fewer devices."""
import io
import os
import threading
from pathlib import Path

import jax

from train.run.config import TrainConfig
from train.cluster.host_supervisor import StderrRelay, lost_process
from train.run.trainer import fit_mesh

# What XLA's coordination service wrote when it ended a survivor (jaxlib 0.10.2, 127.0.0.1):
# process 0, which ran the service, after process 1 died; process 1 after process 0 died.
SERVICE_SAW_TASK_DIE = (
    "E1201 08:35:15.315793    6894 coordination_service.cc:1549] [5626036722053714469] Use error polling to propagate "
    "the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "3\nThe tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, "
    "eviction) to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']\n"
    "F1201 08:35:15.317545    6698 client.h:80] Terminating process because the JAX distributed service detected "
    "fatal errors.\n")
COORDINATOR_GONE = (
    "E1201 08:37:22.523587   16357 coordination_service_agent.cc:289] Polled an error from coordination service "
    "(this can be an error from this or another task).\n"
    "F1201 08:37:22.523642   16357 client.h:80] Terminating process because the JAX distributed service detected "
    "fatal errors.\nAdditional GRPC error information from remote target coordination_service while calling "
    "/xla.coordination.CoordinationService/PollForError:\n:UNKNOWN:Error received from peer  "
    "{grpc_message:\"Socket closed\", grpc_status:14}\n*** Check failure stack trace: ***\n")


def test_the_lost_process_is_the_one_the_service_names_or_the_coordinator():
    assert lost_process(SERVICE_SAW_TASK_DIE, me=0)[0] == 3
    assert lost_process(SERVICE_SAW_TASK_DIE.replace("\n3\n", "\n2\n"), me=1)[0] == 2
    assert lost_process("Task 5 heartbeat timeout. This indicates ...", me=0)[0] == 5
    assert lost_process(COORDINATOR_GONE, me=1)[0] == 0
    assert lost_process("something else entirely", me=1)[0] is None


def relay_of(data: bytes) -> tuple[StderrRelay, io.BytesIO]:
    read_end, write_end = os.pipe()
    sink = io.BytesIO()
    relay = StderrRelay(os.fdopen(read_end, "rb"), sink)
    thread = threading.Thread(target=relay.run)
    thread.start()
    os.write(write_end, data)
    os.close(write_end)
    thread.join(timeout=10)
    return relay, sink


def test_the_relay_passes_output_on_and_holds_back_cpp_log_text_from_its_first_line():
    before = "step 2: validation loss 4.1\ntrain:  40%|####      | 2/5 [00:01<00:01]\r"     # a bar, then C++
    relay, sink = relay_of((before + COORDINATOR_GONE).encode())
    assert sink.getvalue().decode() == before
    assert "PollForError" in relay.text()
    relay.release()              # the process lived on (or ended for another reason): nothing is lost
    assert sink.getvalue().decode() == before + COORDINATOR_GONE


# What Orbax's background save thread logged in a survivor when its peer died mid-save (seen in a
# clean-clone `make test`; the heartbeat timeout reached the barrier before the service's abort).
ORBAX_BARRIER_FAILED = (
    "ERROR:absl:[process=0] Failed to run 4 Handler Commit operations or the Commit callback in background save "
    "thread, directory: /tmp/run/checkpoints/4\n"
    "Traceback (most recent call last):\n"
    '  File "orbax/checkpoint/_src/multihost/multihost.py", line 309, in _fn\n'
    "    client.wait_at_barrier(key, timeout_ms)\n"
    "jax.errors.JaxRuntimeError: INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
    "heartbeat timeout.\n"
    "TimeoutError: Timed out while waiting for async_write_complete barrier.\n")


def test_the_relay_holds_back_a_library_traceback_logged_from_a_background_thread():
    before = "train: 100%|##########| 5/5 [00:16<00:00]\n"
    relay, sink = relay_of((before + ORBAX_BARRIER_FAILED).encode())
    assert sink.getvalue().decode() == before
    assert "Task 1 heartbeat timeout" in relay.text()
    relay.release()
    assert sink.getvalue().decode() == before + ORBAX_BARRIER_FAILED


def test_a_resume_on_fewer_devices_without_mesh_puts_every_device_on_fsdp(monkeypatch, capsys):
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    saved = TrainConfig(mesh="data=2,fsdp=2")
    assert fit_mesh(saved, {}, Path("run/checkpoints/3")).mesh == ""
    assert "run/checkpoints/3 (data=2,fsdp=2) does not fit the 2 devices" in capsys.readouterr().out
    assert fit_mesh(saved, {"mesh": "data=2,fsdp=2"}, Path("x")).mesh == "data=2,fsdp=2", "a given --mesh is kept"
    assert fit_mesh(TrainConfig(mesh="tensor=2"), {}, Path("x")).mesh == "tensor=2", "a mesh that fits is kept"


def test_an_inference_command_that_loses_a_host_says_so_in_one_line_without_a_resume_hint():
    from train.cluster.host_fault import EXIT_HOST_LOST
    from train.cluster.host_supervisor import host_lost_line

    seen = {"process": 0, "processes": 4, "hosts": {"3": {"host": "tpu-host-3"}}}
    for command in ("generate", "eval", "lm-eval"):
        line = host_lost_line(seen, SERVICE_SAW_TASK_DIE, None, command)
        assert line.startswith(f"torchlyra {command}: lost process 3 (host tpu-host-3) of 4: it stopped sending "
                               f"heartbeats; process 0 stopped; run the command again"), line
        assert "\n" not in line and "--resume" not in line and line.endswith(f"[exit {EXIT_HOST_LOST}]")
    assert "--resume" in host_lost_line(seen, SERVICE_SAW_TASK_DIE, "runs/x", "train")


def test_every_inference_command_joins_a_cluster_as_train_does():
    """generate, eval and lm-eval take the cluster flags (lm-eval beside its own arguments) and
    go through the one join (a supervising parent on several processes)."""
    from train.cli import build_parser
    from train.evaluation.lm_eval_cli import split_cluster_flags, without_writing

    cluster = ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"]
    for command in (["generate", "--checkpoint", "c"], ["eval", "--checkpoint", "c", "--tasks", "core"],
                    ["train"]):
        args = build_parser().parse_args([*command, *cluster])
        assert (args.coordinator, args.num_processes, args.process_id) == ("h:1", 2, 1)
    rest, found = split_cluster_flags(["--tasks", "t", "--coordinator=h:1", "--num-processes", "2", "--process-id",
                                       "1", "--output_path", "o", "--log_samples"])
    assert found == {"coordinator": "h:1", "num_processes": 2, "process_id": 1}
    assert rest == ["--tasks", "t", "--output_path", "o", "--log_samples"]
    assert without_writing(rest) == ["--tasks", "t"]
