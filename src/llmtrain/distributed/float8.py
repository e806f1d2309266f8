"""FP8 training of the linear layers (``train.fp8``): torchao's float8 training, applied from outside the model.

``train.fp8`` is ``none`` (default), ``tensorwise`` (one dynamic scale per tensor: the fastest; under FSDP the
weights are all-gathered in fp8, half the bytes of bf16) or ``rowwise`` (one scale per row of each GEMM
operand: closer to bf16, slower; all-gathered in high precision). torchao is the optional ``fp8`` extra
(``pip install llmtrain[fp8]``), imported only when the key is set.

What is converted (:func:`apply_float8`): every ``nn.Linear`` inside the transformer blocks (``layers.*``:
attention q/k/v/o, the MLP's w1/w2/w3, shared experts) whose both dimensions are multiples of 16 (what the
fp8 GEMM needs), swapped for torchao's ``Float8Linear``. Not converted: the output head (vocabulary logits,
the most precision-sensitive GEMM), the MoE router, the grouped routed experts (not ``nn.Linear``). The
swap keeps the parameter names, so checkpoints move freely between fp8 and bf16 runs (under the fp8
all-gather a state-dict hook hands the checkpoint plain tensors that alias torchao's weight wrappers). Order in
``parallelize`` (distributed/parallelize.py): float8 swap -> TP -> recompute -> compile -> FSDP, as torchtitan;
with tensorwise under FSDP (``dp_shard > 1``) torchao's fp8 all-gather is on and, after each optimizer step,
:func:`after_optimizer_step` computes the next all-gather's weight scales with one all-reduce
(``precompute_float8_dynamic_scale_for_fsdp``) instead of one per weight. Under context parallel each rank holds
part of every sequence: :func:`apply_context_parallel` makes the activation and gradient scales those of the
whole sequence (the amax reduced over CP), as one process computes them.

Where it runs (:func:`config_problem`, :func:`device_problem`; ``resolve.validate`` asks both before a run,
``apply_float8`` once more on the device it builds on): CUDA devices with FP8 tensor cores, compute capability
>= 8.9 for tensorwise (L4, L40S, H100, H200, B200) and >= 9.0 for rowwise (torch's row-wise scaled GEMM; H100
and newer). Refused with a ConfigError: CPU, Ascend NPU, older GPUs. Under tensor parallel the TP plans shard
the ``Float8Linear`` layers as plain linear layers: their weights and activations are DTensors, so each
amax (tensor-wise or row-wise) is reduced over the TP ranks and the scales are the one-process scales
(tests/test_compose_rules.py: step 1 equals one process); the activations are all-gathered in high precision
(torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` would all-gather them in fp8: not wired in). It
pays off with
``train.compile`` (the casts fuse into the neighbouring kernels; eager fp8 is slower than bf16) and
``train.precision: bf16``.

:data:`EMULATE` is for tests only: torchao's emulated fp8 GEMMs (the same casts and scales, the matmul in
fp32) so CPU tests run the conversion, the FSDP fp8 all-gather and the scale precompute for real.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from llmtrain.config.schema import Config

MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}
"""CUDA compute capability each recipe needs (fp8 tensor cores; row-wise scaled GEMM from Hopper)."""

EMULATE = False
"""Tests only: emulated fp8 GEMMs, so the conversion also runs on a CPU. Never set from a config."""


def config_problem(cfg: Config) -> str | None:
    """Why ``train.fp8`` cannot run with this config, from the config alone (no torch), or None (any parallel
    layout trains: tensor parallel since issue 28)."""
    recipe, target = cfg.train.fp8, cfg.run.device_target
    if recipe == "none":
        return None
    if target in ("cpu", "npu"):
        where = "CPU" if target == "cpu" else "Ascend NPU"
        return (
            f"train.fp8 {recipe} needs a CUDA GPU with FP8 tensor cores (compute capability >= "
            f"{_cap(recipe)}: H100, H200, B200, L40S), but run.device_target is {target} ({where} has no fp8 "
            f"training GEMMs in torchao); set train.fp8: none, or run.device_target: cuda on such a GPU."
        )
    return None


def device_problem(recipe: str, capability: tuple[int, int], name: str) -> str | None:
    """Why ``recipe`` cannot run on the CUDA device ``name`` of compute ``capability``, or None."""
    need = MIN_CAPABILITY[recipe]
    if tuple(capability) >= need:
        return None
    return (
        f"train.fp8 {recipe} needs compute capability >= {_cap(recipe)} (FP8 tensor cores"
        f"{', row-wise scaled GEMM' if recipe == 'rowwise' else ''}), but this device is {name} with "
        f"{capability[0]}.{capability[1]}; set train.fp8: none"
        f"{', or tensorwise' if recipe == 'rowwise' and tuple(capability) >= MIN_CAPABILITY['tensorwise'] else ''}."
    )


def torchao_problem(recipe: str) -> str | None:
    """Why torchao's float8 training cannot be imported here (not installed, too old), or None."""
    from importlib import metadata

    try:
        version = metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return (
            f"train.fp8 {recipe} needs torchao (float8 training), which is not installed; install the fp8 extra "
            f"(pip install 'llmtrain[fp8]', torchao >= 0.7) or set train.fp8: none."
        )
    major, minor = (int(x) if x.isdigit() else 0 for x in (version.split(".") + ["0"])[:2])
    if (major, minor) < (0, 7):
        return f"train.fp8 {recipe} needs torchao >= 0.7 (installed: {version}); upgrade it or set train.fp8: none."
    return None


