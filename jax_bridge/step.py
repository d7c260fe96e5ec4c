"""One jitted JAX train step: forward, JAX autodiff, gradient accumulation over micro-batches
with `lax.scan`, and the torch optimizer's update, all in a single program with the train
state donated. With a device mesh the state lives sharded by the rules of `sharding.py`, the
batch is split over its data axes, and the gradients are reduced straight into that sharding.
Frozen parameters (`requires_grad` False: a peft LoRA base, `--freeze`) are held apart, in the
compute dtype, and get no gradient, optimizer state or update.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_bridge import kernel_tiles, policy_gradient, preference, registry, sharded_ops, sharding
from jax_bridge.env import get_env
from jax_bridge.expert_layout import ExpertLayout
from jax_bridge.layer_stack import REMAT_POLICIES, layered_forward
from jax_bridge.model_on_mesh import COMPUTE_DTYPES, ModelOnMesh, in_compute_dtype
from jax_bridge.lowering import abstract_optimizer_state, abstract_params, optimizer_function
from pallas_kernels.platform import check_platform, host_platform, vmem_capacity_bytes
from torch_model.lora import is_adapted, tracing_scope, unwrap
from torch_model.optim import OptimizerConfig, init_state, plan_parameters
from torch_model.policy_gradient import PolicyGradientConfig
from torch_model.preference import PreferenceConfig

MATMUL_PRECISIONS = ("default", "high", "highest")
# Per-platform defaults: accelerators compute in bf16 (float32 master weights); the CPU
# computes in float32, where its matmuls are real float32 and parity with eager torch holds.
DEFAULT_COMPUTE_DTYPE = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}


def target_generation(platform: str, generation: str | None) -> str | None:
    """The TPU generation a program compiles for: the one given (checked), else this host's
    chips' when it compiles for its own TPU; None off TPU or when unknown (kernels then keep
    tiles that fit any TPU from v5p on)."""
    if platform != "tpu":
        if generation is not None:
            raise ValueError(f"StepConfig.tpu_generation {generation!r} is for platform 'tpu', found {platform!r}")
        return None
    if generation is not None:
        if vmem_capacity_bytes(generation) is None:
            raise ValueError(f"StepConfig.tpu_generation: unknown TPU generation {generation!r} "
                             f"(expected e.g. v4, v5e, v5p, v6e, v7x)")
        return generation
    if host_platform() != "tpu":
        return None
    from jax_bridge import tpu_compile

    try:
        return tpu_compile.generation(jax.devices()[0])
    except tpu_compile.TopologyError:
        return None


def default_matmul_precision(compute_dtype: str) -> str:
    """The model's non-kernel matmuls: float32 compute means float32 accuracy ("highest": on TPU
    the default would be one bf16 pass, on GPU tf32); bf16 compute takes the native "default"
    (exact products, float32 accumulation). Kernels choose their own dots' precision from their
    input dtype (pallas_kernels.platform.dot_precision) whatever is set here."""
    return "highest" if compute_dtype == "float32" else "default"


@dataclass(frozen=True)
class StepConfig:
    kernels: str | dict | None = None       # e.g. "attention=pallas,moe=xla"; None = auto
    compute_dtype: str | None = None         # "float32" | "bfloat16" (float32 master weights either
                                             # way); None or "auto": DEFAULT_COMPUTE_DTYPE[platform]
    micro_batches: int = 1                   # gradient accumulation steps inside the jit
    matmul_precision: str | None = None      # the model's non-kernel matmuls (and the optimizer);
                                             # None: default_matmul_precision(compute_dtype)
    platform: str | None = None              # compiled FOR: "cpu" | "gpu" | "tpu"; None: this host's
    tpu_generation: str | None = None        # a TPU platform's generation ("v5e", "v6e", ...: its VMEM sizes
                                             # kernel tiles); None: this host's chips', if it has any
    kernel_options: str | dict | None = None  # per implementation, e.g. "attention.pallas.block_q=256", a
                                             # TABLE.json, "tiles=off"; on a TPU of a generation with a
                                             # committed tile table, that table under these (kernel_tiles.py)
    scan_layers: bool = False                # decoder layers as one lax.scan over stacked parameters
    remat: str = "none"                      # per layer: none | full | save-matmuls
    preference: PreferenceConfig | None = None   # DPO on packed pairs (jax_bridge/preference.py)
    policy_gradient: PolicyGradientConfig | None = None   # GRPO on packed rollouts (jax_bridge/policy_gradient.py)

    def __post_init__(self):
        # Resolved once, here, outside any tracing; frozen, so through object.__setattr__.
        platform = check_platform(self.platform or host_platform(), "StepConfig.platform")
        compute = self.compute_dtype if self.compute_dtype not in (None, "auto") else DEFAULT_COMPUTE_DTYPE[platform]
        if compute not in COMPUTE_DTYPES:
            raise ValueError(f"StepConfig.compute_dtype must be one of {list(COMPUTE_DTYPES)} or 'auto', "
                             f"found {self.compute_dtype!r}")
        precision = self.matmul_precision or default_matmul_precision(compute)
        if precision not in MATMUL_PRECISIONS:
            raise ValueError(f"StepConfig.matmul_precision must be one of {list(MATMUL_PRECISIONS)}, "
                             f"found {self.matmul_precision!r}")
        if self.micro_batches < 1:
            raise ValueError(f"StepConfig.micro_batches must be >= 1, found {self.micro_batches}")
        if self.preference is not None and self.policy_gradient is not None:
            raise ValueError("StepConfig: preference (DPO) and policy_gradient (GRPO) are two objectives; give one")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"StepConfig.remat must be one of {', '.join(REMAT_POLICIES)}, found {self.remat!r}")
        object.__setattr__(self, "platform", platform)
        object.__setattr__(self, "tpu_generation", target_generation(platform, self.tpu_generation))
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "matmul_precision", precision)
        # The committed tile table of the TPU generation compiled for, under the options given.
        object.__setattr__(self, "kernel_options", kernel_tiles.with_tables(
            registry.parse_kernel_options(self.kernel_options), platform, self.tpu_generation))


class TrainState(NamedTuple):
    params: dict        # float32 master weights of the trainable parameters
    opt_state: dict


def host_tensor(p: torch.Tensor) -> torch.Tensor:
    """A parameter on the host: float32 for floating ones (cast to the compute dtype later),
    integer ones (an MXFP4 base's bytes) as they are."""
    p = p.detach().cpu()
    return p.float() if p.is_floating_point() else p


def host_array(p: torch.Tensor) -> np.ndarray:
    """host_tensor as numpy."""
    return host_tensor(p).numpy()


def cast_params(params: dict, dtype) -> dict:
    """Parameters in the compute dtype where `in_compute_dtype` says so."""
    return {name: p.astype(dtype) if in_compute_dtype(name, p.dtype) else p for name, p in params.items()}


def replace_params(new: dict, like: dict, dtype, shardings: dict | None, where: str) -> dict:
    """New values for a program's parameters `like` (arrays or abstract arrays, by name): the same
    names and shapes, any float dtype, cast where `in_compute_dtype` says so and placed on
    `shardings` (None: one device). Device arrays already so placed stay as they are (the same
    buffers, no copy); host arrays are split from the host."""
    if set(new) != set(like):
        missing, extra = sorted(set(like) - set(new)), sorted(set(new) - set(like))
        raise ValueError(f"{where}: expected {len(like)} parameters; missing {missing[:3]}, unknown {extra[:3]}")
    for name, value in new.items():
        if tuple(value.shape) != tuple(like[name].shape):
            raise ValueError(f"{where}: {name} has shape {tuple(value.shape)}, expected {tuple(like[name].shape)}")
    cast = cast_params(dict(new), dtype)
    if shardings is None:
        return {n: jax.device_put(v, sharding.one_device()) for n, v in cast.items()}
    return {n: jax.device_put(v, shardings[n]) if isinstance(v, jax.Array) else sharding.place(v, shardings[n])
            for n, v in cast.items()}


class TrainStep:
    """Builds the state and the compiled step for a torch model.

    `step(state, tokens, lr_scale) -> (state, metrics)` where tokens is int32
    [micro_batches, batch, seq_len + 1] (inputs are tokens[..., :-1], labels tokens[..., 1:]);
    with a mesh, `batch` is this process's rows of the global batch.

    Packed rows (chat SFT, document masking) come as a dict of such arrays (PACKED_FIELDS:
    tokens, weights, segment_ids, positions; see `packed_inputs`): attention stays within a
    segment, RoPE uses the per-row positions, and the cross-entropy is the sum over trained
    tokens divided by the trained tokens of the WHOLE step (every micro-batch, every process),
    so accumulation equals one big batch exactly.

    DPO (`StepConfig.preference`): packed rows of preference pairs; the loss is TRL's per pair
    (jax_bridge/preference.py), the mean over the pairs of the whole step; a full fine-tuning
    step's batches also carry "reference" [B, seq_len // 2, 2] (`answer_logps` computes it).

    GRPO (`StepConfig.policy_gradient`): packed rows of rollouts (prompt + completion per
    segment) with per-token float32 advantages (and logp_old, ref_logps when the settings need
    them; jax_bridge/policy_gradient.py); `token_logps` computes those log-probabilities.

    `model` may be a peft model (its wrapped torch model is traced: state names are that
    model's, `model.layers.0.self_attn.q_proj.lora_A.default.weight`) or hold frozen parameters.
    Only parameters with `requires_grad` are in the TrainState; the frozen ones are `self.frozen`
    (set by `init_state`, or `place_frozen`), in the compute dtype (routers float32), sharded by
    the same rules, passed to the step as an argument that is not donated.

    A bf16 step's forward reads the trainable parameters from a bf16 copy (`compute_copy`) that
    the previous step's update wrote beside the float32 masters; the step keeps it between calls
    for the state it returned, and casts afresh for any other state (the first, a restored one).
    """

    def __init__(self, model: torch.nn.Module, opt_cfg: OptimizerConfig = OptimizerConfig(),
                 step_cfg: StepConfig | None = None, mesh=None):
        step_cfg = step_cfg or StepConfig()
        model = unwrap(model)            # peft injects its layers in place: trace the torch model
        self.model, self.opt_cfg, self.cfg, self.mesh = model, opt_cfg, step_cfg, mesh
        self.env = get_env()
        self.platform = step_cfg.platform
        self.kernels = registry.resolve(step_cfg.kernels, self.platform, ops=registry.model_ops(model))
        registry.check_trainable(self.kernels)
        registry.check_options(step_cfg.kernel_options)
        self.on_mesh = ModelOnMesh(model, mesh, scan_layers=step_cfg.scan_layers)
        self.layer_layout = self.on_mesh.layers
        if step_cfg.remat != "none" and not self.layer_layout.n_layers:
            why = getattr(getattr(model, "facts", None), "blocks_reason", "")
            raise ValueError(f"--remat {step_cfg.remat} recomputes each layer: this model has none the bridge runs "
                             f"as layers{f' ({why})' if why else ''}; train it with --remat none")
        self.layout = self.layer_layout.tag     # how state.params are stored (formats/checkpoint.py LAYOUTS)
        self.expert_layout = ExpertLayout.of(model)     # transformers' expert stacks: converted once a step
        self.frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
        self.layer_plan = plan_parameters(model, adapters=opt_cfg.adapter_optimizer, optimizer=opt_cfg.optimizer)
        self._check_frozen_stack()
        # Every layer stacked into one array has the same rule: take the first one's.
        self.plan = self.layer_layout.stack(self.layer_plan, stack=lambda rules: rules[0])
        self.compute_dtype = COMPUTE_DTYPES[step_cfg.compute_dtype]
        self.forward = layered_forward(model, self.layer_layout, remat=step_cfg.remat, mesh=mesh,
                                       compute_dtype=self.compute_dtype)
        self.update = optimizer_function(self.plan, opt_cfg, matmul_precision=step_cfg.matmul_precision, **(
            {} if mesh is None else {"orthogonalize": sharded_ops.orthogonalizer(self.on_mesh)}))
        self.frozen: dict = {}
        self.trace_count = 0
        self.objective = None
        jit = self.jit
        if step_cfg.preference is not None:
            # The reference: a LoRA model's own parameters with the adapters off; otherwise
            # log-probabilities precomputed once, given with each batch.
            self.objective = preference.PreferenceObjective(
                step_cfg.preference, self._answer_forward(remat=step_cfg.remat, mesh=mesh),
                "adapters" if is_adapted(model) else "batch")
            self._jitted_answers = jit(lambda p, t, f: self.objective.answer_sums({**p, **f}, t)[0])
        if step_cfg.policy_gradient is not None:
            self.objective = policy_gradient.PolicyGradientObjective(
                step_cfg.policy_gradient, self._answer_forward(remat=step_cfg.remat, mesh=mesh, method="token_logps"))
            self._jitted_token_logps = jit(lambda p, t: self.objective.token_logps(p, t)[0])
        self._jitted = jit(self._step, donate_argnums=(0, 1))
        self._jitted_copy = jit(self.compute_copy)
        self._carried: tuple[list, dict] | None = None     # (the last new state's parameters, their copy)
        self._jitted_eval = jit(self._eval)
        self._jitted_grads = jit(self._grads)
        self._jitted_update = jit(self._update, donate_argnums=(0, 2))

    @property
    def compile_count(self) -> int:
        """Programs compiled for the step so far (jax.jit's own cache of executables): one per
        run, unless an argument's shape or placement changed between calls. `_cache_size` is
        jax.jit's private count (JAX has no public one; requirements.lock pins jax)."""
        return self._jitted._cache_size()

    def jit(self, fn, **kwargs):
        """jax.jit for a program over this step's mesh (the step's own, and the evaluators' built
        on it), with the mesh's compiler options (sharding.compiler_options)."""
        return jax.jit(fn, compiler_options=sharding.compiler_options(self.mesh), **kwargs)

    # ---- state --------------------------------------------------------------------------------
    def _check_frozen_stack(self) -> None:
        """Stacked layers share one array per parameter: a parameter is frozen in all or none."""
        if not self.layer_layout.stacked or not self.frozen_names:
            return
        frozen = set(self.frozen_names)
        by_rest: dict = {}
        for name, _ in self.model.named_parameters():
            parts = name.split(".")
            if name.startswith("model.layers.") and parts[2].isdigit():
                by_rest.setdefault(".".join(parts[3:]), set()).add(name in frozen)
        mixed = sorted(rest for rest, kinds in by_rest.items() if len(kinds) > 1)
        if mixed:
            raise ValueError(f"frozen parameters: {mixed[0]} is frozen in some layers only; with scanned layers a "
                             f"parameter is frozen in every layer or none (or train with --no-scan-layers)")

    def trainable_parameters(self) -> dict:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def host_state(self) -> TrainState:
        """The initial train state as host (numpy) arrays, in this step's layer layout."""
        trainable = self.trainable_parameters()
        params = {n: p.detach().cpu().float().numpy() for n, p in trainable.items()}
        opt = init_state({n: p.detach() for n, p in trainable.items()}, self.layer_plan)
        opt = jax.tree.map(lambda t: t.numpy(), opt, is_leaf=lambda x: isinstance(x, torch.Tensor))
        return self.layer_layout.map_state(self.layer_layout.stack, TrainState(params, opt))

    def host_frozen(self) -> dict:
        """The frozen parameters as host arrays in the compute dtype (routers float32), stacked
        as the train state is."""
        frozen = {n: host_array(p) for n, p in self.model.named_parameters() if not p.requires_grad}
        return self.layer_layout.stack(cast_params(frozen, self.compute_dtype))

    def place_frozen(self, host: dict) -> dict:
        """Frozen host arrays onto the devices (sharded by the rules), kept as `self.frozen`."""
        self.frozen = (jax.device_put(host, sharding.one_device()) if self.mesh is None
                       else sharding.place(host, self.state_shardings(host)))
        return self.frozen

    def init_state(self) -> TrainState:
        """The initial train state on the devices; also places the frozen parameters."""
        state = self.host_state()
        self.place_frozen(self.host_frozen())
        if self.mesh is None:
            return jax.device_put(state, sharding.one_device())
        return sharding.place(state, self.state_shardings(state))

    def full_params(self, params: dict) -> dict:
        """The trainable parameters with the frozen ones: what the model's forward takes."""
        return {**params, **self.frozen}

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and (with a mesh) shardings of the train state, computed without any
        weights: the model may live on the `meta` device (planning a preset that fits no host)."""
        trainable = {n: a for n, a in abstract_params(self.model).items() if n in self.layer_plan}
        flat = TrainState(trainable, abstract_optimizer_state(self.model, self.layer_plan))
        return self._on_mesh(self.layer_layout.map_state(self._stack_abstract, flat))

    def abstract_frozen(self) -> dict:
        """Shapes, dtypes (the compute dtype; routers float32) and shardings of the frozen
        parameters, without weights (see abstract_state)."""
        flat = {n: jax.ShapeDtypeStruct(a.shape, self.compute_dtype if in_compute_dtype(n, a.dtype) else a.dtype)
                for n, a in abstract_params(self.model).items() if n not in self.layer_plan}
        return self._on_mesh(self._stack_abstract(flat))

    def _stack_abstract(self, flat: dict) -> dict:
        """Abstract arrays stacked in this step's layer layout (shapes only)."""
        return self.layer_layout.stack(flat, stack=lambda xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape),
                                                                                   xs[0].dtype))

    def _on_mesh(self, tree):
        """Abstract arrays with this step's shardings (as they are without a mesh)."""
        if self.mesh is None:
            return tree
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                            self.state_shardings(tree))

    def state_shardings(self, state):
        return self.on_mesh.shardings(state)

    def layer_params(self, params: dict) -> dict:
        """Parameters under the torch model's own per-layer names (unstacked if stacked)."""
        return self.layer_layout.unstack(params)

    # ---- traced functions -----------------------------------------------------------------------
    @contextlib.contextmanager
    def routing(self):
        """While tracing: the model's hot ops run the chosen kernels (compiled for this step's
        platform, with their options) and its own matmuls run at the step's precision; a LoRA
        model's expert parametrizations swap tensors (lora.tracing_scope)."""
        with registry.routed(self.env, self.kernels, platform=self.platform, options=self.cfg.kernel_options,
                             mesh=self.mesh, generation=self.cfg.tpu_generation), \
                jax.default_matmul_precision(self.cfg.matmul_precision), \
                tracing_scope(self.model):
            yield

    def loss_and_metrics(self, params, inputs, labels, packed: tuple = ()):
        """params: all of them (`full_params`); packed: () or (positions, segment_ids,
        loss_weights, loss_denominator, router_loss_scale)."""
        with self.routing():
            out = self.forward(cast_params(params, self.compute_dtype), inputs, labels, *packed)
        return out["loss"], out

    def _answer_forward(self, remat: str, mesh, method: str = "answer_logps"):
        """The model's `answer_logps` (or `token_logps`) as fn(params, *args), traced as
        `loss_and_metrics` traces the forward (compute dtype, kernels, precision)."""
        forward = layered_forward(self.model, self.layer_layout, remat=remat, mesh=mesh, method=method,
                                  compute_dtype=self.compute_dtype)

        def fn(params, *args):
            with self.routing():
                return forward(cast_params(params, self.compute_dtype), *args)

        return fn

    @property
    def reference_in_batch(self) -> bool:
        """A DPO step whose batches carry the reference log-probabilities (full fine-tuning)."""
        return preference.REFERENCE_FIELD in self.float_fields

    def _constrain(self, tree, shardings: dict | None = None):
        """`tree` (by parameter name) held as the state's rules place it, or as `shardings` says."""
        if self.mesh is None:
            return tree
        placed = self.state_shardings(tree) if shardings is None else {n: shardings[n] for n in tree}
        return jax.lax.with_sharding_constraint(tree, placed)

    def _grads(self, params, tokens, denominator=None, router_loss_scale: float = 1.0, frozen=None,
               shardings: dict | None = None):
        """Gradients of the trainable `params` only; `frozen` enters the forward as inputs.
        `shardings`: where the gradients go, by name (default: the state's rules)."""
        frozen = frozen or {}
        if self.objective is not None:
            if not isinstance(tokens, dict):
                raise ValueError("train step: a DPO or GRPO step takes packed batches (a dict), found a token array")

            def loss_of_pairs(trainable):
                return self.objective.loss({**trainable, **frozen}, tokens, denominator, router_loss_scale)

            (loss, out), grads = jax.value_and_grad(loss_of_pairs, has_aux=True)(params)
            return (loss, out), self._constrain(_as_masters(grads), shardings)
        if isinstance(tokens, dict):
            inputs, labels, packed = packed_inputs(tokens, denominator, router_loss_scale)
        else:
            inputs, labels, packed = tokens[:, :-1], tokens[:, 1:], ()

        def loss_of_trainable(trainable, *args):
            return self.loss_and_metrics({**trainable, **frozen}, *args)

        (loss, out), grads = jax.value_and_grad(loss_of_trainable, has_aux=True)(params, inputs, labels, packed)
        return (loss, out), self._constrain(_as_masters(grads), shardings)   # reduced straight into their sharding

    # ---- the trainable parameters in the compute dtype, carried from step to step -------------
    def copied(self, name: str, dtype) -> bool:
        """Whether the forward takes this trainable parameter in another dtype than its float32
        master (cast_params changes it): a bf16 step's weights, not its router or a float32 step's."""
        return in_compute_dtype(name, dtype) and jnp.dtype(dtype) != jnp.dtype(self.compute_dtype)

    def compute_copy(self, params: dict) -> dict:
        """The parameters the forward takes in the compute dtype, those `copied` only. The step
        writes them in the optimizer update's own pass over each parameter and takes them back
        at the next step, instead of casting every float32 master again (a read of 4 bytes and a
        write of 2 per parameter, in a pass of its own: BENCHMARKS.md, the roofline). Traced or
        eager."""
        return self._constrain({n: p.astype(self.compute_dtype) for n, p in params.items()
                                if self.copied(n, p.dtype)})

    def compute_copy_spec(self, params: dict) -> dict:
        """compute_copy of abstract parameters (shapes, dtypes, shardings): what `lower` and the
        TPU plan pass for it."""
        return {n: jax.ShapeDtypeStruct(p.shape, self.compute_dtype, sharding=getattr(p, "sharding", None))
                for n, p in params.items() if self.copied(n, p.dtype)}

    def _copy_of(self, state: TrainState) -> dict:
        """The compute copy of `state`: the one the previous call wrote when `state` is that call's
        result (its very parameter arrays), else cast now (a fresh or restored state)."""
        if self._carried is not None:
            leaves, copy = self._carried
            current = jax.tree.leaves(state.params)
            if len(current) == len(leaves) and all(a is b for a, b in zip(current, leaves)):
                return copy
        return self._jitted_copy(state.params)

    def _step(self, state: TrainState, compute: dict, tokens, lr_scale, frozen=None):
        """(new state, its compute copy, metrics). compute: compute_copy(state.params), donated
        with the state."""
        self.trace_count += 1          # runs only while tracing (a program may compile again without it)
        zeros = jax.tree.map(jnp.zeros_like, state.params)
        forward_params = {**state.params, **compute}
        experts, grad_shardings = self.expert_layout, None
        if experts is not None:        # expert stacks in the moe op's layout once, for every micro-batch
            forward_params, zeros = experts.to_op(forward_params), experts.to_op(zeros)
            frozen = experts.to_op(frozen) if frozen else frozen
            if self.mesh is not None:
                grad_shardings = experts.op_shardings(self.state_shardings(state.params), state.params)
        zeros = self._constrain(zeros, grad_shardings)
        packed = isinstance(tokens, dict)
        micro = jax.tree.leaves(tokens)[0].shape[0]
        # Packed rows: every micro-batch's loss is its sum over trained tokens divided by the
        # step's trained tokens, so the micro-batch gradients add up to the big batch's.
        denominator = packed_denominator(tokens) if packed else None
        if self.objective is not None:      # DPO: the step's pairs; GRPO: the loss type's normaliser
            denominator = self.objective.step_denominator(tokens)

        def accumulate(grad_sum, micro_tokens):
            with experts.taken_as_given() if experts is not None else contextlib.nullcontext():
                (_, out), grads = self._grads(forward_params, micro_tokens, denominator, 1.0 / micro, frozen,
                                              grad_shardings)
            return self._constrain(jax.tree.map(jnp.add, grad_sum, grads), grad_shardings), _scalar_metrics(out)

        grad_sum, micro_metrics = jax.lax.scan(accumulate, zeros, tokens)
        if experts is not None:        # their gradients back in the parameters' layout, once
            grad_sum = self._constrain(experts.from_op(grad_sum))
        grads = grad_sum if packed else jax.tree.map(lambda g: g / micro, grad_sum)
        params, opt_state, stats = self._update(state.params, grads, state.opt_state, lr_scale)
        metrics = jax.tree.map(lambda m: m.mean(0), micro_metrics)
        if self.objective is not None:
            metrics.update({k: micro_metrics[k].sum(0) for k in self.objective.summed if k in micro_metrics})
        elif packed:
            metrics.update(packed_step_metrics(micro_metrics, tokens))
        # A non-finite loss or gradient norm skips the update here, with no host round trip:
        # parameters and optimizer state (its step count too) stay as they were, while the
        # caller's step counter, learning-rate schedule and data move on.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(stats["grad_norm"])
        with jax.named_scope("optimizer_update"):
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), TrainState(params, opt_state),
                                     state)
            new_compute = self.compute_copy(new_state.params)     # a convert of the update's own output
        metrics.update(grad_norm=stats["grad_norm"], grad_norm_clipped=stats["grad_norm_clipped"],
                       skipped=jnp.logical_not(finite).astype(jnp.int32))
        return self._constrain(new_state), self._constrain(new_compute), metrics

    def _update(self, params, grads, opt_state, lr_scale):
        # The named scope marks the update's ops in the compiled program (jax_bridge/roofline.py);
        # the update carries the step's matmul precision itself (optimizer_function).
        with jax.named_scope("optimizer_update"):
            return self.update(params, grads, opt_state, lr_scale)

    def _eval(self, params, tokens, frozen=None):
        params = {**params, **(frozen or {})}
        if self.objective is not None:
            return self.objective.evaluate(params, tokens)
        if isinstance(tokens, dict):
            _, out = self.loss_and_metrics(params, *packed_inputs(tokens, None, 1.0))
        else:
            _, out = self.loss_and_metrics(params, tokens[:, :-1], tokens[:, 1:])
        return _scalar_metrics(out)

    # ---- public API ---------------------------------------------------------------------------
    def place_batch(self, tokens, batch_dim: int, float_fields: tuple[str, ...] | None = None):
        """This process's rows (int32; a packed batch: a dict of such arrays, the weights float32)
        -> the global batch, split over the mesh's data axes. float_fields: the float32 fields a
        packed batch carries besides PACKED_FIELDS (default: the objective's)."""
        if isinstance(tokens, dict):
            extra = self.float_fields if float_fields is None else float_fields
            fields = (*PACKED_FIELDS, *extra)
            unknown = set(tokens) ^ set(fields)
            if unknown:
                raise ValueError(f"train step: a packed batch has the fields {fields}, found {sorted(tokens)}")
            placed = {k: self.place_batch(v, batch_dim) for k, v in tokens.items() if k not in extra}
            placed["weights"] = placed["weights"].astype(jnp.float32)    # 0/1: exact as int32
            for k in extra:      # float32 per-pair or per-token values, split as the rows are
                placed[k] = self._place_rows(tokens[k], batch_dim, np.float32)
            return placed
        return self._place_rows(tokens, batch_dim, np.int32)

    def _place_rows(self, values, batch_dim: int, dtype):
        """One array of this process's rows -> the global array in `dtype`, split over the mesh's data axes."""
        if self.mesh is None:
            return jnp.asarray(values, dtype=dtype)
        values = np.asarray(values, dtype=dtype)
        shards = sharding.batch_shards(self.mesh)
        rows = values.shape[batch_dim] * jax.process_count()
        if rows % shards:
            raise ValueError(f"train step: the global batch ({rows} rows) must be a multiple of the "
                             f"{shards} batch shards of the mesh ({sharding.describe(self.mesh)})")
        spec = [None] * values.ndim
        spec[batch_dim] = sharding.batch_axes(self.mesh)
        target = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))
        return jax.make_array_from_process_local_data(target, values)

    @property
    def float_fields(self) -> tuple[str, ...]:
        """The float32 fields a packed batch carries besides PACKED_FIELDS: DPO's stored
        reference (full fine-tuning), GRPO's per-token advantages and log-probabilities."""
        return () if self.objective is None else self.objective.batch_fields

    def token_logps(self, params, tokens):
        """Per-token log-probabilities [B, S] of the labels tokens[:, 1:] of one packed rollout
        batch [B, S + 1] (0 off the completions). params: ALL the forward's parameters (trainable
        and frozen; a reference's), so one compiled program serves the policy (logp_old), the
        LoRA reference (adapters off) and a frozen full copy alike."""
        if not hasattr(self.objective, "token_logps"):
            raise ValueError("train step: token_logps needs a GRPO step (StepConfig.policy_gradient)")
        return self._jitted_token_logps(params, self._place_tokens(tokens))

    def answer_logps(self, params, tokens):
        """Per-pair log-probability sums [B, S // 2, 2] of one packed preference batch [B, S + 1]
        (params: the trainable ones): the reference a full fine-tuning DPO run stores."""
        if not hasattr(self.objective, "answer_sums"):
            raise ValueError("train step: answer_logps needs a DPO step (StepConfig.preference)")
        return self._jitted_answers(params, self._place_tokens(tokens), self.frozen)

    def _place_tokens(self, tokens: dict) -> dict:
        """A packed batch's token fields alone, placed (the objective's float fields not needed)."""
        return self.place_batch({k: tokens[k] for k in PACKED_FIELDS}, 0, float_fields=())

    def __call__(self, state: TrainState, tokens, lr_scale=1.0):
        first = tokens["tokens"] if isinstance(tokens, dict) else tokens
        if np.ndim(first) != 3 or np.shape(first)[0] != self.cfg.micro_batches:
            raise ValueError(f"train step: tokens must be [micro_batches={self.cfg.micro_batches}, batch, "
                             f"seq_len+1], found shape {tuple(np.shape(first))}")
        compute = self._copy_of(state)
        self._carried = None            # the copy is donated with the state: never hand it out twice
        new_state, compute, metrics = self._jitted(state, compute, self.place_batch(tokens, 1),
                                                   jnp.asarray(lr_scale, jnp.float32), self.frozen)
        self._carried = (jax.tree.leaves(new_state.params), compute)
        return new_state, metrics

    def evaluate(self, params, tokens):
        """Loss metrics of one batch [batch, seq_len+1] without updating anything (params: the
        trainable ones; the frozen ones are added)."""
        return self._jitted_eval(params, self.place_batch(tokens, 0), frozen=self.frozen)

    def grads(self, params, tokens):
        """(loss, metrics), grads for one batch [batch, seq_len+1] (for parity checks and the
        step benchmark's forward+backward)."""
        return self._jitted_grads(params, self.place_batch(tokens, 0), frozen=self.frozen)

    def apply_update(self, params, grads, opt_state, lr_scale=1.0):
        """(params, opt_state, stats): the optimizer update alone, jitted as inside the step
        (params and opt_state donated); the step benchmark times it apart."""
        return self._jitted_update(params, grads, opt_state, jnp.asarray(lr_scale, jnp.float32))

    def lower(self, state: TrainState, tokens, lr_scale=1.0):
        """The step's `jax.stages.Lowered` (trace + lowering); `.compile()` it to time the compile."""
        return self._jitted.lower(state, self.compute_copy_spec(state.params), self.place_batch(tokens, 1),
                                  jnp.asarray(lr_scale, jnp.float32), self.frozen)

    def compiled(self, state: TrainState, tokens, lr_scale=1.0):
        """The step's `jax.stages.Compiled` for the arguments a call would get (nothing is donated
        or run): after a call with such arguments, jax.jit's caches hold its lowering and
        executable, so this is the very program the calls ran and nothing compiles again (it
        compiles only if no call has). `state`: a live state (the last call's result)."""
        return self._jitted.lower(state, self._copy_of(state), self.place_batch(tokens, 1),
                                  jnp.asarray(lr_scale, jnp.float32), self.frozen).compile()


