"""Per-token weights (spec.TokenWeights, the call's ``token_weights``): each counted token's value of every
term and its gradient times its weight, a mean over the summed weights (or the token count), on both entry
points and both paths; in the policy term's aggregation the weights take the mask's place (or multiply its
per-token values).

Two independent checks: fp64 oracles written here from their definitions (the SFT terms: smoothed
cross-entropy, z-loss, entropy; the policy term: TRL's clipped surrogate with its k3 KL and entropy mean,
under a token mean and a mean over sequences), and the identity that defines the feature for every other term and route:
the weighted call's loss is sum(w * L) / divisor over the same spec's per-token losses L (reduction
"none"), and its gradient that sum's."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    check_compiled_row_input,
    check_packed_row_input,
    explained_and_demoed,
    generator,
    needs_kernel,
    tiered,
)

import headloss
from headloss import LossSpec

V, H = 37, 12
SMOOTHING, W_Z, W_H = 0.1, 1e-3, 0.02


def _sft(normalize: str = "weights", **changes) -> LossSpec:
    return LossSpec(cross_entropy={"label_smoothing": SMOOTHING}, z_loss={"weight": W_Z}, entropy={"weight": W_H},
                    token_accuracy=True, token_weights={"normalize": normalize}, **changes)


def _oracle(z: torch.Tensor, y: torch.Tensor, w: torch.Tensor, normalize: str) -> tuple[torch.Tensor, dict]:
    """fp64: sum over the counted rows of w * ((1 - eps) nll + eps mean(-log p) + w_z lse^2 + w_H H), over the
    counted rows' summed weights (1 where they sum to 0) or their count; the metrics, unweighted means."""
    x, y, w = z.double().reshape(-1, z.shape[-1]), y.reshape(-1), w.double().reshape(-1)
    counted = y != -100
    x, y, w = x[counted], y[counted], w[counted]
    lse = torch.logsumexp(x, -1)
    logp = x - lse[:, None]
    nll = -logp.gather(1, y[:, None])[:, 0]
    ce = (1 - SMOOTHING) * nll - SMOOTHING * logp.mean(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    total = (w * (ce + W_Z * lse**2 + W_H * entropy)).sum()
    divisor = (w.sum() if w.sum() > 0 else torch.ones(())) if normalize == "weights" else max(len(y), 1)
    return total / divisor, {"ce": ce.mean().item(), "entropy": entropy.mean().item(),
                             "token_accuracy": (x.argmax(-1) == y).double().mean().item()}


def _batch(seed: int, b: int = 3, t: int = 7):
    gen = generator(seed)
    z = torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, V, (b, t), generator=gen)
    y[0, 2] = y[2, 5] = -100
    w = 2.0 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    w[1, 3] = 0.0
    return z, y, w


