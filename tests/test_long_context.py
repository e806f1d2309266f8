"""Long packed sequences: chunked cross-entropy (loss/gradient parity with the plain loss, no ``[tokens, vocab]``
tensor held), FlexAttention block masks vs the dense SDPA masks (llama3, qwen3, baichuan2 ALiBi), activation
offload (loss parity, the hooks really moved the saved tensors)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.models import FAMILIES, build_model
from llmtrain.train.loss import AUTO_CHUNK_TOKENS, HeadLoss, chunked_head_loss, resolve_loss_chunk
from llmtrain.train.step import TokenLoss


def materialised(family: str, flavor: str = "debug", seed: int = 0, **overrides):
    args = dataclasses.replace(FAMILIES[family].flavor_args(flavor), **overrides)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created inside the mode (forward and backward on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage ptr -> [bytes, python tensors alive]
        self.now = self.peak = self.largest = 0

    def _drop(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if ptr not in self.live:
                    self.live[ptr] = [nbytes, 0]
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
                    self.largest = max(self.largest, nbytes)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._drop, ptr)
        return out


def _head_case(tied: bool, smoothing: float):
    torch.manual_seed(0)
    n, dim, vocab = 96, 16, 1000
    emb = torch.nn.Embedding(vocab, dim)
    torch.nn.init.normal_(emb.weight, std=0.3)  # logits of a trained-like scale (loss near log(vocab))
    head = torch.nn.Linear(dim, vocab, bias=False)
    if tied:
        head.weight = emb.weight
    ids = torch.randint(0, vocab, (2, n // 2))
    labels = torch.randint(0, vocab, (2, n // 2))
    labels[0, :7] = -100  # ignored targets, inside one chunk
    return emb, head, ids, labels


@pytest.mark.parametrize(("tied", "smoothing", "chunk"), [(False, 0.0, 32), (True, 0.1, 40), (False, 0.2, 7)])
def test_chunked_loss_and_gradients_match_the_plain_loss(tied: bool, smoothing: float, chunk: int) -> None:
    results = []
    for chunked in (False, True):
        emb, head, ids, labels = _head_case(tied, smoothing)
        h = torch.tanh(emb(ids))  # [B, T, dim], a non-leaf like the final norm's output
        if chunked:
            loss = chunked_head_loss(h, head, labels, chunk, smoothing)
        else:
            loss = TokenLoss(smoothing)(head(h), labels)
        loss.backward()
        results.append((loss.detach() / 89, emb.weight.grad.clone(), head.weight.grad.clone()))
    (plain, g_emb, g_head), (chunk_loss, c_emb, c_head) = results
    assert abs(plain.item() - chunk_loss.item()) < 1e-6
    assert (g_emb - c_emb).abs().max().item() < 1e-6
    assert (g_head - c_head).abs().max().item() < 1e-6
    assert g_emb.abs().max().item() > 1e-4  # the gradients are not trivially zero


def test_chunked_loss_never_holds_tokens_by_vocab() -> None:
    torch.manual_seed(0)
    n, dim, vocab, chunk = 512, 8, 4096, 64
    full_logits = n * vocab * 4  # fp32 [tokens, vocab]: 8 MiB
    peaks = {}
    for chunked in (False, True):
        head = torch.nn.Linear(dim, vocab, bias=False)
        x = torch.randn(1, n, dim, requires_grad=True)
        labels = torch.randint(0, vocab, (1, n))
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.untyped_storage().nbytes())
            return t

        with LiveBytes() as mode:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = x * 1.0
                loss = chunked_head_loss(h, head, labels, chunk) if chunked else TokenLoss()(head(h), labels)
            loss.backward()
        peaks[chunked] = (mode.peak, mode.largest, max(saved))
    plain_peak, plain_largest, plain_saved = peaks[False]
    peak, largest, saved_max = peaks[True]
    assert plain_largest >= full_logits and plain_saved >= full_logits  # the plain loss holds them
    assert largest <= chunk * vocab * 4 and saved_max < full_logits // 8  # one chunk at most, saved: none
    assert peak < plain_peak / 4 and peak < full_logits / 2


def test_model_forward_with_head_loss_matches_logits_loss_and_auto_rule() -> None:
    model = materialised("qwen3", seed=1, tie_word_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    ids = torch.randint(0, model.args.vocab_size, (2, 24))
    labels = torch.roll(ids, -1, 1)
    plain = TokenLoss(0.1)(model(ids), labels)
    plain.backward()
    g_plain = model.tok_embeddings.weight.grad.clone()
    model.zero_grad()
    chunked = model(ids, labels=labels, head_loss=HeadLoss(10, 0.1))
    chunked.backward()
    assert abs(plain.item() - chunked.item()) / 48 < 1e-6
    assert (g_plain - model.tok_embeddings.weight.grad).abs().max().item() < 1e-6
    assert resolve_loss_chunk(None, 128256) == AUTO_CHUNK_TOKENS and resolve_loss_chunk(None, 32000) == 0
    assert resolve_loss_chunk(0, 128256) == 0 and resolve_loss_chunk(512, 1000) == 512


def _packed(vocab: int, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    ids = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, ids, doc_ids, pos


@pytest.mark.parametrize(
    ("family", "flavor", "window"),
    [("llama3", "debug", 0), ("qwen3", "debug", 0), ("qwen3", "debug", 6), ("baichuan2", "debug_alibi", 0)],
)
def test_flex_block_mask_matches_dense_mask_and_packed_equals_alone(
    family: str, flavor: str, window: int
) -> None:
    model = materialised(family, flavor, seed=5, sliding_window=window).eval()
    lengths = [37, 90, 3, 70]  # 200 tokens: two 128-token blocks, a partial one, documents across blocks
    docs, ids, doc_ids, pos = _packed(model.args.vocab_size, lengths)
    ids, doc_ids, pos = ids.repeat(2, 1), doc_ids.repeat(2, 1), pos.repeat(2, 1)
    doc_ids[1] = torch.arange(200) // 50  # a second sample with other boundaries
    pos[1] = torch.arange(200) % 50
    with torch.no_grad():
        model.attention_impl = "sdpa"
        dense = model(ids, position_ids=pos, document_ids=doc_ids)  # [2, 200, V]
        causal_dense = model(ids)
        model.attention_impl = "flex"
        flex = model(ids, position_ids=pos, document_ids=doc_ids)
        causal_flex = model(ids)  # flex with the plain causal mask mod
        start = 0
        for doc in docs:  # packed vs alone, through flex
            alone = model(doc[None])[0]
            assert (flex[0, start : start + len(doc)] - alone).abs().max().item() < 1e-5
            start += len(doc)
    assert (flex - dense).abs().max().item() < 1e-5
    assert (causal_flex - causal_dense).abs().max().item() < 1e-5
    assert (flex - causal_flex).abs().max().item() > 1e-3  # the document mask matters


def test_flex_mask_is_block_sparse_and_auto_picks_by_device() -> None:
    from llmtrain.models.common.flex import choose_attention, document_block_mask

    t = 1024
    doc_ids = (torch.arange(t) // 128)[None]  # eight 128-token documents
    mask = document_block_mask(doc_ids, t, t, torch.device("cpu"))
    kv_blocks = int(mask.block.kv_num_blocks.sum()) + int(mask.block.full_kv_num_blocks.sum())
    assert kv_blocks == 8  # only the diagonal tiles of the 8 x 8 grid (causal alone would be 36)
    causal = document_block_mask(None, t, t, torch.device("cpu"))
    assert int(causal.block.kv_num_blocks.sum()) + int(causal.block.full_kv_num_blocks.sum()) == 36
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_attention("auto", doc_ids, 0, cpu) == "sdpa"  # no flex backward on CPU (torch 2.13)
    assert (
        choose_attention("auto", doc_ids, 0, cuda) == "flex"
        and choose_attention("auto", None, 0, cuda) == "sdpa"
    )
    assert choose_attention("flex", doc_ids, 4, cuda) == "sdpa"  # decoding with a KV cache


def _train_losses(mode: str, steps: int = 3, compile_: bool = False):
    from llmtrain.config.schema import Config
    from llmtrain.distributed.parallel_dims import ParallelDims
    from llmtrain.distributed.parallelize import parallelize

    cfg = Config()
    cfg.recompute.mode = mode
    cfg.train.compile = compile_
    args = dataclasses.replace(FAMILIES["llama3"].flavor_args("debug"))
    model = build_model(args)
    parallelize(model, cfg, ParallelDims.from_config(cfg.parallel, 1), None, "cpu")
    model.to_empty(device="cpu")
    model.init_weights(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, ids, doc_ids, pos = _packed(args.vocab_size, [20, 30, 14])
    labels = torch.roll(ids, -1, 1)
    losses = []
    for _ in range(steps):
        loss = TokenLoss()(model(ids, position_ids=pos, document_ids=doc_ids), labels) / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, getattr(model, "activation_offload", None), model


def test_activation_offload_matches_no_offload_and_packs_the_activations() -> None:
    plain, none_stats, plain_model = _train_losses("none")
    offload, stats, model = _train_losses("offload")
    assert none_stats is None and stats is not None
    assert max(abs(a - b) for a, b in zip(plain, offload, strict=True)) < 1e-6
    assert plain[-1] < plain[0] - 1e-3  # it trains
    n_layers = model.args.num_layers
    # Per step and block at least q, k, v, the attention output and the MLP activations were packed, each at
    # least [64 tokens, 64] fp32; parameters stayed (kept), and names are unchanged (checkpoints, init).
    assert stats.packed >= 3 * n_layers * 6 and stats.kept >= 3 * n_layers * 7
    assert stats.bytes >= 3 * n_layers * 6 * 64 * 64 * 4
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain_model.named_parameters()]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"train.loss_chunk_tokens": -1}, "train.loss_chunk_tokens"),
        ({"model.attention": "flex", "run.device_target": "cpu"}, "model.attention = 'flex'"),
        ({"model.attention": "flash"}, "model.attention"),
        ({"recompute.mode": "offloaded"}, "recompute.mode"),
    ],
)
def test_long_context_settings_are_validated(overrides: dict, key: str) -> None:
    from llmtrain.config.schema import Config
    from llmtrain.errors import ConfigError
    from llmtrain.resolve.validate import validate

    cfg = Config()
    cfg.model.flavor = "debug"
    cfg.model.vocab_size = 512
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2, require_data=False)
    assert key in str(err.value)
    ok = Config()
    ok.model.flavor, ok.model.vocab_size = "debug", 512
    ok.recompute.mode, ok.model.attention, ok.train.loss_chunk_tokens = "offload", "auto", 256
    validate(ok, world_size=1, require_data=False)  # legal: no error


def test_trainer_with_chunked_loss_and_offload_matches_the_plain_run(tiny_corpus, tmp_path) -> None:
    import json

    from conftest import tiny_config
    from llmtrain.config import config_from_dict
    from llmtrain.train.trainer import Trainer

    def run(name: str, chunk: int, mode: str) -> list[float]:
        out = tmp_path / name
        cfg = tiny_config(
            tiny_corpus, out, model={"seq_length": 64, "document_mask": True},
            train={"max_steps": 3, "loss_chunk_tokens": chunk, "label_smoothing": 0.1},
            recompute={"mode": mode}, checkpoint={"save_at_end": False},
        )  # fmt: skip
        Trainer(config_from_dict(cfg)).fit()
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    plain = run("plain", 0, "none")
    other = run("chunked_offload", 48, "offload")  # 128 tokens per micro-batch: 3 chunks, the last partial
    assert len(plain) == 3 and max(abs(a - b) for a, b in zip(plain, other, strict=True)) < 1e-6


def test_check_reports_the_loss_logits_memory_and_offload() -> None:
    from llmtrain.check import long_context_lines
    from llmtrain.config.schema import Config
    from llmtrain.resolve.derived import derive

    cfg = Config()
    cfg.model.flavor, cfg.model.vocab_size, cfg.model.seq_length = "debug", 131072, 8192
    cfg.train.batch_size = cfg.train.micro_batch_size = 1
    cfg.recompute.mode = "offload"
    rows = dict(long_context_lines(cfg, derive(cfg, 1)))
    assert rows["loss logits"].startswith("chunked, 2048 tokens per chunk: 1 GiB")  # 2048 x 131072 x 4 bytes
    assert rows["recompute"].startswith("offload")
    cfg.train.loss_chunk_tokens = 0
    assert dict(long_context_lines(cfg, derive(cfg, 1)))["loss logits"].startswith(
        "plain (whole logits): 4 GiB"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains only on CUDA (torch 2.13)")
def test_flex_training_gradients_match_dense_on_cuda() -> None:
    model = materialised("baichuan2", "debug_alibi", seed=5).cuda()
    _, ids, doc_ids, pos = _packed(model.args.vocab_size, [37, 90, 3, 70])
    ids, doc_ids, pos = ids.cuda(), doc_ids.cuda(), pos.cuda()
    grads = []
    for impl in ("sdpa", "flex"):
        model.attention_impl = impl
        model.zero_grad()
        TokenLoss()(model(ids, position_ids=pos, document_ids=doc_ids), torch.roll(ids, -1, 1)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (grads[0] - grads[1]).abs().max().item() < 1e-4
