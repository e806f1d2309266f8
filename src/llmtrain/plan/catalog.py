"""Hardware catalog: what one accelerator can do, and the cluster a plan runs on.

The figures are data, not code: ``devices.yaml`` next to this module lists every built-in device (NVIDIA
A100/H100/H800/H200/B200/L40S, Huawei Ascend 910A/910B/910C, a generic CPU) with its sources; a user adds or overrides
devices with a YAML file in the same layout (``llmtrain plan --catalog FILE``). A :class:`Device` carries

* ``peak_tflops``: dense bf16/fp16 tensor FLOP/s (no sparsity), the denominator of MFU;
* ``memory_gib`` / ``memory_reserved_gib``: capacity, and what the runtime keeps for itself;
* ``memory_bw_gbs``: device-memory bandwidth (bounds the element-wise kernels and the optimizer step);
* ``intra_node_bw_gbs`` / ``inter_node_bw_gbs``: per-device, per-direction link bandwidth inside a node
  (NVLink / HCCS) and between nodes (InfiniBand / RoCE);
* ``peak_fp8_tflops``: dense FP8 tensor FLOP/s (0 or absent: no FP8), what ``train.fp8``'s linear GEMMs run at;
* ``host_link_gbps``: host <-> device copy bandwidth in GB/s per direction (activation offload's copies);
* ``attention_tflops``: flash attention's published forward + backward rate on the device (0: a fixed share of
  the GEMM ceiling);
* ``matmul_efficiency``: the ceiling of the GEMM-efficiency curve (:mod:`llmtrain.plan.gemm`), the fraction of
  peak the largest GEMMs of a training step sustain; smaller GEMMs get less. Unset, the planner's one global
  value (:data:`DEFAULT_MATMUL_EFFICIENCY`) applies, so published figures are never fitted per device.

:func:`parse_cluster` reads the ``--cluster NxDEVICE[@NODES]`` spelling (``32x910b@4``, ``8xh100``).

:meth:`Catalog.match` also knows the names runtimes report (``torch.cuda.get_device_name``:
``NVIDIA A100-SXM4-40GB`` -> ``a100-40gb``; torch_npu: ``Ascend910B3`` -> ``ascend-910b``; see
:data:`RUNTIME_NAMES`), so ``llmtrain.plan.peak.peak_tflops`` gives the trainer's MFU the planner's figures.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from llmtrain.errors import ConfigError

DEFAULT_MATMUL_EFFICIENCY = 0.6
"""Ceiling of the GEMM-efficiency curve: the fraction of peak the largest GEMMs of a training step sustain (one
global value: fitted jointly with the GEMM curve's ``bandwidth_fraction`` and ``dp_overlap`` (plan/timing.py),
the grid optimum of the tokens/s error on the fit half of the published runs only, the Megatron-LM README and
Narayanan et al. rows of tests/test_plan_published.py, which asserts it; the other sources are held out. Not a standalone cuBLAS figure, which is higher: it also carries the clock and SM losses
of a loaded training step)."""

DEFAULT_HOST_LINK_GBPS = 25.0
"""Host link of a device whose catalog entry gives none: a PCIe Gen4 x16 slot's effective pinned-copy rate."""

GIB = 1024**3


@dataclass(frozen=True)
class Device:
    """One accelerator model (see the module docstring for the meaning of each figure)."""

    name: str
    description: str
    peak_tflops: float
    memory_gib: float
    memory_reserved_gib: float
    memory_bw_gbs: float
    intra_node_bw_gbs: float
    inter_node_bw_gbs: float
    devices_per_node: int
    matmul_efficiency: float = DEFAULT_MATMUL_EFFICIENCY
    peak_fp8_tflops: float = 0.0
    """Dense FP8 tensor FLOP/s (0: the device has no FP8 training GEMMs)."""
    host_link_gbps: float = DEFAULT_HOST_LINK_GBPS
    """Per-device host <-> device copy bandwidth, GB/s per direction (pinned memory over PCIe)."""
    attention_tflops: float = 0.0
    """Flash attention's forward + backward TFLOP/s on this device (causal, head dim 128, long sequences), as
    the kernel's authors publish it (FlashAttention-2, Dao 2023); 0: ``Efficiency.attention_ratio`` of the
    GEMM ceiling (plan/timing.py)."""
    sources: str = ""

    @property
    def attention_flops(self) -> float:
        """Flash attention's FLOP/s (0 when the catalog gives no measured rate)."""
        return self.attention_tflops * 1e12

    @property
    def peak_fp8_flops(self) -> float:
        return self.peak_fp8_tflops * 1e12

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def usable_bytes(self) -> float:
        """Memory left to the training job after the runtime's reserve."""
        return (self.memory_gib - self.memory_reserved_gib) * GIB


