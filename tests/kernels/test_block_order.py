"""The head kernel does not rely on the order its programs start in.

A call on one device leaves prepare's work (count the scored rows, check the targets, zero the policy
counters) to one of the head kernel's programs, and the others wait for it where they read what it
writes. The GPU promises no start order (MPS, green contexts, or another stream's kernels holding SMs can
start program 0 last), so the preparer is the first program to take the call's ticket, never a fixed one.
Triton's interpreter runs programs one after another: here it runs them last first, where a wait on
program 0 could never end (a SIGALRM turns that hang into a failure), and every value must equal the
call run in order.
"""

from __future__ import annotations

import signal

import pytest
import torch
from conftest import make_logits, make_targets, needs_kernel

import headloss
from headloss import LossSpec

pytestmark = needs_kernel

SPECS = {
    "ce_gradient": LossSpec(z_loss={"weight": 1e-3}, token_accuracy=True),
    "grpo": LossSpec(cross_entropy=None, entropy={"weight": 0.0}, policy={"loss_type": "dapo", "kl_beta": 0.04}),
}


def _run(spec: LossSpec, logits: torch.Tensor, targets: torch.Tensor, policy: dict):
    leaf = logits.clone().requires_grad_()
    out = headloss.head_loss(leaf, targets, spec, backend="triton", **policy)
    out.loss.backward()
    return out, leaf.grad


@pytest.fixture
def last_program_first(monkeypatch):
    """The interpreter's programs run in reverse order of their index, under a 60 s alarm."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    in_order = builder.set_grid_idx

    def reversed_idx(x, y, z):
        in_order(builder.grid_dim[0] - 1 - x, y, z)

    def hang(signum, frame):
        raise TimeoutError("a program waited on one that had not run: the kernel relies on block order")

    monkeypatch.setattr(builder, "set_grid_idx", reversed_idx)
    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", list(SPECS))
def test_programs_started_last_first_give_the_same_call(name, request):
    spec = SPECS[name]
    logits = make_logits((2, 5, 37), seed=3)
    targets = make_targets((2, 5), 37, seed=3, ignore_frac=0.2)
    policy = {}
    if spec.policy is not None:
        gen = torch.Generator().manual_seed(3)
        policy = dict(advantages=torch.randn(2, generator=gen), old_logprobs=-torch.rand(2, 5, generator=gen),
                      ref_logprobs=-torch.rand(2, 5, generator=gen))
    want, want_grad = _run(spec, logits, targets, policy)
    request.getfixturevalue("last_program_first")
    got, grad = _run(spec, logits, targets, policy)
    assert torch.equal(got.loss, want.loss)
    assert {k: float(v) for k, v in got.metrics.items()} == {k: float(v) for k, v in want.metrics.items()}
    assert torch.equal(grad, want_grad)


def test_a_bad_target_is_found_whichever_program_prepares(last_program_first):
    logits = make_logits((4, 37), seed=5)
    targets = torch.tensor([1, 2, 40, 3])
    with pytest.raises(ValueError, match=r"targets: value 40 at position \(2,\)"):
        headloss.head_loss(logits, targets, LossSpec(), backend="triton")
