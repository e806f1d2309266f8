"""Mixture-of-experts tensors between our layout and Hugging Face checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE).

Ours, per MoE block ``layers.{i}.feed_forward.``: ``router.gate.weight [E, D]``, the persistent buffer
``router.expert_bias [E]``, stacked experts ``experts.w1 / w3 [E, H, D]`` (gate / up) and ``experts.w2
[E, D, H]`` (down), optional ``shared_experts.w1/w2/w3.weight`` and ``shared_gate.weight [1, D]``.

Hugging Face, per block ``model.layers.{i}.<block>.`` (:class:`MoENames` gives the names of a family):

* on the Hub and as ``save_pretrained`` writes them by default, in transformers 4 and 5 alike: one tensor per
  expert, ``experts.{e}.<gate|up|down>.weight`` (Qwen: ``gate_proj / up_proj / down_proj`` under ``mlp``;
  Mixtral: ``w1 / w3 / w2`` under ``block_sparse_moe``), the router ``gate.weight``, Qwen2-MoE's
  ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight``;
* inside a transformers 5 model (``model.state_dict()``, ``save_pretrained(save_original_format=False)``):
  fused 3-D tensors under ``mlp``, ``experts.gate_up_proj [E, 2H, D]`` (gate rows, then up rows) and
  ``experts.down_proj [E, D, H]``, router ``mlp.gate.weight``.

Import accepts both (the fused form is split, the per-expert one stacked, every shape checked first); export
writes the per-expert form, which transformers 4 and 5 both load. All of it is slicing and stacking, so a
round trip returns the same values.

``router.expert_bias`` (aux-loss-free balancing, ``model.moe.bias_update_rate``) has no Hugging Face name in
these families: import sets it to zeros (what their routers compute), export drops it when it is all zeros and
otherwise refuses (ConfigError: transformers would route tokens to other experts). A family whose checkpoint
stores such a bias names it in ``MoENames.expert_bias``. Parts the transformers class lacks (shared experts
for Mixtral / Qwen3-MoE, an ungated shared expert for Qwen2-MoE) are refused the same way, by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmtrain.errors import CheckpointError, ConfigError
from llmtrain.models.common.args import TransformerArgs

StateDict = dict[str, torch.Tensor]
_OURS_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(router|experts|shared_experts|shared_gate)\.(.+)$")
_SHARED = {"w1.weight": "gate_proj.weight", "w3.weight": "up_proj.weight", "w2.weight": "down_proj.weight"}


@dataclass(frozen=True)
class MoENames:
    """The Hugging Face names of one family's MoE block, relative to ``model.layers.{i}.``."""

    architecture: str
    """The transformers class, for messages (``MixtralForCausalLM``)."""
    block: str = "mlp"
    """The block's module name in checkpoint files (Mixtral: ``block_sparse_moe``)."""
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused_block: str = "mlp"
    """transformers 5's module name, under which the fused 3-D experts live."""
    shared: str | None = None
    """Module of the shared experts (Qwen2-MoE: ``shared_expert``); None: the class has none."""
    shared_gate: str | None = None
    """The shared experts' sigmoid gate (Qwen2-MoE: ``shared_expert_gate``); None: ungated or absent."""
    expert_bias: str | None = None
    """Where the checkpoint keeps the router's selection bias (relative to the block); None: it has none."""


def _refuse(args: TransformerArgs, names: MoENames, what: str, fix: str) -> ConfigError:
    return ConfigError(
        f"Hugging Face export of this {args.family} MoE model as {names.architecture}: {what}, which "
        f"{names.architecture} does not have, so transformers would compute a different model; MoE export with "
        f"that option is unsupported. {fix}"
    )


