"""The bridge from the torch model to one compiled JAX program (torchax env, op registry, lowering,
train step, compiling for TPU without one)."""
from jax_bridge.host_memory import return_compiler_heap
from jax_bridge.tpu_compile import quiet_libtpu

quiet_libtpu()   # before JAX starts its backends: libtpu (installed for TPU compiles) stays silent on CPU hosts
return_compiler_heap()