def _rows_of_shifted(y: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets to pass, the rows' own targets) of a shifted call: HF labels [B, T] (row t against
    labels[t + 1], the last row unscored) or completion ids [B, T - 1]."""
    rows = torch.cat((y[:, 1:], torch.full_like(y[:, :1], -100)), 1)
    return (y, rows) if form == "labels" else (y[:, 1:], rows)


@needs_kernel
@pytest.mark.parametrize("entry, backend, layout, normalize", tiered(
    ["logits", "hidden"], ["triton", "torch"], ["rows", "per_sequence", "labels", "completion"],
    ["weights", "tokens"]))
def test_weighted_terms_equal_the_fp64_oracle(entry, backend, layout, normalize):
    z, y, w = _batch(seed=11)
    hidden = weight = None
    if entry == "hidden":
        gen = generator(12)
        hidden = torch.randn(*z.shape[:2], H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
        z = hidden @ weight.T
    if layout == "per_sequence":
        w = w[:, :1].expand_as(w).contiguous()
    given_w = w[:, 0] if layout == "per_sequence" else w
    targets, rows_y, kw = y, y, {}
    if layout in ("labels", "completion"):
        targets, rows_y = _rows_of_shifted(y, layout)
        given_w = w if layout == "labels" else w[:, :-1]
        kw["shift"] = True
    spec = _sft(normalize)
    want, metrics = _oracle(z, rows_y, w, normalize)
    if entry == "logits":
        zo = z.clone().requires_grad_()
        _oracle(zo, rows_y, w, normalize)[0].backward()
        x = z.float().requires_grad_()
        out = headloss.head_loss(x, targets, spec, token_weights=given_w.float(), backend=backend, **kw)
        out.loss.backward()
        got_grad, want_grad = x.grad, zo.grad
    else:
        ho = hidden.clone().requires_grad_()
        _oracle(ho @ weight.T, rows_y, w, normalize)[0].backward()
        h = hidden.float().requires_grad_()
        out = headloss.linear_head_loss(h, weight.float(), targets, spec, token_weights=given_w.float(),
                                        backend=backend, chunk_bytes=5 * V * 4, **kw)
        out.loss.backward()
        got_grad, want_grad = h.grad, ho.grad
    assert out.loss.item() == pytest.approx(want.item(), rel=2e-6)
    for name, value in metrics.items():
        assert out.metrics[name].item() == pytest.approx(value, rel=2e-5, abs=1e-6), name
    assert (got_grad.double() - want_grad).abs().max() <= 2e-6 * want_grad.abs().max()


SPECS = {
    "distill_fkl": LossSpec(cross_entropy={}, distillation={"weight": 0.5, "temperature": 2.0}),
    "distill_jsd_probs": LossSpec(cross_entropy=None, distillation={"divergence": "jsd", "teacher": "probs"}),
    "distill_topk": LossSpec(cross_entropy=None, distillation={"teacher": "topk", "topk": "rest"}),
    "distill_token": LossSpec(cross_entropy=None, distillation={"teacher": "token", "estimator": "k3"}),
    "dft_softcap": LossSpec(cross_entropy=None, dft={}, transform={"softcap": 4.0}),
    "entropy_outputs": LossSpec(entropy={"weight": 0.05}, outputs=("logprobs", "entropy"),
                                differentiable_outputs=True),
}


def _teacher(name: str, z: torch.Tensor, y: torch.Tensor, gen: torch.Generator) -> dict:
    t = (z + torch.randn(z.shape, generator=gen, dtype=torch.float64)).float()
    if name == "distill_fkl":
        return {"teacher_logits": t}
    if name == "distill_jsd_probs":
        return {"teacher_probs": torch.softmax(t, -1)}
    if name == "distill_topk":
        top = torch.log_softmax(t, -1).topk(4, -1)
        return {"teacher_ids": top.indices, "teacher_logprobs": top.values}
    if name == "distill_token":
        return {"teacher_logprobs": torch.log_softmax(t, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]}
    return {}


def _total(out) -> torch.Tensor:
    total = out.loss.sum()
    for name, c in (("logprobs", 0.3), ("entropy", -0.2)):
        value = getattr(out, name)
        if value is not None and value.requires_grad:
            total = total + c * value.sum()
    return total


@needs_kernel
@pytest.mark.parametrize("name, entry, backend, reduction", tiered(
    list(SPECS), ["logits", "hidden"], ["triton", "torch"], ["mean", "sum"]))
def test_a_weighted_call_is_the_weighted_sum_of_its_per_token_losses(name, entry, backend, reduction):
    """Every term and route: the loss is sum(w * L) / sum(w) (mean) or sum(w * L) (sum) over the same spec's
    per-token losses, the gradient likewise; the metrics are the unweighted call's."""
    spec = SPECS[name].model_copy(update={"reduction": reduction})
    weighted = spec.model_copy(update={"token_weights": headloss.TokenWeights()})
    per_token = spec.model_copy(update={"reduction": "none"})
    gen = generator(21)
    z, y, w = _batch(seed=22, b=4, t=6)
    inputs = _teacher(name, z, y, gen)
    counted = (y != -100).double()
    divisor = (w * counted).sum() if reduction == "mean" else torch.ones((), dtype=torch.float64)
    if entry == "logits":
        x, xr = z.float().requires_grad_(), z.float().requires_grad_()
        out = headloss.head_loss(x, y, weighted, token_weights=w.float(), backend=backend, **inputs)
        ref = headloss.head_loss(xr, y, per_token, backend=backend, **inputs)
        plain = headloss.head_loss(z.float(), y, spec, backend=backend, **inputs)
        got_grad, leaf = x, xr
    else:
        hidden = torch.randn(4, 6, H, generator=gen, dtype=torch.float64)
        weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).float()
        x, xr = hidden.float().requires_grad_(), hidden.float().requires_grad_()
        kw = dict(backend=backend, chunk_bytes=6 * V * 4, **inputs)
        out = headloss.linear_head_loss(x, weight, y, weighted, token_weights=w.float(), **kw)
        ref = headloss.linear_head_loss(xr, weight, y, per_token, **kw)
        plain = headloss.linear_head_loss(hidden.float(), weight, y, spec, **kw)
        got_grad, leaf = x, xr
    _total(out).backward()
    want = (w * ref.loss.double()).sum() / divisor
    (want + (_total(ref) - ref.loss.sum())).backward()
    torch.testing.assert_close(out.loss.detach().double(), want.detach(), rtol=3e-5, atol=1e-6)
    for key, value in plain.metrics.items():
        if key != "loss":
            torch.testing.assert_close(out.metrics[key].double(), value.double(), rtol=3e-5, atol=1e-6, msg=key)
    diff = (got_grad.grad.double() - leaf.grad.double()).abs().max()
    assert diff <= 3e-5 * leaf.grad.double().abs().max().clamp_min(1e-6)


