"""headloss under FSDP2 and torchtitan's layouts (gloo, CPU): ``linear_head_loss`` called directly in an
FSDP2 model's forward; the same weight outside the forward (FSDP2's data-parallel shard, which has a
vocab-parallel shard's placement) refused on every rank; logits a DTensor Shard(-1) over the
tensor-parallel half of a 2-D (data, tensor) mesh, and a 2-D placement refused."""

from __future__ import annotations

import pytest
import torch
from conftest import init_process, spawn_ranks

pytestmark = pytest.mark.slow

from fsdp2_cases import SPEC, VOCAB, check_direct, direct_in_forward  # noqa: E402


def test_linear_head_loss_in_an_fsdp2_forward_and_its_shard_outside_refused():
    check_direct(spawn_ranks(direct_in_forward, 2, "gloo"), grad_tol=1e-5)


def _titan_rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from headloss import head_loss

    init_process(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
        gen = torch.Generator().manual_seed(20 + dp)  # each data-parallel rank its own rows
        logits = torch.randn(2, 5, VOCAB, generator=gen) * 2
        labels = torch.randint(0, VOCAB, (2, 5), generator=gen)
        width = VOCAB // 2
        local = logits[..., tp * width:(tp + 1) * width].clone().requires_grad_(True)
        sharded = DTensor.from_local(local, mesh["tp"], [Shard(-1)])
        out = head_loss(sharded, labels, SPEC)
        out.loss.backward()
        whole = logits.clone().requires_grad_(True)
        want = head_loss(whole, labels, SPEC, backend="torch")
        want.loss.backward()
        err = float((local.grad - whole.grad[..., tp * width:(tp + 1) * width]).abs().max())
        metrics = max(abs(float(out.metrics[k]) - float(want.metrics[k])) for k in want.metrics)
        try:
            two_d = DTensor.from_local(local.detach(), mesh, [Replicate(), Shard(-1)])
            head_loss(two_d, labels, SPEC)
            refused = "no error"
        except ValueError as exc:
            refused = str(exc)
        results[rank] = (float((out.loss - want.loss).abs()), err, metrics, refused)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_torchtitan_loss_parallel_layout_on_a_2d_mesh():
    results = spawn_ranks(_titan_rank, 4)
    assert len(results) == 4
    for rank, (loss_err, grad_err, metric_err, refused) in results.items():
        assert loss_err < 1e-5 and grad_err < 1e-6 and metric_err < 1e-5, (rank, loss_err, grad_err, metric_err)
        assert refused.startswith("logits: a DTensor must be sharded on its vocabulary dimension"), (rank, refused)
