"""Gradient reduction once per optimizer step under gradient accumulation, and FP8 (train.fp8) on FSDP.

One torchrun launch (2 gloo ranks, llama3 debug, seq 32, global batch 8, 2 steps) runs every variant; the
worker wraps torch.distributed's collectives and sums the bytes of the real calls per step
(tests/distributed/worker.py, ``CommCounter``). Accumulation 1 is micro-batch 4 (8 = 4 x dp 2), accumulation 4
is micro-batch 1. The expected bytes come from the model itself: 4 bytes x its parameters (fp32), and for fp8
1 byte x the converted weights' elements.

* bytes: ZeRO 0 and HSDP (replicate 2 x shard 1, ZeRO 3) all-reduce the gradient once per step, ZeRO 1/2
  reduce-scatter and all-gather once per step: the same bytes with accumulation 4 as with 1, and 4x with
  ``parallel.reduce_grads: per_microbatch``, which shows that the counter sees FSDP's reductions. ZeRO 3
  reduce-scatters per micro-batch by default (4x) and once with ``per_step``; its all-gathers (forward +
  backward, per micro-batch) are its design: 8x in both.
* parity: with accumulation 4, losses, grad norms and the parameters after 2 steps equal those of
  ``per_microbatch`` (the suite's parity rule; parameters as Adam's bound allows:
  conftest.assert_same_adam_update) and the single-process losses (1e-5), also with CPU offload.
* fp8 (torchao's emulated GEMMs on CPU, ``float8.EMULATE``): tensorwise under ZeRO 2 all-gathers the
  converted weights in fp8 (1 byte each), rowwise in fp32; FSDP runs equal single-process fp8 runs; a
  converted layer computes exactly the fp8 quantization of an independent reference; the config rules.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import assert_same_adam_update
from llmtrain.config import config_from_dict
from llmtrain.distributed import float8
from llmtrain.errors import ConfigError
from llmtrain.models import FAMILIES, build_model
from llmtrain.resolve import validate
from llmtrain.train.trainer import Trainer
from test_parallel import base, close, launch  # tests/ is on sys.path under pytest

HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="train.fp8 needs torchao (the fp8 / dev extra)")
STEPS = 2
LR = 3e-3  # the peak learning rate of test_parallel.base (warm-up: every step's lr is at most this)
# The step's own all-reduces: target-token count (int64) + loss sum (fp32), and, every step being a log step
# here (log_steps 1), the health metrics' one float64 all-reduce (train/health.py): the squared grad and param
# norms of each of the 2 blocks, 4 figures (logit sum of squares and count, non-finite and value counts) and one
# q/k-bound slot per rank (2 ranks).
HEALTH = 8 * (2 * 2 + 4 + 2)
SCALARS = 12 + HEALTH


def variants(tmp) -> dict[str, dict]:
    out: dict[str, dict] = {}
    layouts = {
        "z0": {"zero_stage": 0},
        "z1": {"zero_stage": 1},
        "z2": {"zero_stage": 2},
        "z3": {"zero_stage": 3},
        "hsdp": {"zero_stage": 3, "data_parallel_replicate": 2},
    }
    for name, par in layouts.items():
        if name not in ("z1", "z3"):  # (their accumulation-4 bytes are checked against the model's size)
            out[f"{name}:acc1"] = {"parallel": par, "train": {"micro_batch_size": 4}, "count_comm": True}
        out[f"{name}:acc4"] = {"parallel": par, "count_comm": True}
        if name not in ("z1", "hsdp"):  # z1 is built as z2; HSDP's parity partner is z0:acc4_pmb (same math)
            out[f"{name}:acc4_pmb"] = {
                "parallel": {**par, "reduce_grads": "per_microbatch"},
                "count_comm": True,
            }
    out["z3:acc4_ps"] = {"parallel": {"zero_stage": 3, "reduce_grads": "per_step"}, "count_comm": True}
    out["z2off:acc4"] = {"parallel": {"zero_stage": 2, "cpu_offload": True}}
    for recipe in ("tensorwise", "rowwise") if HAVE_TORCHAO else ():
        out[f"fp8_{recipe}:acc4"] = {
            "parallel": {"zero_stage": 2}, "train": {"fp8": recipe}, "count_comm": True, "fp8_emulate": True,
        }  # fmt: skip
    if (
        HAVE_TORCHAO
    ):  # ZeRO 3 + fp8 all-gather: save after 2 steps, then resume into the same layout (steps 3-4)
        fp8 = {"parallel": {"zero_stage": 3}, "train": {"fp8": "tensorwise"}, "fp8_emulate": True}
        out["fp8_z3_save:acc4"] = {
            **fp8,
            "checkpoint": {"save_dir": str(tmp / "fp8ck")},
            "save_after_steps": True,
        }
        out["fp8_z3_resume:acc4"] = {
            **fp8,
            "checkpoint": {"resume": str(tmp / "fp8ck" / f"step_{STEPS:08d}")},
        }
    return out


def run_base(prefix: str) -> dict:
    cfg = base(prefix, "llama3")
    cfg["train"]["micro_batch_size"] = 1
    return cfg


@pytest.fixture(scope="module")
def launched(tiny_corpus, tmp_path_factory) -> tuple[dict, dict, Path]:
    """(results by variant, state dicts after the steps by variant, its directory) of the one launch."""
    tmp = tmp_path_factory.mktemp("grad-sync")
    specs = variants(tmp)
    for name, spec in specs.items():
        if not name.endswith(":acc1"):  # every accumulation-4 run: its parameters after the steps
            spec["dump_state"] = str(tmp / f"{name.replace(':', '_')}.pt")
    results = launch(2, {"base": run_base(tiny_corpus), "steps": STEPS, "variants": specs}, tmp)
    states = {
        n: torch.load(s["dump_state"], weights_only=True) for n, s in specs.items() if "dump_state" in s
    }
    return results, states, tmp


@pytest.fixture(scope="module")
def fp8_single(tiny_corpus, tmp_path_factory) -> dict[str, list[float]]:
    """Single-process emulated fp8 losses: tensorwise for 4 steps, rowwise for 2."""
    tmp, before = tmp_path_factory.mktemp("fp8-single"), float8.EMULATE
    float8.EMULATE = True
    try:
        return {
            r: single_process(tiny_corpus, tmp, r, n)
            for r, n in (("tensorwise", 2 * STEPS), ("rowwise", STEPS))
        }
    finally:
        float8.EMULATE = before


def single_process(prefix: str, tmp_path, fp8: str = "none", steps: int = STEPS) -> list[float]:
    """Losses of ``steps`` steps of the same run in this process (global batch 8 = 8 micro-batches)."""
    cfg = run_base(prefix)
    cfg["train"]["fp8"] = fp8
    cfg["run"]["output_dir"] = str(tmp_path / f"single-{fp8}-{steps}")
    t = Trainer(config_from_dict(cfg))
    losses = [t.train_step()["loss"] for _ in range(steps)]
    t.metrics.close()
    return losses


def model_sizes() -> tuple[int, int]:
    """(parameters, elements of the weights train.fp8 converts) of the test model, counted on the model."""
    args = dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"), seq_length=32)
    model = build_model(args, device="meta")
    fp8 = sum(m.weight.numel() for n, m in model.named_modules() if float8._converts(m, n))
    return sum(p.numel() for p in model.parameters()), fp8


def step_bytes(result: dict) -> list[dict[str, int]]:
    return [c["bytes"] for c in result["comm"]]


def test_dp_bytes_per_step_do_not_grow_with_accumulation(launched):
    results, _, _ = launched
    grad = 4 * model_sizes()[0]  # 754,944 bytes: one fp32 gradient (or parameter) of the whole model
    assert grad == 754_944
    for stage in ("z0", "hsdp"):  # replicate dim: one all-reduce of the gradient per step
        for k, want in (("acc1", grad), ("acc4", grad), ("acc4_pmb", 4 * grad)):
            if f"{stage}:{k}" not in results:
                continue
            for b in step_bytes(results[f"{stage}:{k}"]):
                assert b == {"all_reduce": want + SCALARS}, (stage, k, b)
    for stage in ("z1", "z2"):  # reduce-scatter + all-gather, once per step (4x per micro-batch)
        for k in ("acc1", "acc4", "acc4_pmb"):
            if f"{stage}:{k}" not in results:
                continue
            want = 4 * grad if k == "acc4_pmb" else grad
            for b in step_bytes(results[f"{stage}:{k}"]):
                assert b == {"all_reduce": SCALARS, "reduce_scatter_single": want, "all_gather_single": want}
    z3 = {k: step_bytes(results[f"z3:{k}"]) for k in ("acc4", "acc4_pmb", "acc4_ps")}
    for k, (scatter, gather) in {
        "acc4": (4 * grad, 8 * grad), "acc4_pmb": (4 * grad, 8 * grad), "acc4_ps": (grad, 8 * grad),
    }.items():  # fmt: skip
        for b in z3[k]:
            assert b == {"all_reduce": SCALARS, "reduce_scatter_single": scatter, "all_gather_single": gather}
    # The sum over every data-parallel collective: accumulation 4 moves what accumulation 1 moves.
    for stage, one_of in (("z0", "z0"), ("z1", "z2"), ("z2", "z2"), ("hsdp", "hsdp")):
        one = sum(step_bytes(results[f"{one_of}:acc1"])[-1].values())
        four = sum(step_bytes(results[f"{stage}:acc4"])[-1].values())
        assert four == one, (stage, one, four)


def test_once_per_step_keeps_losses_and_parameters(launched, tiny_corpus, tmp_path):
    results, states, _ = launched
    reference = single_process(tiny_corpus, tmp_path)
    pairs = [("z0:acc4", "z0:acc4_pmb"), ("z2:acc4", "z2:acc4_pmb"), ("z3:acc4_ps", "z3:acc4_pmb"),
             ("hsdp:acc4", "z0:acc4_pmb"), ("z2off:acc4", "z2:acc4_pmb")]  # fmt: skip
    for once, every in pairs:
        a, b = results[once], results[every]
        close(once, a, b)  # the same math summed in another order: the suite's parity rule
        close(once, a, {"loss": reference, "grad_norm": b["grad_norm"]})
        sa, sb = states[once], states[every]
        assert len(sa) == 2 * 9 + 3  # 9 tensors per block, embedding, norm, head
        assert_same_adam_update(once, sa, sb, STEPS * LR)
        assert_same_adam_update(once, sa, states["z2:acc4_pmb"], STEPS * LR)
    # the parameters really moved in the 2 steps (lr 3e-3 warming up): the bound is not a comparison of inits
    init = build_model(
        dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"), seq_length=32), device="cpu"
    )
    init.init_weights(seed=11)
    start = init.state_dict()
    assert min(float((states["z2:acc4"][k] - start[k]).abs().max()) for k in start) > 1e-4


@needs_torchao
def test_fp8_fsdp_all_gathers_fp8_weights_and_matches_one_process(launched, fp8_single):
    results, states, _ = launched
    params, converted = model_sizes()
    assert converted == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 256)  # wq wo wk wv w1 w2 w3 of 2 blocks
    tensorwise = {"all_reduce": SCALARS, "reduce_scatter_single": 4 * params,
                  "all_gather_single": converted * 1 + (params - converted) * 4}  # fmt: skip
    rowwise = {**tensorwise, "all_gather_single": 4 * params}
    assert tensorwise["all_gather_single"] == 386_304
    for b in step_bytes(results["fp8_tensorwise:acc4"]):
        assert b == tensorwise
    for b in step_bytes(results["fp8_rowwise:acc4"]):
        assert b == rowwise
    fp32, single = results["z2:acc4"]["loss"], fp8_single
    for name, recipe in (
        ("fp8_tensorwise", "tensorwise"),
        ("fp8_rowwise", "rowwise"),
        ("fp8_z3_save", "tensorwise"),
    ):
        got = results[f"{name}:acc4"]["loss"]
        for x, y, z in zip(got, single[recipe], fp32):
            assert abs(x - y) < 1e-5, (name, got, single[recipe])
            assert 1e-5 < abs(x - z) < 1e-2, (name, got, fp32)  # really quantized, and still close
    # fp8 keeps parameter names (checkpoints move between fp8 and bf16 runs)
    assert set(states["fp8_tensorwise:acc4"]) == set(states["z2:acc4"])


@needs_torchao
def test_fp8_all_gather_checkpoint_loads_plain_and_resumes(launched, fp8_single, tiny_corpus, tmp_path):
    """The ZeRO 3 fp8 checkpoint (weights wrapped by torchao for the fp8 all-gather) holds plain tensors: it
    loads bit for bit into a single-process fp32 run, and resumed under fp8 ZeRO 3 it continues with the
    losses of an uninterrupted single-process fp8 run (steps 3-4)."""
    results, states, tmp = launched
    cfg = run_base(tiny_corpus)  # fp32, no fp8: the checkpoint must not need torchao's classes
    cfg["run"]["output_dir"] = str(tmp_path / "load")
    cfg["checkpoint"]["resume"] = str(tmp / "fp8ck" / f"step_{STEPS:08d}")
    loaded = Trainer(config_from_dict(cfg))
    assert loaded.step == STEPS
    state, saved = loaded.model.state_dict(), states["fp8_z3_save:acc4"]
    assert set(state) == set(saved)
    for key, value in saved.items():
        assert type(state[key]) is torch.Tensor and torch.equal(state[key], value), key
    loaded.metrics.close()
    uninterrupted = fp8_single["tensorwise"]
    resumed = results["fp8_z3_resume:acc4"]["loss"]
    for x, y in zip(resumed, uninterrupted[STEPS:]):
        assert abs(x - y) < 1e-5, (resumed, uninterrupted)


def _quantize(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """fp8 e4m3 round trip with a dynamic scale 448 / amax (per row, scale rounded down to a power of 2, for
    rowwise): the reference for torchao's casts."""
    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().max()
    scale = (448.0 / amax.double().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t * scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() / scale


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_linear_computes_fp8(recipe, monkeypatch):
    monkeypatch.setattr(float8, "EMULATE", True)
    args = dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"), seq_length=32)
    model = build_model(args, device="cpu")
    model.init_weights(seed=3)
    names = [n for n, _ in model.named_parameters()]
    cfg = config_from_dict({"train": {"fp8": recipe}, "run": {"device_target": "cpu"}})
    assert float8.apply_float8(model, cfg, "cpu", fsdp_all_gather=False) == 14
    assert [n for n, _ in model.named_parameters()] == names
    swapped = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    assert len(swapped) == 14 and all(n.startswith("layers.") for n in swapped)
    assert type(model.output) is nn.Linear  # the head stays in high precision
    wq = model.layers["0"].attention.wq
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    want = _quantize(x, recipe == "rowwise") @ _quantize(wq.weight.detach(), recipe == "rowwise").T
    got = wq(x).detach()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), float((got - want).abs().max())
    plain = x @ wq.weight.detach().T
    assert float((got - plain).abs().max()) > 1e-4  # quantization really happened