def check_routing(args: TransformerArgs, architecture: str, scaled_groups: bool = False) -> None:
    """ConfigError naming every ``model.moe`` routing key whose value ``architecture``'s config cannot express.

    transformers' MoE classes route without capacity (no token is dropped); only DeepSeek-V3's
    (``scaled_groups``) scales the routed weights and limits routing to groups. ``pre_softmax: false`` needs no
    key: the softmax over the chosen logits equals the renormalised top-k of the full softmax (the top-k of the
    logits and of the softmax are the same experts), which the adapters write as renormalisation."""
    wrong = []
    if args.capacity_factor is not None:
        wrong.append(
            f"model.moe.capacity_factor {args.capacity_factor} (tokens over an expert's capacity are dropped; "
            "transformers drops none): set it to null"
        )
    if not scaled_groups and args.routed_scaling_factor != 1.0:
        wrong.append(
            f"model.moe.routed_scaling_factor {args.routed_scaling_factor} ({architecture} has no scaling of "
            "the routed weights): set it to 1"
        )
    if not scaled_groups and (args.n_group != 1 or args.topk_group != 1):
        wrong.append(
            f"model.moe.n_group {args.n_group} / topk_group {args.topk_group} ({architecture} has no "
            "group-limited routing): set both to 1"
        )
    if wrong:
        raise ConfigError(
            f"Hugging Face export as {architecture} cannot express {'; '.join(wrong)}. transformers would route "
            "tokens differently from the trained model, so the export is refused."
        )


def moe_to_hf(sd: StateDict, args: TransformerArgs, names: MoENames) -> tuple[StateDict, StateDict]:
    """``(HF tensors of every MoE block, the rest of sd)``; ConfigError for a part HF cannot hold."""
    hf: StateDict = {}
    rest: StateDict = {}
    for key, t in sd.items():
        m = _OURS_MOE.match(key)
        if m is None:
            rest[key] = t
            continue
        layer, part, name = m.groups()
        base = f"model.layers.{layer}.{names.block}."
        if part == "router" and name == "gate.weight":
            hf[base + "gate.weight"] = t
        elif part == "router" and name == "expert_bias":
            if names.expert_bias is not None:
                hf[base + names.expert_bias] = t
            elif t.device.type != "meta" and bool(torch.count_nonzero(t)):
                raise _refuse(
                    args,
                    names,
                    f"the router of block {layer} carries a non-zero aux-loss-free selection bias "
                    f"(router.expert_bias, trained with model.moe.bias_update_rate {args.bias_update_rate})",
                    "Train with model.moe.bias_update_rate: 0 (the auxiliary loss balances instead) to export.",
                )
        elif part == "experts" and name in ("w1", "w2", "w3"):
            hf_name = {"w1": names.gate, "w3": names.up, "w2": names.down}[name]
            for e in range(t.shape[0]):
                hf[f"{base}experts.{e}.{hf_name}.weight"] = t[e]
        elif part == "shared_experts" and name in _SHARED:
            if names.shared is None:
                raise _refuse(
                    args,
                    names,
                    f"it has {args.shared_experts} shared expert(s) (model.moe.shared_experts)",
                    "Use model.moe.shared_experts: 0 for this family.",
                )
            if names.shared_gate is not None and not args.shared_expert_gate:
                raise _refuse(
                    args,
                    names,
                    "its shared experts are ungated (model.moe.shared_expert_gate false) while transformers "
                    "gates them",
                    "Set model.moe.shared_expert_gate: true.",
                )
            hf[f"{base}{names.shared}.{_SHARED[name]}"] = t
        elif part == "shared_gate" and name == "weight" and names.shared_gate is not None:
            hf[f"{base}{names.shared_gate}.weight"] = t
        else:
            raise _refuse(args, names, f"its state holds {key!r}", "Export it without this part.")
    if names.shared is not None and args.num_moe_layers and not args.shared_experts:
        raise _refuse(
            args,
            names,
            "it has no shared expert, and transformers' class always has one",
            "Use model.moe.shared_experts > 0 with shared_expert_gate: true.",
        )
    return hf, rest


