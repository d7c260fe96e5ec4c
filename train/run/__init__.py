"""A training run: the `train` command's loop (`loop`) and the jobs it strings together
(`trainer`), its configuration (`config`), the learning-rate schedule (`schedule`), metrics and
plots (`metrics`, `plots`, the `plot` command), the FLOPs count behind MFU (`flops`) and the `plan`
command that compiles the step for a TPU slice (`plan`)."""