def test_fp8_config_rules(tiny_corpus, monkeypatch):
    def cfg(**sections) -> object:
        raw = run_base(tiny_corpus)
        for key, values in sections.items():
            raw[key] = {**raw.get(key, {}), **values}
        return config_from_dict(raw)

    with pytest.raises(ConfigError, match="run.device_target is cpu"):
        validate(cfg(train={"fp8": "tensorwise"}), world_size=1, require_data=False)
    with pytest.raises(ConfigError, match="run.device_target is npu"):
        validate(
            cfg(train={"fp8": "rowwise"}, run={"device_target": "npu"}), world_size=1, require_data=False
        )
    # fp8 under tensor parallel trains (tests/test_compose_rules.py): no config rule refuses it
    assert float8.config_problem(
        cfg(train={"fp8": "tensorwise"}, run={"device_target": "cuda"}, parallel={"tensor_parallel": 2})
    ) is None  # fmt: skip
    with pytest.raises(ConfigError, match="train.fp8"):
        validate(cfg(train={"fp8": "e4m3"}), world_size=1, require_data=False)
    if not torch.cuda.is_available():
        auto = cfg(train={"fp8": "tensorwise"}, run={"device_target": "auto"})
        with pytest.raises(ConfigError, match="no CUDA device, so the run would train on the CPU"):
            validate(auto, world_size=1, require_data=True)
        warnings = validate(auto, world_size=1, require_data=False)  # `check` on a machine without a GPU
        assert any("no CUDA device here to check" in w for w in warnings)
        assert any("without train.compile" in w for w in warnings)
    # the device rule, from the device's facts
    assert "8.0; set train.fp8: none." in float8.device_problem("tensorwise", (8, 0), "NVIDIA A100-SXM4-80GB")
    assert float8.device_problem("tensorwise", (8, 9), "NVIDIA L40S") is None
    assert "or tensorwise" in float8.device_problem("rowwise", (8, 9), "NVIDIA L40S")
    assert float8.device_problem("rowwise", (9, 0), "NVIDIA H200") is None
    # building on a CPU refuses (a Trainer built without validation, e.g. from Python)
    model = build_model(
        dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"), seq_length=32), device="meta"
    )
    with pytest.raises(ConfigError, match="trains on cpu"):
        float8.apply_float8(
            model, cfg(train={"fp8": "tensorwise"}, run={"device_target": "cuda"}), "cpu", False
        )
    # torchao missing: one sentence naming the extra
    from importlib import metadata

    def absent(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", absent)
    assert "pip install 'llmtrain[fp8]'" in str(float8.torchao_problem("tensorwise"))