def _take(sd: StateDict, key: str, shape: tuple[int, ...], source: str) -> torch.Tensor:
    t = sd.pop(key)
    if tuple(t.shape) != shape:
        raise CheckpointError(
            f"{source}: {key} has shape {tuple(t.shape)}, but its config.json implies {shape}; config.json and "
            "the weights belong to different models."
        )
    return t


def moe_from_hf(
    hf_sd: StateDict, args: TransformerArgs, names: MoENames, source: str = "the Hugging Face state dict"
) -> tuple[StateDict, StateDict]:
    """``(our tensors of every MoE block, the HF tensors left for the dense renames)``. A block's experts come
    from the fused or the per-expert form; an incomplete per-expert set is a CheckpointError naming the
    missing tensors. Tensors that belong to no MoE block of ``args`` stay in the rest (reported as
    unexpected by the rename)."""
    rest = dict(hf_sd)
    ours: StateDict = {}
    e, d, h = args.num_experts, args.hidden_size, args.moe_hidden_size
    for i in range(args.num_layers):
        if not args.is_moe_layer(i):
            continue
        ffn = f"layers.{i}.feed_forward."
        base, fused = f"model.layers.{i}.{names.block}.", f"model.layers.{i}.{names.fused_block}."
        for prefix in (base, fused):
            if prefix + "gate.weight" in rest:
                ours[ffn + "router.gate.weight"] = _take(rest, prefix + "gate.weight", (e, d), source)
                break
        if fused + "experts.gate_up_proj" in rest and fused + "experts.down_proj" in rest:
            gate_up = _take(rest, fused + "experts.gate_up_proj", (e, 2 * h, d), source)
            ours[ffn + "experts.w1"], ours[ffn + "experts.w3"] = gate_up[:, :h], gate_up[:, h:]
            ours[ffn + "experts.w2"] = _take(rest, fused + "experts.down_proj", (e, d, h), source)
        else:
            wanted = {"w1": (names.gate, (h, d)), "w3": (names.up, (h, d)), "w2": (names.down, (d, h))}
            missing = [
                f"{base}experts.{x}.{hf_name}.weight"
                for _, (hf_name, _) in wanted.items()
                for x in range(e)
                if f"{base}experts.{x}.{hf_name}.weight" not in rest
            ]
            if missing:
                raise CheckpointError(
                    f"{source}: MoE block {i} lacks expert tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                    f"(config.json says {e} experts; neither the per-expert form nor transformers 5's fused "
                    f"{fused}experts.gate_up_proj / down_proj is complete). The download or copy is incomplete "
                    "or config.json belongs to another model."
                )
            for ours_name, (hf_name, shape) in wanted.items():
                parts = [_take(rest, f"{base}experts.{x}.{hf_name}.weight", shape, source) for x in range(e)]
                ours[ffn + f"experts.{ours_name}"] = torch.stack(parts)
        bias_key = base + names.expert_bias if names.expert_bias is not None else None
        if bias_key is not None and bias_key in rest:
            ours[ffn + "router.expert_bias"] = _take(rest, bias_key, (e,), source)
        else:  # the class routes without a selection bias: ours is zero
            ours[ffn + "router.expert_bias"] = torch.zeros(e)
        if names.shared is not None and args.shared_experts:
            for ours_name, hf_name in _SHARED.items():
                key = f"{base}{names.shared}.{hf_name}"
                if key in rest:
                    ours[ffn + f"shared_experts.{ours_name}"] = rest.pop(key)
        if names.shared_gate is not None and args.shared_expert_gate:
            key = f"{base}{names.shared_gate}.weight"
            if key in rest:
                ours[ffn + "shared_gate.weight"] = _take(rest, key, (1, d), source)
    return ours, rest


def adding(ours: StateDict, split: Callable[[StateDict, TransformerArgs], StateDict] | None = None):
    """A ``split`` hook for ``rename_from_hf`` that runs ``split`` (if any) and then adds the MoE tensors."""

    def hook(sd: StateDict, args: TransformerArgs) -> StateDict:
        sd = split(sd, args) if split is not None else sd
        sd.update(ours)
        return sd

    return hook