def _cap(recipe: str) -> str:
    return ".".join(map(str, MIN_CAPABILITY[recipe]))


def _converts(module: nn.Module, fqn: str) -> bool:
    """The linear layers of the blocks with both dims multiples of 16; not the head, not the MoE router."""
    from torch import nn

    if not isinstance(module, nn.Linear) or not fqn.startswith("layers.") or ".router." in f".{fqn}.":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, cfg: Config, device_type: str, fsdp_all_gather: bool) -> int:
    """Swap the blocks' linear layers for torchao's ``Float8Linear`` (model on the meta device, before TP,
    compile and FSDP); returns how many were swapped. ``fsdp_all_gather``: FSDP shards the weights (tensorwise
    then all-gathers them in fp8). ConfigError when this device or config cannot train in fp8."""
    import dataclasses

    from llmtrain.errors import ConfigError

    recipe = cfg.train.fp8
    problem = config_problem(cfg) if not EMULATE else None
    if problem is None and not EMULATE:
        problem = _this_device_problem(recipe, device_type)
    problem = problem or torchao_problem(recipe)
    if problem:
        raise ConfigError(problem)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = recipe == "tensorwise" and fsdp_all_gather
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=gather, emulate=EMULATE)
    wanted = {fqn for fqn, m in model.named_modules() if _converts(m, fqn)}
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in wanted, config=config)
    if gather:  # the fp8 all-gather wraps each weight in a torchao tensor subclass: checkpoint plain tensors
        for fqn, module in model.named_modules():
            if fqn in wanted:
                module.register_state_dict_post_hook(_plain_weight)
    return len(wanted)


_CP_MESHES: dict[int, tuple[object, object]] = {}
"""``id(layer.linear_mm_config)`` -> (that config, the CP mesh) of each converted layer under context parallel."""


def apply_context_parallel(model: nn.Module, cp_mesh: object) -> int:
    """Under context parallel: the fp8 scales of the converted layers' activations and gradients taken over the
    whole sequence, as one process takes them; returns how many layers. Each CP rank holds part of every
    sequence, so a scale from its own tokens' amax would differ from the one-process scale (measured: losses
    1e-4 off after one step). torchao reduces an amax over a mesh when asked (``reduce_amax``) but its linear
    layer never asks; :func:`_cast_over_cp` asks for these layers: the tensor-wise casts of the input and the
    output gradient, and the row-wise casts along the token dimension (those of the weight-gradient GEMM; the
    other row-wise scales are per token, hence local). The weights are whole on every CP rank (never reduced)."""
    import inspect

    from torchao.float8 import float8_linear

    original = float8_linear.hp_tensor_to_float8_dynamic
    if not getattr(original, "_llmtrain_cp", False):
        signature = inspect.signature(original)

        def cast(*args: object, **kwargs: object) -> object:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return original(**_cast_over_cp(dict(bound.arguments)))

        cast._llmtrain_cp = True  # type: ignore[attr-defined]
        float8_linear.hp_tensor_to_float8_dynamic = cast
    n = 0
    for module in model.modules():
        if isinstance(module, float8_linear.Float8Linear):
            _CP_MESHES[id(module.linear_mm_config)] = (module.linear_mm_config, cp_mesh)
            n += 1
    return n


def _cast_over_cp(a: dict) -> dict:
    """torchao's cast arguments ``a`` (all of them, by name), with the amax reduced over CP where
    :func:`apply_context_parallel` says."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import GemmInputRole

    entry = _CP_MESHES.get(id(a["linear_mm_config"]))
    if entry is None or entry[0] is not a["linear_mm_config"] or a["gemm_input_role"] is GemmInputRole.WEIGHT:
        return a
    if a["scaling_granularity"] is ScalingGranularity.TENSORWISE or a["axiswise_dim"] == 0:
        return {**a, "reduce_amax": True, "device_mesh": entry[1]}
    return a


def _plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict hook of a converted layer under the fp8 all-gather: its weight as a plain (D)Tensor that
    shares the storage of torchao's ``WeightWithDynamicFloat8CastTensor`` wrapper (DCP would pickle the
    wrapper, which the checkpoint loader refuses; loading in place into the alias loads the weight)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    key = prefix + "weight"
    value = state_dict.get(key)
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return
    plain = local._tensor.detach()
    if isinstance(value, DTensor):
        state_dict[key] = DTensor.from_local(
            plain,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    else:
        state_dict[key] = plain


def _this_device_problem(recipe: str, device_type: str) -> str | None:
    if device_type != "cuda":
        return (
            f"train.fp8 {recipe} needs a CUDA GPU with compute capability >= {_cap(recipe)}, but this run "
            f"trains on {device_type}; set train.fp8: none."
        )
    import torch

    return device_problem(recipe, torch.cuda.get_device_capability(), torch.cuda.get_device_name())


def after_optimizer_step(model: nn.Module, recipe: str) -> None:
    """With tensorwise fp8 under FSDP: the next step's fp8 weight scales, for all weights in one all-reduce
    (torchao skips models without fp8 all-gather weights). A no-op for the other recipes."""
    if recipe != "tensorwise":
        return
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