def _policy_oracle(z, y, mask, w, adv, old, ref, loss_type: str, normalize: str) -> torch.Tensor:
    """fp64, [B, T] rows: CE 0.3 plus TRL's objective (clip 0.2, k3 KL 0.04, the entropy bonus 0.01 as a mean
    over the counted tokens), each aggregated with the token weights in the mask's place (``weights``) or
    on the per-token values (``tokens``); ``loss_type``: dapo (a token mean) or grpo (a mean over sequences of
    token means)."""
    logp_all = torch.log_softmax(z.double(), -1)
    m = mask.double() * (y != -100).double()
    yy = y.clamp(min=0)
    logp = logp_all.gather(-1, yy[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(logp - old.double())
    a = adv.double()[:, None]
    surrogate = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.04 * (torch.exp(ref - logp) - (ref - logp) - 1)
    w = w.double()
    on_values, in_mask = (w, m) if normalize == "tokens" else (torch.ones_like(w), m * w)

    def token_mean(values):
        return (values * on_values * in_mask).sum() / in_mask.sum()

    if loss_type == "dapo":
        policy = token_mean(surrogate)
    else:
        policy = ((surrogate * on_values * in_mask).sum(-1) / in_mask.sum(-1).clamp(min=1e-30)).mean()
    ce = -logp
    return 0.3 * token_mean(ce) + policy - 0.01 * token_mean(entropy)


@needs_kernel
@pytest.mark.parametrize("loss_type, normalize, entry, backend", tiered(
    ["dapo", "grpo"], ["weights", "tokens"], ["logits", "hidden"], ["triton", "torch"]))
def test_the_policy_term_aggregates_with_the_weights_as_an_fp64_oracle_does(loss_type, normalize, entry, backend):
    """The policy term with the cross-entropy beside it: the weights in its loss type's sums (or on its
    per-token values), the entropy bonus's mean and the CE's mean likewise; gradients too."""
    gen = generator(81)
    b, t = 3, 6
    hidden = torch.randn(b, t, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
    z = hidden @ weight.T if entry == "hidden" else torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, V, (b, t), generator=gen)
    y[0, 1] = -100
    mask = (torch.rand(b, t, generator=gen) > 0.2).float()
    w = 2 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    w[2, 2] = 0.0
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(z, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0] - 0.3 * torch.rand(b, t, generator=gen)
    ref = old - 0.1
    spec = LossSpec(cross_entropy={"weight": 0.3}, token_weights={"normalize": normalize},
                    policy={"loss_type": loss_type, "kl_beta": 0.04, "entropy_coef": 0.01,
                            "entropy_aggregation": "token-mean"})
    inputs = dict(token_weights=w.float(), advantages=adv.float(), old_logprobs=old.float(), ref_logprobs=ref.float(),
                  loss_mask=mask, backend=backend)
    if entry == "logits":
        leaf, oracle_leaf = z.float().requires_grad_(), z.clone().requires_grad_()
        out = headloss.head_loss(leaf, y, spec, **inputs)
        want = _policy_oracle(oracle_leaf, y, mask, w, adv, old, ref, loss_type, normalize)
    else:
        leaf, oracle_leaf = hidden.float().requires_grad_(), hidden.clone().requires_grad_()
        out = headloss.linear_head_loss(leaf, weight.float(), y, spec, chunk_bytes=4 * V * 4, **inputs)
        want = _policy_oracle(oracle_leaf @ weight.T, y, mask, w, adv, old, ref, loss_type, normalize)
    out.loss.backward()
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=2e-5, abs=1e-6)
    assert (leaf.grad.double() - oracle_leaf.grad).abs().max() <= 2e-5 * oracle_leaf.grad.abs().max()


@needs_kernel
@pytest.mark.parametrize("name", ["gspo", "off_policy", "top_entropy", "verl_kl_apart", "gmpo", "clip_cov"])
def test_every_policy_route_takes_the_weights_as_the_reference_does(name):
    """The routes that run the policy term in torch, by its kernels or on sequence statistics equal the
    plain-torch path (headloss.reference) with the same weights, under both normalizations."""
    policies = {"gspo": {"loss_type": "grpo", "importance_sampling": "sequence", "entropy_coef": 0.01,
                         "entropy_aggregation": "token-mean"},
                "off_policy": {"loss_type": "dapo", "off_policy_mask": 0.5, "entropy_coef": 0.01,
                               "entropy_aggregation": "token-mean"},
                "top_entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01,
                                "entropy_aggregation": "token-mean"},
                "verl_kl_apart": {"convention": "verl", "loss_type": "seq-mean-token-mean", "kl_beta": 0.1,
                                  "kl_entropy_loss_type": "token-mean", "entropy_coef": 0.01},
                "gmpo": {"convention": "verl", "objective": "gmpo", "loss_type": "seq-mean-token-mean"},
                "clip_cov": {"convention": "verl", "objective": "clip_cov", "loss_type": "token-mean"}}
    gen = generator(91)
    b, t = 4, 6
    z = torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, V, (b, t), generator=gen)
    w = 2 * torch.rand(b, t, generator=gen)
    w[1] = 0.0  # a sequence without weight
    old = torch.log_softmax(z, -1).max(-1).values - torch.rand(b, t, generator=gen, dtype=torch.float64)
    inputs = dict(token_weights=w, advantages=torch.randn(b, generator=gen), old_logprobs=old.float(),
                  ref_logprobs=old.float() - 0.1, loss_mask=(torch.rand(b, t, generator=gen) > 0.2).float())
    for normalize in ("weights", "tokens"):
        spec = LossSpec(cross_entropy=None, token_weights={"normalize": normalize}, policy=policies[name])
        results = []
        for backend in ("triton", "torch"):
            leaf = z.float().requires_grad_()
            torch.manual_seed(5)  # (clip_cov draws its tokens at random)
            out = headloss.head_loss(leaf, y, spec, backend=backend, **inputs)
            out.loss.backward()
            results.append((out.loss.detach(), leaf.grad))
        (got, got_grad), (want, want_grad) = results
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6, msg=f"{name} {normalize}")
        torch.testing.assert_close(got_grad, want_grad, rtol=2e-5, atol=1e-7, msg=f"{name} {normalize}")
        unweighted = headloss.head_loss(z.float(), y, spec.model_copy(update={"token_weights": None}),
                                        backend="torch", **{k: v for k, v in inputs.items() if k != "token_weights"})
        assert (got - unweighted.loss).abs() > 1e-6  # (the weights matter here)
        if normalize == "tokens":  # every weight 2: twice the unweighted call, on every route
            torch.manual_seed(5)
            doubled = headloss.head_loss(z.float(), y, spec, **{**inputs, "token_weights": torch.full_like(w, 2.0)})
            torch.manual_seed(5)
            once = headloss.head_loss(z.float(), y, spec.model_copy(update={"token_weights": None}),
                                      **{k: v for k, v in inputs.items() if k != "token_weights"})
            torch.testing.assert_close(doubled.loss, 2 * once.loss, rtol=2e-5, atol=1e-6, msg=name)


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_weighted_per_token_losses_and_the_divisors(backend):
    """reduction none returns w * L (token_loss too); num_items_in_batch divides instead of the weights;
    weights that are all 0 give a loss of 0 and no gradient; with normalize tokens, weights of 1 are the
    unweighted call."""
    z, y, w = _batch(seed=31)
    x = z.float()
    plain = headloss.head_loss(x, y, LossSpec(reduction="none"), backend=backend)
    none = headloss.head_loss(x, y, LossSpec(reduction="none", token_weights={}, outputs=("token_loss",)),
                              token_weights=w.float(), backend=backend)
    torch.testing.assert_close(none.loss, plain.loss * w.float())
    torch.testing.assert_close(none.token_loss, none.loss)
    items = headloss.head_loss(x, y, LossSpec(token_weights={}), token_weights=w.float(), num_items_in_batch=40,
                               backend=backend)
    torch.testing.assert_close(items.loss, none.loss.sum() / 40)
    zero = x.clone().requires_grad_()
    out = headloss.head_loss(zero, y, LossSpec(token_weights={}), token_weights=torch.zeros(3, 7), backend=backend)
    out.loss.backward()
    assert out.loss.item() == 0.0 and zero.grad.abs().max().item() == 0.0
    assert out.metrics["ce"].item() > 0.0  # (unweighted)
    ones = headloss.head_loss(x, y, LossSpec(token_weights={"normalize": "tokens"}), token_weights=torch.ones(3, 7),
                              backend=backend)
    torch.testing.assert_close(ones.loss, headloss.head_loss(x, y, backend=backend).loss)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", pytest.param("hidden", marks=pytest.mark.slow)])