PACKED_FIELDS = ("tokens", "weights", "segment_ids", "positions")


def packed_batch(batches) -> dict:
    """Loader Batches (train/data/loader.py) -> the step's packed dict, stacked on a leading axis
    (micro-batches); one Batch -> its arrays as they are."""
    if hasattr(batches, "tokens"):
        return {k: getattr(batches, k) for k in PACKED_FIELDS}
    return {k: np.stack([getattr(b, k) for b in batches]) for k in PACKED_FIELDS}


def packed_denominator(tokens: dict):
    """Trained tokens of the whole step (all micro-batches; the arrays are global: all processes)."""
    return jnp.maximum(tokens["weights"][..., 1:].sum(), 1.0)


def packed_inputs(tokens: dict, denominator, router_loss_scale: float):
    """(inputs, labels, packed model arguments) of one packed micro-batch [B, seq_len + 1]: inputs
    tokens[:, :-1] at positions[:, :-1] in segments segment_ids[:, :-1]; labels tokens[:, 1:]
    weighted by weights[:, 1:]; denominator None: this batch's trained tokens."""
    weights = tokens["weights"][:, 1:]
    return (tokens["tokens"][:, :-1], tokens["tokens"][:, 1:],
            (tokens["positions"][:, :-1], tokens["segment_ids"][:, :-1], weights,
             jnp.maximum(weights.sum(), 1.0) if denominator is None else denominator, router_loss_scale))


