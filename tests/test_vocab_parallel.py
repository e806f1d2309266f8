"""Loss parallel (train/vocab_parallel.py) against ``F.cross_entropy`` on the gathered logits, on 2 and 3 gloo
ranks: the summed loss and the gradient of every logit, with ignored targets, label smoothing, the z-loss, 16-bit
logits and a vocabulary the ranks do not divide evenly (1001 over 2, 50 over 3); and the plain case against
torch's own ``loss_parallel`` (a second engine). Plus the chunked loss under TP: the head's matmul on a
sequence-sharded input, in chunks, equal to the unchunked loss and its gradients."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmtrain.train.loss import chunked_head_loss, token_cross_entropy
from ports import free_port

CASES = [  # (vocab, dtype, label_smoothing, z_loss)
    (1001, torch.float32, 0.0, 0.0),
    (1001, torch.float32, 0.1, 0.0),
    (1001, torch.float32, 0.0, 1e-3),
    (50, torch.float32, 0.2, 1e-2),
    (64, torch.bfloat16, 0.1, 1e-3),
]


def _reference(logits, labels, ls, z):
    x = logits.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(x.float().flatten(0, -2), labels.flatten(), reduction="sum", ignore_index=-100,
                           label_smoothing=ls)  # fmt: skip
    if z > 0:
        log_z = torch.logsumexp(x.float().flatten(0, -2), dim=-1)
        loss = loss + z * (log_z.square() * (labels.flatten() != -100)).sum()
    loss.backward()
    return loss.detach(), x.grad


def _worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for vocab, dtype, ls, z in CASES:
        if vocab == 1001 and world != 2 or vocab == 50 and world != 3:
            continue
        g = torch.Generator().manual_seed(vocab)
        logits = (torch.randn(3, 7, vocab, generator=g) * 4).to(dtype)  # [B, T, V]
        labels = torch.randint(0, vocab, (3, 7), generator=g)
        labels[0, :3] = -100  # ignored targets
        ref_loss, ref_grad = _reference(logits, labels, ls, z)
        d = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_(True)
        loss = token_cross_entropy(d, labels, ls, z)
        loss.backward()
        grad = d.grad.full_tensor()
        out.append((vocab, str(dtype), ls, z, float(loss), float(ref_loss),
                    float((grad.float() - ref_grad.float()).abs().max()), float(ref_grad.float().abs().max())))  # fmt: skip
    # torch's loss_parallel on the same shards (no smoothing, no z-loss: what it supports)
    g = torch.Generator().manual_seed(5)
    logits, labels = torch.randn(4, 6, 96, generator=g), torch.randint(0, 96, (4, 6), generator=g)
    labels[1, 2] = -100
    ours = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_(True)
    token_cross_entropy(ours, labels).backward()
    theirs = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_(True)
    with loss_parallel():
        lp = F.cross_entropy(theirs.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
        lp.backward()
    ours_loss = float(token_cross_entropy(ours.detach(), labels))
    torch_diff = float((ours.grad.full_tensor() - theirs.grad.full_tensor()).abs().max())
    # the chunked loss under TP: head column-parallel over the vocabulary, input sequence-sharded
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 90, bias=False)
    h = torch.randn(2, 12, 16)
    lab = torch.randint(0, 90, (2, 12))
    ref_h = h.clone().requires_grad_(True)
    ref = F.cross_entropy(head(ref_h).flatten(0, 1), lab.flatten(), reduction="sum")
    ref.backward()
    ref_w = head.weight.grad.clone()
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                   use_local_output=False))  # fmt: skip
    sharded = distribute_tensor(h.clone(), mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
    sharded = sharded.detach().requires_grad_(True)
    chunked = chunked_head_loss(sharded, head, lab, chunk_tokens=5)
    chunked.backward()
    chunk_out = (float(chunked), float(ref), float((head.weight.grad.full_tensor() - ref_w).abs().max()),
                 float((sharded.grad.full_tensor() - ref_h.grad).abs().max()))  # fmt: skip
    if rank == 0:
        queue.put((out, ours_loss, float(lp.full_tensor()), torch_diff, chunk_out))
    dist.destroy_process_group()


def _run(world: int):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(
        _worker, args=(world, free_port(), queue), nprocs=world, join=True, start_method="spawn"
    )
    return queue.get()


def _check(result) -> None:
    out, ours_loss, torch_loss, torch_diff, chunk_out = result
    assert out
    for vocab, dtype, ls, z, loss, ref, gdiff, gmax in out:
        tol = 1e-5 if dtype == "torch.float32" else 4e-3  # bf16 logits: the gradient is rounded to 8 bits
        assert abs(loss - ref) <= 1e-5 * abs(ref), (vocab, dtype, ls, z, loss, ref)
        assert gdiff <= tol * gmax, (vocab, dtype, ls, z, gdiff, gmax)
    assert abs(ours_loss - torch_loss) <= 1e-5 * abs(torch_loss) and torch_diff < 1e-6
    chunked, ref, wdiff, hdiff = chunk_out
    assert abs(chunked - ref) <= 1e-5 * abs(ref) and wdiff < 1e-5 and hdiff < 1e-5, chunk_out


def test_loss_parallel_equals_the_gathered_loss_on_two_ranks():
    _check(_run(2))


def test_loss_parallel_equals_the_gathered_loss_on_three_ranks():
    _check(_run(3))