def fp8_peak_flops(dev: Device, recipe: str) -> float:
    """``dev``'s dense FP8 FLOP/s; a ConfigError naming the device when it has none (``train.fp8`` = ``recipe``)."""
    if dev.peak_fp8_tflops <= 0:
        raise ConfigError(
            f"train.fp8 {recipe} on {dev.name} ({dev.description}): the device catalog lists no FP8 peak for it "
            "(no FP8 tensor cores for training); set train.fp8: none, plan an FP8-capable device (h100, h200, "
            "b200, l40s), or give the device a peak_fp8_tflops in a --catalog file."
        )
    return dev.peak_fp8_flops


@dataclass(frozen=True)
class Cluster:
    """``num_devices`` identical devices spread over ``num_nodes`` servers."""

    device: Device
    num_devices: int
    num_nodes: int

    @property
    def devices_per_node(self) -> int:
        return self.num_devices // self.num_nodes

    def describe(self) -> str:
        return f"{self.num_devices} x {self.device.name} ({self.num_nodes} node{'s' * (self.num_nodes > 1)})"


_REQUIRED = ("peak_tflops", "memory_gib", "memory_bw_gbs", "intra_node_bw_gbs", "inter_node_bw_gbs",
             "devices_per_node")  # fmt: skip


@dataclass
class Catalog:
    """Devices by canonical name, plus aliases (``910b`` -> ``ascend-910b``)."""

    devices: dict[str, Device]
    aliases: dict[str, str]

    def get(self, name: str) -> Device:
        key = name.strip().lower()
        key = self.aliases.get(key, key)
        if key not in self.devices:
            known = ", ".join(sorted(self.devices))
            alias = ", ".join(sorted(self.aliases))
            raise ConfigError(
                f"unknown device {name!r} in --cluster; known devices: {known} (aliases: {alias}). Add your own "
                f"with --catalog FILE.yaml (same layout as llmtrain/plan/devices.yaml)."
            )
        return self.devices[key]

    def match(self, name: str) -> Device | None:
        """The device a catalog name (``h100``, ``910b``) or a runtime's device name (``NVIDIA A100-SXM4-80GB``,
        ``Ascend910B3``) stands for; None when neither the catalog nor :data:`RUNTIME_NAMES` knows it."""
        key = name.strip().lower()
        key = self.aliases.get(key, key)
        if key in self.devices:
            return self.devices[key]
        for pattern, target in RUNTIME_NAMES:
            if re.search(pattern, key) and target in self.devices:
                return self.devices[target]
        return None


def load_catalog(extra: str | Path | None = None) -> Catalog:
    """The built-in catalog, updated with the devices and aliases of ``extra`` (a user YAML file) if given."""
    text = resources.files("llmtrain.plan").joinpath("devices.yaml").read_text(encoding="utf-8")
    catalog = _parse(yaml.safe_load(text), "llmtrain/plan/devices.yaml", Catalog({}, {}))
    if extra is not None:
        from llmtrain.config.yaml_text import parse_yaml

        path = Path(extra)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"--catalog {path} does not exist.") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"--catalog {path} is not UTF-8 text (byte at offset {e.start}); a device catalog is YAML text "
                "in the layout of llmtrain/plan/devices.yaml."
            ) from None
        except OSError as e:
            from llmtrain.errors import os_error_text

            raise ConfigError(f"--catalog {path} cannot be read: {os_error_text(e)}") from None
        catalog = _parse(parse_yaml(text, f"--catalog {path}"), str(path), catalog)
    return catalog