def packed_step_metrics(micro_metrics: dict, tokens: dict) -> dict:
    """A packed step's loss parts summed over micro-batches (each is a share of the step's mean),
    its trained tokens and their share of the predicted positions. Router losses stay the mean
    over micro-batches."""
    out = {k: micro_metrics[k].sum(0) for k in ("ce", "loss", "lm_z") if k in micro_metrics}
    trained = tokens["weights"][..., 1:].sum()
    out.update(trained_tokens=trained, trained_share=trained / tokens["weights"][..., 1:].size)
    return out


def _as_masters(grads: dict) -> dict:
    """Gradients in float32, the master weights' dtype. Taken through the compute copy they are
    the bf16 cotangents that the cast's transpose widened when the forward cast the masters
    itself: widened here, before the mesh reduces them, they are the same values."""
    return {n: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g for n, g in grads.items()}


def _scalar_metrics(out: dict) -> dict:
    """The loss parts, plus for MoE models the router losses per layer ([layers]), the
    routed-token fraction per layer and expert ("expert_fraction" [layers, experts]) and its
    largest value times E (1.0: balanced)."""
    metrics = {k: v for k, v in out.items() if v.ndim == 0 or k.endswith("_per_layer")}
    if "expert_fraction" in out:
        frac = out["expert_fraction"]
        metrics["expert_fraction"] = frac
        metrics["expert_load_max"] = frac.max() * frac.shape[-1]
    return metrics