def test_packed_rows_take_weights_per_sequence_or_per_row(entry):
    """Rows packed by cu_seqlens with [S] or [N] weights equal the padded call with [B]."""
    check_packed_row_input(entry, _sft(), "token_weights", lambda s, gen: 2 * torch.rand(s, generator=gen), 41, V, H)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_weight_that_is_negative_or_not_finite_is_named_with_its_position(bad, entry, backend):
    """The kernels find it on the device with the targets (raised in the call on CPU tensors); the
    plain-torch path raises the same error. A bad weight at an ignored token is refused too."""
    z, y, w = _batch(seed=51)
    w = w.float()
    w[0, 2] = bad  # (its target is ignore_index)
    spec = _sft()
    if entry == "logits":
        call = lambda: headloss.head_loss(z.float(), y, spec, token_weights=w, backend=backend)  # noqa: E731
    else:
        weight = torch.randn(V, H)
        call = lambda: headloss.linear_head_loss(torch.randn(3, 7, H), weight, y, spec,  # noqa: E731
                                                 token_weights=w, backend=backend)
    with pytest.raises(ValueError, match=r"token_weights: the value at position \(0, 2\) is not a finite number"):
        call()


def test_the_weights_input_and_the_spec_must_agree():
    z, y, w = _batch(seed=61)
    z, w = z.float(), w.float()
    with pytest.raises(ValueError, match="token_weights: required by spec.token_weights"):
        headloss.head_loss(z, y, _sft())
    with pytest.raises(ValueError, match="token_weights: given, but spec.token_weights is not set"):
        headloss.head_loss(z, y, LossSpec(), token_weights=w)
    with pytest.raises(ValueError, match=r"token_weights: shape \(3, 6\) fits neither one per row \(3, 7\)"):
        headloss.head_loss(z, y, _sft(), token_weights=w[:, :6])
    with pytest.raises(TypeError, match="token_weights: expected a floating-point tensor"):
        headloss.head_loss(z, y, _sft(), token_weights=torch.ones(3, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="normalize"):
        LossSpec(token_weights={"normalize": "sequences"})
    leaf = w.clone().requires_grad_()  # the weights take no gradient, on either path
    for backend in ("triton", "torch"):
        headloss.head_loss(z.clone().requires_grad_(), y, _sft(), token_weights=leaf, backend=backend).loss.backward()
        assert leaf.grad is None, backend
    with pytest.raises(ValueError, match=r"token_weights: shape \(5,\) fits neither"):
        headloss.linear_head_loss(torch.randn(3, 7, H), torch.randn(V, H), y, _sft(), token_weights=torch.ones(5))
    with pytest.raises(ValueError, match="token_weights: required by spec.token_weights"):
        headloss.reference.reference_head_loss(z, y, _sft())


def test_explain_names_the_input_and_the_divisor_and_demo_makes_one(tmp_path, capsys):
    text = explained_and_demoed(tmp_path, capsys, "token_weights: {}\nz_loss: {weight: 0.001}\n")
    assert "inputs      logits, targets, token_weights" in text
    assert "over their summed token weights (or num_items_in_batch)" in text
    assert "WEIGHT_NORM" in text
    text = explained_and_demoed(tmp_path, capsys, "cross_entropy: null\npolicy: {loss_type: dapo}\n"
                                "token_weights: {normalize: tokens}\n")
    assert "over their count (or num_items_in_batch); the policy term: the token weights on the per-token " \
           "values of its aggregation" in text


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_a_compiled_call_reads_the_weights_as_eager_does(entry):
    """torch.compile (fullgraph): the weights cross the ops with the call's other tensors."""
    spec = LossSpec(token_weights={}, entropy={"weight": 0.01})
    check_compiled_row_input(entry, spec, "token_weights", lambda gen: 2 * torch.rand(2, 5, generator=gen), 71, V, H)
