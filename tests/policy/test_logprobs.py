"""headloss.policy.logprobs.policy_loss: the policy term on log-probs computed elsewhere equals the
head pass's policy term (value, gradient through log_softmax, metrics), and names bad input."""

import pytest
import torch
from conftest import assert_close_norm, generator, make_logits, needs_kernel

from headloss import LossSpec, Policy, head_loss
from headloss.policy.logprobs import policy_loss

B, T, V = 3, 6, 29
POLICIES = {
    "dapo_k3": Policy(loss_type="dapo", kl_beta=0.04, eps_high=0.28),
    "verl_gspo": Policy(importance_sampling="sequence_token", loss_type="seq-mean-token-mean", convention="verl"),
    "sapo_grpo": Policy(objective="sapo", loss_type="grpo"),
    "gmpo": Policy(objective="gmpo", loss_type="grpo"),
}


@needs_kernel
@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_loss_on_logprobs_equals_the_head_pass(name):
    gen = generator(3)
    logits = make_logits((B, T, V), seed=4)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    old = -torch.rand(B, T, generator=gen) * 3
    inputs = dict(advantages=torch.randn(B, generator=gen), old_logprobs=old, ref_logprobs=old + 0.1, loss_mask=mask)
    spec = LossSpec(cross_entropy=None, policy=POLICIES[name])
    x = logits.clone().requires_grad_()
    want = head_loss(x, targets, spec, **inputs)
    want.loss.backward()
    y = logits.clone().requires_grad_()
    logp = torch.log_softmax(y, -1).gather(-1, targets[..., None])[..., 0]
    got = policy_loss(logp, spec, **inputs)
    got.loss.backward()
    assert_close_norm(got.loss, want.loss.detach(), rtol=1e-5, atol=1e-7, name="loss")
    assert_close_norm(y.grad, x.grad, rtol=1e-4, atol=1e-8, name="grad")
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean", "ppo_kl", "clip_ratio/low_min"):
        assert_close_norm(got.metrics[key], want.metrics[key], rtol=1e-5, atol=1e-6, name=key)


def test_policy_loss_errors_name_the_argument():
    logp = -torch.rand(B, T)
    adv = torch.randn(B)
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(torch.zeros(B, T, dtype=torch.long), Policy(), advantages=adv)
    with pytest.raises(TypeError, match="policy"):
        policy_loss(logp, "clip", advantages=adv)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss(logp, Policy(), advantages=adv, loss_mask=torch.full((B, T), 0.5))
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, Policy(entropy_coef=0.1), advantages=adv)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, Policy(), advantages=torch.randn(B + 1))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        policy_loss(logp, Policy(), advantages=adv, num_items_in_batch=0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, Policy(kl_beta=0.1), advantages=adv)


@needs_kernel
@pytest.mark.parametrize("normalize", ["weights", "tokens"])
def test_token_weights_on_logprobs_equal_the_head_pass(normalize):
    """A LossSpec with token_weights: policy_loss on log-probs takes them into the aggregation as head_loss
    does; without such a spec they are refused, and a negative one is named."""
    gen = generator(5)
    logits = make_logits((B, T, V), seed=6)
    targets = torch.randint(0, V, (B, T), generator=gen)
    old = -torch.rand(B, T, generator=gen) * 3
    w = 2 * torch.rand(B, T, generator=gen)
    inputs = dict(advantages=torch.randn(B, generator=gen), old_logprobs=old, ref_logprobs=old + 0.1,
                  loss_mask=torch.rand(B, T, generator=gen) > 0.2)
    spec = LossSpec(cross_entropy=None, policy=POLICIES["dapo_k3"], token_weights={"normalize": normalize})
    x = logits.clone().requires_grad_()
    want = head_loss(x, targets, spec, token_weights=w, **inputs)
    want.loss.backward()
    y = logits.clone().requires_grad_()
    logp = torch.log_softmax(y, -1).gather(-1, targets[..., None])[..., 0]
    got = policy_loss(logp, spec, token_weights=w, **inputs)
    got.loss.backward()
    assert_close_norm(got.loss, want.loss.detach(), rtol=1e-5, atol=1e-7, name="loss")
    assert_close_norm(y.grad, x.grad, rtol=1e-4, atol=1e-8, name="grad")
    with pytest.raises(ValueError, match="token_weights: given, but spec.token_weights is not set"):
        policy_loss(logp, POLICIES["dapo_k3"], token_weights=w, **inputs)
    with pytest.raises(ValueError, match="token_weights: required by spec.token_weights"):
        policy_loss(logp, spec, **inputs)
    bad = w.clone()
    bad[1, 2] = -1.0
    with pytest.raises(ValueError, match=r"token_weights: the value at position \(1, 2\) is not a finite number"):
        policy_loss(logp, spec, token_weights=bad, **inputs)
