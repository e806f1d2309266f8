"""Peak FLOP/s of the device a run trains on: the one source of the MFU denominator, planner and trainer alike.

:func:`peak_tflops` finds the device in the catalog (``devices.yaml``) by the name its runtime reports
(``torch.cuda.get_device_name``: ``NVIDIA A100-SXM4-40GB`` -> ``a100-40gb`` 312, ``NVIDIA H100 80GB HBM3`` ->
``h100`` 989; torch_npu: ``Ascend910B3`` -> ``ascend-910b`` 313), through :meth:`Catalog.match`. Fallbacks,
in order:

* a name the catalog does not know (an L4, an RTX card) takes the entry of its device type's alias in the
  catalog (``cuda`` -> h100, ``npu`` -> ascend-910b) with a warning that names ``logging.peak_tflops``;
* ``cpu`` is the catalog's ``cpu`` entry (a generic two-socket server);
* a device type the catalog has no alias for (``mps``, ``xpu``) gets :data:`FALLBACK_PEAK_TFLOPS`.

``logging.peak_tflops`` (the ``override`` argument) wins over all of it. :func:`fp8_peak_tflops` is a catalog
device's dense FP8 peak (``peak_fp8_tflops``: H100 / H200 1979, B200 4500, L40S 733), what the planner costs
``train.fp8``'s linear GEMMs at; a device without one is a ConfigError naming it. torch is imported only to ask a live
device for its name, so the planner imports this module without torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from llmtrain.errors import ConfigError
from llmtrain.plan.catalog import Catalog, builtin_catalog, fp8_peak_flops

if TYPE_CHECKING:
    import torch

FALLBACK_PEAK_TFLOPS = 1.0
"""TFLOP/s for a device type the catalog has no entry or alias for (MFU is then only a relative figure)."""

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_TYPES = ("cpu", "cuda", "npu", "mps", "xpu", "hpu", "meta")


def runtime_device_name(device: torch.device | str) -> str | None:
    """The name the runtime reports for a live ``cuda``/``npu`` device (None when there is none to ask)."""
    import torch  # only here, so the planner imports this module without torch

    device = torch.device(device)
    mod = getattr(torch, device.type, None) if device.type in ("cuda", "npu") else None
    if mod is None or not mod.is_available():
        return None
    try:
        return str(mod.get_device_name(device.index if device.index is not None else mod.current_device()))
    except Exception:  # a backend that cannot name its device falls back like an unknown name
        return None


def peak_tflops(
    device: torch.device | str,
    precision: str = "bf16",
    override: float | None = None,
    catalog: Catalog | None = None,
) -> float:
    """Peak dense TFLOP/s of one device, the denominator of MFU (fallbacks in the module docstring).

    ``device`` is a torch device or its spelling (``cuda``, ``cuda:1``, ``npu:0``, ``cpu``), whose runtime name
    is looked up, or a device name itself (``h100``, ``NVIDIA A100-SXM4-40GB``; a ConfigError when unknown).
    ``precision`` is the run's ``train.precision`` (fp32, bf16, fp16): the catalog lists the dense bf16/fp16
    tensor peak only, and MFU is measured against that peak whatever the run computes in (the usual convention,
    and what the planner assumes). ``override`` (``logging.peak_tflops``), when set, wins."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if override:
        return float(override)
    catalog = catalog or builtin_catalog()
    text = str(device).strip()
    kind = text.split(":", 1)[0].lower()
    if kind not in DEVICE_TYPES:  # a device name, not a torch device
        found = catalog.match(text)
        if found is None:
            raise ConfigError(f"device {text!r} is not in the device catalog; set logging.peak_tflops.")
        return float(found.peak_tflops)
    name = runtime_device_name(text) if kind in ("cuda", "npu") else None
    found = catalog.match(name) if name else None
    if found is not None:
        return float(found.peak_tflops)
    fallback = catalog.match(kind)
    if name:
        figure = f"{fallback.name}'s {fallback.peak_tflops:g}" if fallback else f"{FALLBACK_PEAK_TFLOPS:g}"
        warnings.warn(
            f"{kind} device {name!r} is not in the device catalog; MFU uses {figure} TFLOP/s. Set "
            "logging.peak_tflops to its dense bf16 peak.",
            stacklevel=2,
        )
    return float(fallback.peak_tflops) if fallback is not None else FALLBACK_PEAK_TFLOPS


def fp8_peak_tflops(device: str, recipe: str = "tensorwise", catalog: Catalog | None = None) -> float:
    """Dense FP8 TFLOP/s of the catalog device ``device`` (a catalog or runtime name); a ConfigError naming the
    device when the catalog does not know it or it has no FP8 peak (``train.fp8`` = ``recipe`` cannot run)."""
    catalog = catalog or builtin_catalog()
    found = catalog.match(str(device))
    if found is None:
        raise ConfigError(f"device {device!r} is not in the device catalog; add it with --catalog FILE.yaml.")
    return fp8_peak_flops(found, recipe) / 1e12
