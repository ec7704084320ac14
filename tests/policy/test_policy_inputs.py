"""The policy term's per-call inputs (headloss.policy.inputs): bad values are errors or propagate,
never a finite loss that silently differs; the kernel path and the reference path alike."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import generator, make_logits, make_targets, needs_kernel, seed_of

from headloss import LossSpec, Policy, head_loss, linear_head_loss

B, T, V = 3, 5, 13
BACKENDS = [pytest.param("triton", marks=needs_kernel), "torch"]


def _case(seed=0):
    logits = make_logits((B, T, V), seed=seed)
    targets = make_targets((B, T), V, seed=seed)
    gen = generator(seed + 1)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = logp + 0.2 * torch.randn(B, T, generator=gen)
    rollout = old + 0.2 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, generator=gen)
    return logits, targets, adv, old, rollout


# --- a NaN rollout log-prob -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level, mode", [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"),
                                         ("sequence", "mask")])
def test_a_nan_rollout_logprob_at_a_counted_token_makes_the_loss_nan(backend, level, mode):
    """As every other input: a NaN where a token counts reaches the loss (rollout_is="mask" does not
    zero it either: NaN is not outside the bounds); at a masked token it never counts."""
    logits, targets, adv, old, rollout = _case(1)
    spec = LossSpec(cross_entropy=None, policy=Policy(rollout_is=level, rollout_is_mode=mode, rollout_is_min=0.5))
    mask = torch.ones(B, T)
    mask[2, 4] = 0
    bad = rollout.clone()
    bad[0, 1] = math.nan
    out = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, rollout_logprobs=bad,
                    loss_mask=mask)
    assert math.isnan(out.loss.item())
    masked = rollout.clone()
    masked[2, 4] = math.nan  # a masked token: not counted
    clean = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old,
                      rollout_logprobs=rollout, loss_mask=mask)
    out = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old,
                    rollout_logprobs=masked, loss_mask=mask)
    assert math.isfinite(out.loss.item())
    torch.testing.assert_close(out.loss, clean.loss)


# --- loss_mask holds 0 and 1 ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [0.5, 2.0, -1.0, math.nan], ids=["half", "two", "minus_one", "nan"])
def test_a_loss_mask_value_neither_0_nor_1_is_an_error_naming_loss_mask(backend, value):
    logits, targets, adv, old, _ = _case(2)
    spec = LossSpec(cross_entropy=None, policy=Policy())
    mask = torch.ones(B, T)
    mask[1, 3] = value
    with pytest.raises(ValueError, match=r"loss_mask: the value at position \(1, 3\) is neither 0 nor 1"):
        head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, loss_mask=mask)
    with pytest.raises(ValueError, match=r"loss_mask: the value at position \(1, 3\) is neither 0 nor 1"):
        head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, loss_mask=mask,
                  shift=True)
    hidden = torch.randn(B, T, 6, generator=generator(3))
    weight = torch.randn(V, 6, generator=generator(4))
    with pytest.raises(ValueError, match=r"loss_mask: the value at position \(1, 3\) is neither 0 nor 1"):
        linear_head_loss(hidden, weight, targets, spec, backend=backend, advantages=adv, old_logprobs=old,
                         loss_mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_binary_loss_masks_of_every_dtype_give_the_bool_masks_loss(backend):
    logits, targets, adv, old, _ = _case(3)
    spec = LossSpec(cross_entropy=None, policy=Policy())
    keep = torch.rand(B, T, generator=generator(5)) > 0.3
    want = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, loss_mask=keep).loss
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        got = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old,
                        loss_mask=keep.to(dtype)).loss
        torch.testing.assert_close(got, want)
    # validate=False skips the check (the mask is read as mask != 0, as a bool mask)
    mask = keep.float()
    mask[keep] = 0.5
    got = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, loss_mask=mask,
                    validate=False).loss
    torch.testing.assert_close(got, want)


# --- counts and empty batches -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type, count", [("grpo", "num_sequences_in_batch"), ("dapo", "num_items_in_batch")])
def test_a_count_given_as_a_one_element_tensor_gives_a_scalar_loss(backend, loss_type, count):
    logits, targets, adv, old, _ = _case(4)
    spec = LossSpec(cross_entropy=None, policy=Policy(loss_type=loss_type))
    as_number = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old, **{count: 6})
    as_tensor = head_loss(logits, targets, spec, backend=backend, advantages=adv, old_logprobs=old,
                          **{count: torch.tensor([6.0])})
    assert as_tensor.loss.shape == () == as_number.loss.shape
    torch.testing.assert_close(as_tensor.loss, as_number.loss)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "seq-mean-token-sum"])
def test_no_rows_give_a_zero_loss_and_a_zero_gradient(backend, loss_type):
    logits = torch.randn(0, V, requires_grad=True)
    spec = LossSpec(cross_entropy=None, policy=Policy(loss_type=loss_type))
    out = head_loss(logits, torch.zeros(0, dtype=torch.long), spec, backend=backend, advantages=torch.zeros(0),
                    sequence_ids=torch.zeros(0, dtype=torch.long))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert logits.grad.shape == (0, V)


# --- an input the spec does not read ---------------------------------------------------------------

UNREAD = {  # input: (a policy that reads it, the warning without that)
    "ref_logprobs": (dict(kl_beta=0.04), r"ref_logprobs: the spec's policy has kl_beta=0, so no KL term reads it; "
                                         r"drop it or set policy.kl_beta"),
    "rollout_logprobs": (dict(rollout_is="token"),
                         r"rollout_logprobs: the spec's policy has neither rollout_is nor off_policy_mask"),
}


def _call(entry, spec, backend, logits, targets, **inputs):
    if entry == "logits":
        return head_loss(logits, targets, spec, backend=backend, **inputs)
    hidden = torch.randn(B, T, 6, generator=generator(3))
    weight = torch.randn(V, 6, generator=generator(4))
    return linear_head_loss(hidden, weight, targets, spec, backend=backend, **inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("name", list(UNREAD))
def test_an_input_the_policy_does_not_read_is_warned_once_per_spec(name, entry, backend):
    """Trainers pass the reference model's and the rollout's log-probs with every batch: a policy that
    reads neither warns once (at the caller's line) and computes what it computes without them."""
    reads, message = UNREAD[name]
    logits, targets, adv, old, rollout = _case(5)
    eps = 0.2 + seed_of(name, entry, backend) / 1e9  # a spec of this test's alone: warned once per spec
    spec = LossSpec(cross_entropy=None, policy=Policy(eps_high=eps))
    inputs = dict(advantages=adv, old_logprobs=old)
    extra = {name: rollout if name == "rollout_logprobs" else old - 0.1}
    with pytest.warns(UserWarning, match=message) as caught:
        out = _call(entry, spec, backend, logits, targets, **inputs, **extra)
    assert [w.filename for w in caught if name in str(w.message)] == [__file__]
    torch.testing.assert_close(out.loss, _call(entry, spec, backend, logits, targets, **inputs).loss)
    reading = LossSpec(cross_entropy=None, policy=Policy(eps_high=eps, **reads))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per spec; none where the spec reads it
        _call(entry, spec, backend, logits, targets, **inputs, **extra)
        _call(entry, reading, backend, logits, targets, **inputs, **extra)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_inputs_of_a_term_the_spec_lacks_are_refused_naming_the_argument(entry, backend):
    """What only a policy term reads, given to a spec without one, and teacher_logits without a
    distillation term: a mistake, an error naming the argument (the same on both paths)."""
    logits, targets, adv, old, rollout = _case(6)
    spec = LossSpec(token_accuracy=True)
    for name, value in dict(advantages=adv, old_logprobs=old, ref_logprobs=old, rollout_logprobs=rollout,
                            loss_mask=torch.ones(B, T)).items():
        with pytest.raises(ValueError, match=rf"^{name}: given, but the spec has no policy term, the only one that "
                                             r"reads it; drop it or add spec.policy$"):
            _call(entry, spec, backend, logits, targets, **{name: value})
    with pytest.raises(ValueError, match=r"^teacher_logits: given, but the spec has no distillation term"):
        _call(entry, spec, backend, logits, targets, teacher_logits=logits.clone())