def _parse(data: Any, source: str, base: Catalog) -> Catalog:
    if not isinstance(data, dict) or not isinstance(data.get("devices", {}), dict):
        raise ConfigError(
            f"device catalog {source}: expected a mapping with a 'devices:' mapping of name -> figures."
        )
    devices, aliases = dict(base.devices), dict(base.aliases)
    known = {f.name for f in fields(Device)}
    for name, spec in (data.get("devices") or {}).items():
        key = str(name).lower()
        if not isinstance(spec, dict):
            raise ConfigError(f"device catalog {source}: devices.{name} must be a mapping of figures.")
        merged = {**(_as_dict(devices[key]) if key in devices else {}), **spec}
        unknown = sorted(set(merged) - known)
        missing = [k for k in _REQUIRED if k not in merged]
        if unknown or missing:
            raise ConfigError(
                f"device catalog {source}: devices.{name} "
                + (f"has unknown keys {unknown}" if unknown else f"lacks {missing}")
                + f"; valid keys: {', '.join(sorted(known - {'name'}))}."
            )
        merged.update(name=key, description=str(merged.get("description", key)))
        merged.setdefault("memory_reserved_gib", 1.0)
        for field_name, value in merged.items():
            if field_name in ("name", "description", "sources"):
                merged[field_name] = str(value)
                continue
            whole = field_name == "devices_per_node"
            if (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
                    or not math.isfinite(value)):  # fmt: skip
                raise ConfigError(
                    f"device catalog {source}: devices.{name}.{field_name} = {value!r} is not a finite "
                    f"{'integer' if whole else 'number'}."
                )
        try:
            dev = Device(**merged)
            numbers = [dev.peak_tflops, dev.memory_gib, dev.memory_bw_gbs, dev.intra_node_bw_gbs,
                       dev.inter_node_bw_gbs, dev.devices_per_node, dev.matmul_efficiency]  # fmt: skip
            numbers.append(dev.host_link_gbps)
            if (any(float(x) <= 0 for x in numbers) or not 0 < float(dev.matmul_efficiency) <= 1
                    or float(dev.peak_fp8_tflops) < 0 or float(dev.attention_tflops) < 0):  # fmt: skip
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(
                f"device catalog {source}: devices.{name} needs positive numbers for {', '.join(_REQUIRED)} "
                f"(and host_link_gbps when given), a matmul_efficiency in (0, 1] and a peak_fp8_tflops and attention_tflops >= 0."
            ) from None
        devices[key] = dev
    extra_aliases = data.get("aliases") or {}
    if not isinstance(extra_aliases, dict):
        raise ConfigError(f"device catalog {source}: aliases must be a mapping of alias -> device name.")
    for alias, target in extra_aliases.items():
        if not isinstance(target, str) or target.strip().lower() not in devices:
            raise ConfigError(
                f"device catalog {source}: aliases.{alias} = {target!r} names no device of the catalog "
                f"(known: {', '.join(sorted(devices))})."
            )
        aliases[str(alias).lower()] = target.strip().lower()
    return Catalog(devices, aliases)


def _as_dict(dev: Device) -> dict[str, Any]:
    return {f.name: getattr(dev, f.name) for f in fields(Device)}


MAX_DEVICES = 10**7  # a cluster spelling beyond this is a typo (the largest training clusters hold ~10**5)
_CLUSTER = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9._-]+?)\s*(?:@\s*(\d+))?\s*$")


def parse_cluster(spec: str, catalog: Catalog) -> Cluster:
    """``NxDEVICE[@NODES]`` -> Cluster; nodes default to ceil(N / devices_per_node)."""
    m = _CLUSTER.match(spec or "")
    if not m:
        raise ConfigError(
            f"--cluster {spec!r} is not of the form NxDEVICE[@NODES], e.g. 32x910b@4 or 8xh100."
        )
    n, device = int(m.group(1)), catalog.get(m.group(2))
    if not 1 <= n <= MAX_DEVICES or m.group(3) and not 1 <= int(m.group(3)) <= MAX_DEVICES:
        raise ConfigError(
            f"--cluster {spec!r}: the numbers of devices and nodes must be in [1, {MAX_DEVICES:,}]."
        )
    nodes = int(m.group(3)) if m.group(3) else -(-n // device.devices_per_node)
    if nodes < 1 or n % nodes:
        raise ConfigError(f"--cluster {spec!r}: {n} devices cannot be split evenly over {nodes} nodes.")
    if n // nodes > device.devices_per_node:
        raise ConfigError(
            f"--cluster {spec!r}: {n // nodes} devices per node, but a {device.name} server holds "
            f"{device.devices_per_node}; use @{math.ceil(n / device.devices_per_node)} nodes or more."
        )
    return Cluster(device=device, num_devices=n, num_nodes=nodes)


# ----------------------------------------------------------------------------- the device a run trains on
RUNTIME_NAMES: tuple[tuple[str, str], ...] = (
    (r"\ba100\b.*\b40\s*gb\b", "a100-40gb"),
    (r"\ba100\b", "a100-80gb"),
    (r"\bh100\b.*\b96\s*gb\b", "h100-96gb"),
    (r"\bh100\b", "h100"),  # PCIe / NVL parts (lower peaks) take the SXM figure: set logging.peak_tflops
    (r"\bg?h200\b", "h200"),  # GH200's GPU has the H100/H200 peak
    (r"\bb200\b", "b200"),
    (r"\bl40s\b", "l40s"),
    (r"ascend\s*910\s*b", "ascend-910b"),  # torch_npu: Ascend910B1..B4
    (r"ascend\s*910_?93", "ascend-910c"),  # torch_npu: Ascend910_93xx (910C / Atlas A3)
    (r"ascend\s*910", "ascend-910a"),
)
"""(regex on the lower-cased name a runtime reports, catalog device); the first that matches wins."""


@lru_cache(maxsize=1)
def builtin_catalog() -> Catalog:
    """The built-in catalog, parsed once per process (do not mutate it; ``load_catalog()`` gives a fresh one)."""
    return load_catalog()
