"""Tracing a peft model more than once. peft's expert LoRA registers a parametrization on the base
tensor in every forward and removes it afterwards; under `functional_call` (how torchax traces) the
tensor it puts back is the traced one, so torch registers it as a buffer, and once functional_call
restores the original the expert weight is a buffer holding a Parameter: a second trace of the same
module object (prefill, then decode; train step, then eval) fails. `retraceable` puts every
module's parameters and buffers back as they were after each trace."""
from __future__ import annotations

import contextlib

from torch_model.lora import swapping_parametrized_tensors


@contextlib.contextmanager
def retraceable(model):
    """While tracing `model` (a peft model or ours with peft layers injected): the swap-tensors
    flag peft's expert LoRA needs, and afterwards each module's parameters and buffers exactly as
    before (same objects, same order)."""
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        with swapping_parametrized_tensors():
            yield
    finally:
        for module, parameters, buffers in saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
