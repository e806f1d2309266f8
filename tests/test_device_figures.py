"""One source for device figures: MFU's peak FLOP/s from the planner's catalog, one memory-statistics function."""

import warnings

import pytest
import torch

from llmtrain.errors import ConfigError
from llmtrain.plan.catalog import load_catalog
from llmtrain.plan.peak import FALLBACK_PEAK_TFLOPS, peak_tflops
from llmtrain.train.timing import memory_stats

CATALOG = load_catalog()


def _gpu_named(monkeypatch, name):
    """Pretend one CUDA device called ``name`` is present (no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


@pytest.mark.parametrize(
    ("runtime_name", "entry"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
    ],
)
def test_cuda_name_maps_to_its_catalog_peak(monkeypatch, runtime_name, entry):
    _gpu_named(monkeypatch, runtime_name)
    want = CATALOG.devices[entry].peak_tflops
    assert peak_tflops(torch.device("cuda", 0), "bf16", None) == want
    assert peak_tflops("cuda", "bf16", None) == want  # the spelling works as well as a torch.device
    assert peak_tflops(runtime_name, "bf16", None) == want  # and the name itself, without torch


def test_a100_is_not_counted_as_an_h100(monkeypatch):
    _gpu_named(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert peak_tflops(torch.device("cuda"), "bf16", None) == 312.0
    _gpu_named(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert peak_tflops(torch.device("cuda"), "bf16", None) == 989.0


def test_unknown_cuda_name_falls_back_to_the_cuda_alias_with_a_warning(monkeypatch):
    _gpu_named(monkeypatch, "NVIDIA RTX A1000")  # "a100" inside a longer word is not an A100
    with pytest.warns(UserWarning, match="not in the device catalog.*logging.peak_tflops"):
        got = peak_tflops(torch.device("cuda", 0), "bf16", None)
    assert got == CATALOG.get(CATALOG.aliases["cuda"]).peak_tflops == 989.0


def test_cuda_without_a_device_falls_back_silently():
    if torch.cuda.is_available():
        pytest.skip("a real GPU is present")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_tflops("cuda", "bf16", None) == CATALOG.get("cuda").peak_tflops


def test_cpu_npu_and_unknown_device_types():
    assert peak_tflops("cpu", "fp32", None) == CATALOG.devices["cpu"].peak_tflops
    assert peak_tflops(torch.device("cpu"), "bf16", None) == CATALOG.devices["cpu"].peak_tflops
    assert peak_tflops("Ascend910B3", "bf16", None) == CATALOG.devices["ascend-910b"].peak_tflops
    assert peak_tflops("Ascend910_9392", "bf16", None) == CATALOG.devices["ascend-910c"].peak_tflops
    assert peak_tflops("mps", "bf16", None) == FALLBACK_PEAK_TFLOPS
    with pytest.raises(ConfigError, match="not in the device catalog"):
        peak_tflops("tpu-v5p", "bf16", None)


def test_override_wins(monkeypatch):
    _gpu_named(monkeypatch, "NVIDIA A100-SXM4-80GB")
    assert peak_tflops(torch.device("cuda"), "bf16", 123.5) == 123.5
    assert peak_tflops("cpu", "fp32", 7.0) == 7.0
    assert peak_tflops("tpu-v5p", "bf16", 50.0) == 50.0  # no catalog lookup when the figure is given


def test_precision_is_checked():
    with pytest.raises(ValueError, match="precision"):
        peak_tflops("cpu", "int8", None)


def test_one_memory_function_gives_every_row_field():
    mem = memory_stats("cpu")
    assert set(mem) == {
        "memory_bytes",
        "memory_current_bytes",
        "memory_peak_bytes",
        "memory_capacity_bytes",
        "memory_frac",
    }
    assert mem["memory_bytes"] == mem["memory_peak_bytes"] >= mem["memory_current_bytes"] > 0
    assert mem["memory_frac"] == pytest.approx(mem["memory_peak_bytes"] / mem["memory_capacity_bytes"])
