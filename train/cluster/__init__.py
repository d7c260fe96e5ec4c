"""The cluster side of a run: the parent that supervises a multi-host `train` and reports a lost
host (`host_supervisor`), the training process's side of it (`host_fault`), and stopping cleanly on
SIGTERM or Ctrl-C (`preemption`)."""
