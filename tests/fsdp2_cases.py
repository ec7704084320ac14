"""``linear_head_loss`` in an FSDP2 model's forward, on one rank: shared by tests/integrations/test_fsdp2.py
(gloo, CPU) and tests/test_gpu.py (NCCL, 2 GPUs)."""

from __future__ import annotations

import copy
import math

import torch

VOCAB, HIDDEN = 40, 16
SPEC = {"cross_entropy": {}, "z_loss": {"weight": 1e-3}, "entropy": {"weight": 0.0}, "token_accuracy": True}


class Tiny(torch.nn.Module):
    """A language model whose forward calls linear_head_loss on its own lm_head weight."""

    def __init__(self, whole_output: bool = False) -> None:
        super().__init__()
        self.whole_output = whole_output
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        """The HeadLossOutput (``whole_output``: FSDP2 finds its loss through the pytree registration)
        or (loss, metrics)."""
        from headloss import linear_head_loss

        out = linear_head_loss(self.hidden(ids), self.lm_head.weight, labels, SPEC, shift=True)
        return out if self.whole_output else (out.loss, out.metrics)


def direct_in_forward(rank: int, world: int, port: int, backend: str, results) -> None:
    """results[rank]: the FSDP2 model's loss, metrics and gradients against each rank's loss on the
    unsharded model with the gradients averaged over the ranks (FSDP2's reduce-scatter), and the
    messages of the two calls on the sharded weight outside the forward (default and sync validation)."""
    import torch.distributed as dist
    from conftest import init_process
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from headloss import linear_head_loss

    device = init_process(rank, world, port, backend)
    try:
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
        ids = torch.randint(0, VOCAB, (2, 7), generator=gen).to(device)
        labels = ids.clone()
        labels[0, :2] = -100
        errs, losses, same_metrics = {}, [], []
        # the forward returns (loss, metrics), then the HeadLossOutput itself: without the output's pytree
        # registration FSDP2 never queues its end-of-backward callback; over NCCL the gradients are then
        # left unreduced (over gloo on CPU the reduce-scatter has already finished, so only the GPU test sees it)
        for whole in (False, True):
            torch.manual_seed(0)
            reference = Tiny(whole).to(device)
            model = copy.deepcopy(reference)
            fully_shard(model, mesh=init_device_mesh(device.type, (world,)))
            got = model(ids, labels)
            loss, metrics = (got.loss, got.metrics) if whole else got
            loss.backward()
            # a gradient FSDP2 did not reduce stays a plain tensor (not its DTensor shard): an infinite error
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else None
                     for n, p in model.named_parameters()}
            want = reference(ids, labels)
            want_loss, want_metrics = (want.loss, want.metrics) if whole else want
            want_loss.backward()
            for name, p in reference.named_parameters():
                dist.all_reduce(p.grad)
                errs[f"{'output' if whole else 'tuple'}: {name}"] = math.inf if grads[name] is None else float(
                    (grads[name] - p.grad / world).abs().max() / p.grad.abs().max())
            losses.append(float((loss - want_loss).abs()))
            same_metrics.append(list(metrics) == list(want_metrics))
        refused = []
        for validate in (None, "sync"):  # outside the forward the weight is FSDP2's shard of the rows
            weight = model.lm_head.weight
            try:
                linear_head_loss(reference.hidden(ids).detach(), weight, labels, SPEC, shift=True, validate=validate)
                refused.append(f"no error ({type(weight).__name__})")
            except ValueError as exc:
                refused.append(str(exc))
        results[rank] = {"loss": max(losses), "grads": errs, "refused": refused, "metrics": all(same_metrics)}
    finally:
        dist.destroy_process_group()


def check_direct(results: dict, grad_tol: float) -> None:
    """The assertions on :func:`direct_in_forward`'s results."""
    assert len(results) == 2
    for rank, r in results.items():
        assert r["loss"] < 1e-5 and r["metrics"], (rank, r)
        for name, err in r["grads"].items():
            assert err < grad_tol, (rank, name, err)
        for msg in r["refused"]:
            assert msg.startswith("hidden: differs across the ranks of the group"), (rank, msg)
            assert "FSDP2" in msg
