"""The planner on long sequences: context parallel as the trainer runs it (all-gathered K/V, dense mask), the
chunked loss, activation offload and FP8 (plan/long_context.py, plan/gemm.py, plan/search.py)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from llmtrain.cli import main as cli_main
from llmtrain.config.loader import load_config
from llmtrain.config.schema import ModelConfig
from llmtrain.errors import ConfigError
from llmtrain.models import resolve_model_args
from llmtrain.plan import Layout, estimate_memory, estimate_step_time, load_catalog, parse_cluster
from llmtrain.plan.long_context import (
    cp_additive_mask_bytes,
    cp_bool_mask_bytes,
    cp_comm_bytes,
    cp_layer_bytes,
    logits_bytes,
    loss_chunk,
)
from llmtrain.plan.memory import block_input_bytes, layer_activation_bytes, layer_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_100B = os.path.join(ROOT, "configs/seed/100b_32card.yaml")
GIB = 2**30


def llama8b(seq: int = 32768):
    return resolve_model_args(ModelConfig(flavor="8b", seq_length=seq))


# --------------------------------------------------------------------------------------- context parallel
def test_cp_memory_per_rank_against_cp1():
    args, s = llama8b(), 32768
    kv = args.num_kv_heads * args.head_dim  # 8 x 128
    assert kv == 1024 and args.num_layers == 32
    base = Layout(dp_shard=8, zero_stage=3, seq_length=s, precision="bf16")
    one = estimate_memory(args, base)
    by_cp = {cp: estimate_memory(args, replace(base, cp=cp, dp_shard=8 // cp)) for cp in (2, 4)}
    for cp, est in by_cp.items():
        d = est.details
        # the rank's own tokens: seq / cp of them, the per-token count unchanged
        local = layer_bytes(args, replace(base, cp=cp)) - d["cp_gathered_kv_per_layer"]
        assert local == pytest.approx(one.details["activations_per_layer"] / cp)
        # SDPA keeps the gathered K and V (bf16): (cp - 1) / cp of the whole sequence's beyond the local ones
        assert d["cp_gathered_kv_per_layer"] == 2 * 2 * s * kv * (cp - 1) / cp
        # no mask of its own per layer (no ALiBi); one additive mask per micro-batch (bf16, no batch dim without
        # document masks) shared by all layers, and the bool mask
        assert d["cp_alibi_bias_per_layer"] == 0
        assert d["cp_additive_mask"] == 2 * (s / cp) * s and d["cp_mask"] == (s / cp) * s
        # FSDP shards over dp_shard x cp: the same 8 devices, the same state bytes
        assert est.parameters == pytest.approx(one.parameters) and est.gradients == pytest.approx(
            one.gradients
        )
        assert est.activations == pytest.approx(32 * d["activations_per_layer"] + s / cp * 4 * 4096)
    assert by_cp[2].details["cp_gathered_kv_per_layer"] == 33554432 * 2  # 64 MiB at cp 2
    assert by_cp[4].details["cp_additive_mask"] == by_cp[2].details["cp_additive_mask"] / 2  # 1 / cp
    assert by_cp[2].details["cp_additive_mask"] == GIB  # 16k x 32k x 2 bytes, once (not x 32 layers)
    doc = estimate_memory(args, replace(base, cp=2, dp_shard=4, micro_batch_size=2, document_mask=True))
    assert doc.details["cp_additive_mask"] == 2 * 2 * (s / 2) * s  # a batch dimension with document masks
    gpipe = estimate_memory(args, replace(base, cp=2, dp_shard=2, pp=2, grad_accum=4, schedule="gpipe"))
    assert gpipe.details["cp_additive_mask"] == 4 * GIB  # one per micro-batch in flight
    assert gpipe.details["cp_mask"] == GIB / 2  # the boolean mask: the current micro-batch's only
    mega = estimate_memory(args, replace(base, cp=2, dp_shard=4, engine="megatron"))
    assert mega.details["cp_gathered_kv_per_layer"] == mega.details["cp_mask"] == 0  # ring attention
    assert mega.details["cp_additive_mask"] == 0


def test_cp_mask_terms_with_a_window_and_with_alibi():
    base = Layout(cp=2, dp_shard=4, seq_length=8192)
    window = resolve_model_args(ModelConfig(flavor="8b", seq_length=8192, sliding_window=4096))
    assert cp_additive_mask_bytes(window, base) == 2 * 2 * 4096 * 8192  # the windowed twin too
    assert cp_bool_mask_bytes(window, base) == 2 * 4096 * 8192
    alibi = resolve_model_args(ModelConfig(model_type="baichuan2", flavor="debug_alibi", seq_length=8192))
    assert alibi.position_embedding == "alibi"
    # ALiBi builds its bias per layer (a head dimension): no shared additive mask
    assert cp_additive_mask_bytes(alibi, base) == 0
    assert cp_layer_bytes(alibi, base)["mask"] == 2 * alibi.num_heads * 4096 * 8192


def test_cp_comm_bytes_and_exposed_time_by_hand():
    from llmtrain.plan.timing import Efficiency, group_bandwidth

    args = llama8b(16384)
    lay = Layout(tp=2, cp=4, dp_shard=1, zero_stage=0, micro_batch_size=2, seq_length=16384)
    fwd, bwd = cp_comm_bytes(args, lay)
    whole = 2 * 2 * 16384 * 1024 / 2 * 2  # K and V of b x s tokens, kv / tp wide, bf16: 64 MiB
    assert fwd == bwd == 0.75 * whole == 50331648
    cluster = parse_cluster("8xh100", load_catalog())
    eff = Efficiency()
    bw = group_bandwidth(cluster, 4, 2, eff)
    assert bw == 450e9 * 0.8
    per_layer = (fwd / bw + 2 * eff.latency_s) + (bwd / bw + 2 * eff.latency_s)  # exposed, in line
    t = estimate_step_time(args, lay, cluster, fused=False)
    assert t.cp_exposed == pytest.approx(32 * per_layer, rel=1e-12)
    full = estimate_step_time(args, replace(lay, recompute="full"), cluster, fused=False)
    assert full.cp_exposed == pytest.approx(32 * (2 * (fwd / bw + 2 * eff.latency_s) + bwd / bw + 40e-6))
    ring = estimate_step_time(args, replace(lay, engine="megatron"), cluster, fused=False)
    assert ring.cp_exposed < t.cp_exposed  # the ring hides behind attention


def _debug_model(**model):
    from llmtrain.models import build_model

    args = resolve_model_args(ModelConfig(model_type="llama3", flavor="debug", **model))
    net = build_model(args)
    net.to_empty(device="cpu")
    net.init_weights(seed=0)
    return args, net


def _saved_by_layer(model, tokens: torch.Tensor) -> dict[int, tuple[int, set[str]]]:
    """Every storage autograd saves in a bf16-autocast forward of ``model`` (parameters aside): its bytes and
    the blocks (``layers.N``) that saved it, deduplicated by ``untyped_storage().data_ptr()``."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current, seen = [""], {}
    hooks = [m.register_forward_pre_hook(lambda mod, inp, n=name: current.__setitem__(0, n))
             for name, m in model.named_modules()]  # fmt: skip

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            nbytes, blocks = seen.setdefault(ptr, (t.untyped_storage().nbytes(), set()))
            blocks.add(".".join(current[0].split(".")[:2]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        model(tokens)
    for h in hooks:
        h.remove()
    return seen


def test_cp_saved_tensors_match_the_planner():
    """What SDPA keeps under the trainer's CP, counted with saved-tensor hooks on one process: the model gets a
    ``ContextParallel`` (its own masks, from ``shard``) whose gather concatenates cp copies (no saved tensors,
    like ``_GatherSeq``). A block saves no mask of its own: its extra bytes over the same tokens without CP are
    the planner's gathered K/V, to the byte; over the whole 2-layer forward the one additive mask every layer
    saved is counted once (storages deduplicated) and is the planner's per-micro-batch term, to the byte."""
    from llmtrain.distributed.context_parallel import ContextParallel
    from llmtrain.models.common.attention import Attention

    cp, local = 4, 32
    args, model = _debug_model(seq_length=cp * local)
    assert args.num_layers >= 2

    class OneProcessCP(ContextParallel):
        def gather_kv(self, k, v):
            return torch.cat([k] * cp, 2), torch.cat([v] * cp, 2)

    ids = torch.randint(0, args.vocab_size, (1, cp * local), generator=torch.Generator().manual_seed(0))
    stand_in = OneProcessCP(None, cp, 0, alibi=False, window=0)
    tokens = stand_in.shard({"input_ids": ids, "labels": ids, "position_ids": ids}, document_mask=False)
    plain = _saved_by_layer(model, tokens["input_ids"])
    model.context_parallel = stand_in
    for m in model.modules():
        if isinstance(m, Attention):
            m.context_parallel = stand_in
    with_cp = _saved_by_layer(model, tokens["input_ids"])

    def own(seen, block: str) -> int:
        return sum(n for n, blocks in seen.values() if blocks == {block})

    lay = Layout(cp=cp, seq_length=cp * local)
    terms, additive = cp_layer_bytes(args, lay), cp_additive_mask_bytes(args, lay)
    kv = args.num_kv_heads * args.head_dim
    assert terms["gathered_kv"] == 2 * 2 * local * (cp - 1) * kv and terms["mask"] == 0
    assert additive == 2 * local * cp * local  # bf16, local queries x all keys
    for i in range(args.num_layers):  # no mask copy of its own: only the gathered K/V
        assert own(with_cp, f"layers.{i}") - own(plain, f"layers.{i}") == terms["gathered_kv"]
    layers = {f"layers.{i}" for i in range(args.num_layers)}
    shared = [n for n, blocks in with_cp.values() if blocks == layers]
    assert shared == [additive]  # one storage, saved by every layer, counted once
    assert not [n for n, blocks in plain.values() if len(blocks) > 1]  # plain causal: no mask tensor at all
    total = sum(n for n, _ in with_cp.values()) - sum(n for n, _ in plain.values())
    assert total == args.num_layers * terms["gathered_kv"] + additive


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("bf16", [False, True])
def test_shared_additive_mask_gives_the_boolean_masks_numbers(monkeypatch, bf16, window):
    """Document masks through dense SDPA: the additive mask built once per forward gives bitwise the loss and
    gradients of the boolean mask SDPA converted per layer (the old path, forced through the dtype fallback)."""
    import torch.nn.functional as F

    from llmtrain.models.common import transformer

    model_kw: dict = {"seq_length": 24}
    if window:
        model_kw.update(sliding_window=window, sliding_window_layers=[0])
    args, model = _debug_model(**model_kw)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (2, 24), generator=gen)
    docs = torch.cumsum((torch.rand(2, 24, generator=gen) < 0.2).long(), dim=1)
    starts = torch.diff(docs, dim=1, prepend=docs[:, :1] - 1) > 0  # [B, T] first token of each document
    pos = torch.arange(24) - torch.cummax(torch.where(starts, torch.arange(24), 0), dim=1).values
    masks: list[torch.dtype] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a, attn_mask=None, **kw):
        masks.append(attn_mask.dtype if attn_mask is not None else None)
        return sdpa(*a, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(ids, position_ids=pos, document_ids=docs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    new_loss, new_grads = loss_and_grads()
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert masks == [dtype] * args.num_layers  # the shared additive mask(s), in the queries' dtype
    masks.clear()
    monkeypatch.setattr(transformer, "query_dtype", lambda x: torch.float64)  # no layer's dtype: the fallback
    old_loss, old_grads = loss_and_grads()
    assert masks == [torch.bool] * args.num_layers
    assert torch.equal(new_loss, old_loss)
    assert new_grads.keys() == old_grads.keys() and all(
        torch.equal(new_grads[n], old_grads[n]) for n in new_grads
    )


def _base_config(*overrides: str):
    return load_config(SEED_100B, ["train.compile=false", *overrides])[0]


@pytest.mark.parametrize(
    ("name", "overrides", "cluster", "cp_expected"),
    [
        ("dense-8b", ["model.flavor=8b", "model.seq_length=16384", "train.batch_size=32"], "16xh100", True),
        ("moe", ["model.flavor=debug", "model.moe.num_experts=8", "model.moe.top_k=2", "model.seq_length=4096",
                 "train.batch_size=16", "parallel.expert_parallel=1"], "8xh100", True),  # CP x MoE composes
        ("pp-70b", ["model.flavor=70b", "model.seq_length=8192", "train.batch_size=64"], "64xh100", True),
    ],
)  # fmt: skip
def test_search_proposes_only_layouts_training_accepts(name, overrides, cluster, cp_expected):
    from llmtrain.plan.search import candidate_layouts, layout_from_config
    from llmtrain.resolve.validate import check_config

    cfg = _base_config(
        *overrides,
        "parallel.tensor_parallel=1",
        "parallel.pipeline_parallel=1",
        "parallel.context_parallel=1",
    )
    cl = parse_cluster(cluster, load_catalog())
    base, args, tokens = layout_from_config(cfg, cl.num_devices)
    cands = candidate_layouts(args, base, cl, tokens // base.seq_length)
    assert cands
    assert any(c.cp > 1 for c in cands) == cp_expected
    assert all(c.tp * c.cp * c.dp * c.pp == cl.num_devices for c in cands if c.cp > 1)
    seen = set()
    for c in cands:  # every distinct layout through the trainer's own validation: no ConfigError
        # one micro-batch size each
        key = (c.tp, c.pp, c.cp, c.ep, c.zero_stage, c.schedule, c.virtual_stages)
        if key in seen:
            continue
        seen.add(key)
        par = replace(cfg.parallel, tensor_parallel=c.tp, pipeline_parallel=c.pp, context_parallel=c.cp,
                      data_parallel=c.dp, expert_parallel=c.ep, zero_stage=c.zero_stage, schedule=c.schedule,
                      virtual_stages=c.virtual_stages, pipeline_layers=None)  # fmt: skip
        run = replace(cfg, parallel=par, train=replace(cfg.train, micro_batch_size=c.micro_batch_size))
        check_config(run, cl.num_devices, require_data=False)
    if name == "pp-70b":
        assert any(c.pp > 1 for c in cands) and any(c.cp > 1 for c in cands)
    # context parallel composes with compile and fp8 now (tests/test_compose.py): the search keeps cp > 1 for
    # them; fp8 composes with tensor parallel too (tests/test_compose_rules.py)
    compiled = candidate_layouts(args, base, cl, tokens // base.seq_length, compile=True)
    assert compiled and any(c.cp > 1 for c in compiled) == cp_expected
    fp8 = candidate_layouts(args, replace(base, fp8="tensorwise"), cl, tokens // base.seq_length)
    assert fp8 and any(c.tp > 1 for c in fp8)


# ------------------------------------------------------------------------------------ chunked loss, offload
def test_chunked_loss_bounds_the_logits_at_vocab_128k():
    args, s = llama8b(8192), 8192
    assert args.vocab_size == 128256
    base = Layout(dp_shard=8, zero_stage=3, seq_length=s)
    plain = estimate_memory(args, replace(base, loss_chunk_tokens=0)).details["logits_and_loss"]
    auto = estimate_memory(args, base).details["logits_and_loss"]
    # 11.7 GiB: the log-softmax backward's saved fp32 output + fp32 gradient in + fp32 gradient out (the bf16
    # logits are freed with the forward; measured as the step's peak on CPU, tests/test_plan.py)
    assert plain == s * 128256 * (4 + 4 + 4) == 12608077824
    head_grad = 128256 * 4096 * 4  # one chunk's fp32 head weight gradient before it is accumulated
    assert loss_chunk(args, base) == 2048 and auto == 2048 * 128256 * 12 + head_grad
    assert logits_bytes(args, replace(base, loss_chunk_tokens=512), s) == 512 * 128256 * 12 + head_grad
    # under TP (loss parallel) the chunks run too, on each rank's V / tp columns: bf16 logits + one fp32 tensor
    tp2 = replace(base, tp=2, dp_shard=4)
    assert loss_chunk(args, tp2) == 2048
    assert logits_bytes(args, tp2, s) == 2048 * 128256 / 2 * (2 + 4) + head_grad / 2
    gathered = replace(tp2, loss_parallel=False)  # parallel.loss_parallel false: whole logits on each rank
    assert logits_bytes(args, gathered, s) == 2048 * 128256 * 12 + head_grad
    megatron = estimate_memory(args, replace(base, engine="megatron")).details["logits_and_loss"]
    assert megatron == s * 128256 * (2 + 4 + 4)  # its fused vocabulary-parallel loss: bf16 + fp32 + fp32
    cluster = parse_cluster("8xh100", load_catalog())  # the price: one more head forward
    t_plain = estimate_step_time(args, replace(base, loss_chunk_tokens=0), cluster, fused=True)
    assert estimate_step_time(args, base, cluster, fused=True).compute > t_plain.compute


def test_activation_offload_moves_saved_bytes_to_host():
    args = llama8b(8192)
    base = Layout(dp_shard=8, zero_stage=3, seq_length=8192, grad_accum=2)
    none, off = estimate_memory(args, base), estimate_memory(args, replace(base, recompute="offload"))
    block = none.details["activations_per_layer"]
    boundary = 8192 * block_input_bytes(base, args.hidden_size)
    assert block == 8192 * layer_activation_bytes(args, base)
    assert off.details["activations_offloaded"] == off.host_bytes == 32 * block
    assert none.activations == 32 * block + boundary and off.activations == block + boundary
    # one block stays on the device, but not while the logits peak, nor does one block's unsharded gradient
    # before its reduce-scatter or its backward's gradient temporaries (concurrency_overlap; the sharded
    # gradients accumulate over the 2 micro-batches, so they are live throughout)
    unsharded, temps = none.details["unsharded_gradients"], none.details["backward_temporaries"]
    assert temps == 8192 * 3 * 2 * args.intermediate_size == off.details["backward_temporaries"]
    assert unsharded > 0 and none.not_concurrent == pytest.approx(unsharded + temps)
    # offloaded, the chunked loss's logits (one 2048-token chunk of a 128k vocabulary and the head's weight-
    # gradient temporary) outweigh the block in hand with its gradient and temporaries: the smaller of the two
    # phases is what the sum counts twice, so the peak is the saved activations + logits in both runs and
    # offloading takes exactly the 32 blocks off it
    logits = off.details["logits_and_loss"]
    assert logits > block + unsharded + temps and off.not_concurrent == pytest.approx(
        block + unsharded + temps
    )
    assert none.total - off.total == pytest.approx(32 * block)
    cluster = parse_cluster("8xh100", load_catalog())
    t = estimate_step_time(args, replace(base, recompute="offload"), cluster, fused=True)
    assert cluster.device.host_link_gbps == 55
    assert t.offload == pytest.approx(2 * 2 * 32 * block / 55e9)  # out and back, 2 micro-batches
    assert t.total == pytest.approx(estimate_step_time(args, base, cluster, fused=True).total + t.offload)


# ------------------------------------------------------------------------------------------------------ FP8
def test_fp8_peaks_in_the_catalog():
    from llmtrain.plan.peak import fp8_peak_tflops

    cat = load_catalog()
    assert {n: cat.devices[n].peak_fp8_tflops for n in ("h100", "h200", "h800", "b200", "l40s")} == {
        "h100": 1979, "h200": 1979, "h800": 1979, "b200": 4500, "l40s": 733}  # fmt: skip
    assert fp8_peak_tflops("NVIDIA H100 80GB HBM3") == 1979 and fp8_peak_tflops("NVIDIA L40S") == 733
    with pytest.raises(ConfigError, match="a100-80gb"):
        fp8_peak_tflops("NVIDIA A100-SXM4-80GB")


def test_fp8_cast_traffic_by_hand():
    """Dynamic tensorwise scaling's casts (gemm.FP8_CAST_BYTES): 6 bytes per distinct linear input element
    (q/k/v share one, gate/up share one) and 4 per output-gradient element, over TP; none in bf16."""
    from llmtrain.plan.gemm import fp8_cast_bytes

    args, tokens = llama8b(8192), 8192.0
    h, q, kv, i = 4096, 4096, 1024, 14336
    for tp in (1, 2):
        lay = Layout(tp=tp, dp_shard=8 // tp, zero_stage=3, seq_length=8192, fp8="tensorwise")
        inputs = (h + q + h + i) / tp  # attention input, wo's input, the MLP input, w2's input
        outputs = (q + 2 * kv + h + 2 * i + h) / tp  # wq, wk, wv, wo, w1, w3, w2
        assert fp8_cast_bytes(args, lay, tokens, False) == pytest.approx(tokens * (6 * inputs + 4 * outputs))
        assert fp8_cast_bytes(args, replace(lay, fp8="none"), tokens, False) == 0.0


def test_fp8_linear_gemms_at_the_fp8_peak():
    from llmtrain.plan.gemm import GemmModel, block_gemm_time, gemm_time

    args, tokens = llama8b(8192), 8192.0
    dev = load_catalog().get("h100")
    bf16 = Layout(dp_shard=8, zero_stage=3, seq_length=8192)
    fp8 = replace(bf16, fp8="tensorwise")
    h, q, kv, i = 4096, 4096, 1024, 14336  # wq, wk, wv, wo, w1, w3, w2 of one block
    shapes = [(h, q, 1), (h, kv, 2), (q, h, 1), (h, i, 2), (i, h, 1)]
    g = GemmModel()

    e, bw = dev.matmul_efficiency, 3350e9 * g.bandwidth_fraction

    def by_hand(peak: float, inputs: int) -> float:  # fp8: 1-byte inputs, the bf16 output
        return sum(3 * c * (2 * tokens * n * k / (e * peak) + (inputs * (tokens * k + k * n) + 2 * tokens * n) / bw
                            + 4e-6) for k, n, c in shapes)  # fmt: skip

    assert block_gemm_time(args, fp8, dev, tokens, False, g)[0] == pytest.approx(
        by_hand(1979e12, 1), rel=1e-12
    )
    assert block_gemm_time(args, bf16, dev, tokens, False, g)[0] == pytest.approx(
        by_hand(989e12, 2), rel=1e-12
    )
    assert gemm_time(dev, 8192, 8192, 8192, 2, g, 1979e12) < gemm_time(dev, 8192, 8192, 8192, 2, g)
    cluster = parse_cluster("8xh100", load_catalog())
    t8, t16 = (estimate_step_time(args, lay, cluster, fused=True) for lay in (fp8, bf16))
    assert t8.total < t16.total and t8.model_flops == t16.model_flops
    # MoE: the routed experts (grouped, not nn.Linear) and the router stay at the bf16 peak: only the
    # attention projections gain
    moe_cfg = ModelConfig(flavor="8b", seq_length=8192)
    moe_cfg.moe.num_experts, moe_cfg.moe.top_k = 8, 2
    moe = resolve_model_args(moe_cfg)
    gain = (
        block_gemm_time(moe, bf16, dev, tokens, True, g)[0]
        - block_gemm_time(moe, fp8, dev, tokens, True, g)[0]
    )
    attn = sum(
        3 * c * (2 * tokens * n * k / e * (1 / 989e12 - 1 / 1979e12) + (tokens * k + k * n) / bw)
        for k, n, c in shapes[:3]
    )
    assert gain == pytest.approx(attn, rel=1e-9)
    with pytest.raises(ConfigError, match="a100-80gb"):
        estimate_step_time(args, fp8, parse_cluster("8xa100", load_catalog()), fused=True)


# --------------------------------------------------------------------------------------------- the commands
def _plan_json(capsys, *argv: str) -> dict:
    assert cli_main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_shows_cp_exposed_offload_and_fp8(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    common = [SEED_100B, "model.flavor=8b", "model.seq_length=16384", "train.batch_size=8", "train.compile=false",
              "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1", "parallel.context_parallel=2"]  # fmt: skip
    plain = _plan_json(capsys, *common[:-1], "--cluster", "8xh100")
    out = _plan_json(capsys, *common, "--cluster", "8xh100")
    assert out["step_time_parts_s"]["cp_exposed"] > 0
    det = out["memory_detail_bytes"]
    assert (
        det["cp_gathered_kv_per_layer"] == 2 * 2 * 16384 * 1024 / 2
        and det["cp_additive_mask"] == 2 * 8192 * 16384  # once per micro-batch, not per layer
        and det["cp_alibi_bias_per_layer"] == 0
    )
    assert cli_main(["plan", *common, "--cluster", "8xh100"]) == 0
    text = capsys.readouterr().out
    assert "CP exposed" in text and "of which CP gathered K/V, per layer" in text
    assert "CP additive mask (one for all layers)" in text and "CP ALiBi bias" not in text
    off = _plan_json(capsys, *common[:-1], "recompute.mode=offload", "--cluster", "8xh100")
    assert off["step_time_parts_s"]["offload"] > 0 and off["memory_detail_bytes"]["activations_offloaded"] > 0
    fp8 = _plan_json(
        capsys, *common[:-1], "train.fp8=tensorwise", "run.device_target=cuda", "--cluster", "8xh100"
    )
    assert (
        fp8["step_time_s"] < plain["step_time_s"] < off["step_time_s"] and "fp8-tensorwise" in fp8["layout"]
    )
    assert cli_main(["plan", *common[:-1], "train.fp8=tensorwise", "--cluster", "8xa100"]) == 2
    assert "a100-80gb" in capsys.readouterr().err


def test_check_prints_the_planned_cp_and_offload_lines():
    from llmtrain.check import long_context_lines
    from llmtrain.resolve.derived import derive

    cfg = _base_config("model.flavor=8b", "model.seq_length=16384", "train.batch_size=2",
                       "train.micro_batch_size=1", "parallel.tensor_parallel=1", "parallel.pipeline_parallel=1",
                       "parallel.context_parallel=2", "parallel.data_parallel=1", "recompute.mode=offload")  # fmt: skip
    rows = dict(long_context_lines(cfg, derive(cfg, 2)))
    # (cp - 1) / cp = 1/2 of K and V (16k tokens x 1024 x bf16 each): 32 MiB received per layer; the additive
    # mask 8k x 16k x bf16 once per micro-batch, shared by the layers
    assert "per layer 32 MiB received forward" in rows["context parallel"]
    assert (
        "saved per layer: gathered K/V 0.0312 GiB; per micro-batch: additive mask 0.25 GiB"
        in rows["context parallel"]
    )
    assert rows["recompute"].startswith("offload") and "GiB per micro-batch to host" in rows["recompute"]
    assert "chunked, 2048 tokens per chunk" in rows["loss logits"]
