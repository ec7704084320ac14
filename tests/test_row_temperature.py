"""Per-row temperature (spec.LogitTransform.per_row_temperature, the call's ``temperature``): every row's
logits at its own temperature, on both entry points and both paths.

Two independent checks: an fp64 oracle of the SFT terms written here from their definitions (smoothed
cross-entropy, z-loss, entropy, accuracy, after logit_scale and softcap), and the identity that
defines the feature for every other term and route (distillation, the policy term, sequence
statistics): without softcap or logit_scale, a row at temperature t scores as the logits row divided
by t at temperature 1, and d loss / d z is d loss / d x divided by t."""

from __future__ import annotations

import pytest
import torch
from conftest import check_compiled_row_input, check_packed_row_input, explained_and_demoed, generator, needs_kernel

import headloss
from headloss import LossSpec

V, H = 37, 12
SMOOTHING, W_Z, W_H, SCALE, CAP = 0.1, 1e-3, 0.02, 1.2, 5.0
SFT = LossSpec(cross_entropy={"label_smoothing": SMOOTHING}, z_loss={"weight": W_Z}, entropy={"weight": W_H},
               token_accuracy=True, transform={"logit_scale": SCALE, "softcap": CAP, "per_row_temperature": True})


def _oracle(z: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """fp64: mean over the counted rows of (1 - eps) nll + eps mean(-log p) + w_z lse^2 + w_H H, with
    x = softcap(scale z) / t per row; the metrics ce, entropy and accuracy."""
    x = CAP * torch.tanh(z.double() * SCALE / CAP) / t.double()[..., None]
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1)
    counted = y != -100
    x, y = x[counted], y[counted]
    lse = torch.logsumexp(x, -1)
    logp = x - lse[:, None]
    nll = -logp.gather(1, y[:, None])[:, 0]
    ce = (1 - SMOOTHING) * nll - SMOOTHING * logp.mean(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = (ce + W_Z * lse**2 + W_H * entropy).mean()
    accuracy = (x.argmax(-1) == y).double().mean()
    return loss, {"ce": ce.mean().item(), "entropy": entropy.mean().item(), "token_accuracy": accuracy.item()}


def _batch(seed: int, b: int = 3, t: int = 7):
    gen = generator(seed)
    z = torch.randn(b, t, V, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, V, (b, t), generator=gen)
    y[0, 2] = y[2, 5] = -100
    temperature = 0.3 + 1.7 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    return z, y, temperature


def _shifted(y: torch.Tensor, t: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(targets to pass, the rows' own targets, the rows' temperatures) of a shifted call: HF labels
    [B, T] (row t against labels[t + 1], the last row unscored) or completion ids [B, T - 1]."""
    if form == "labels":
        return y, torch.cat((y[:, 1:], torch.full_like(y[:, :1], -100)), 1), t
    return y[:, 1:], torch.cat((y[:, 1:], torch.full_like(y[:, :1], -100)), 1), t[:, :-1]


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("layout", ["rows", "per_sequence", "labels", "completion"])
def test_each_row_at_its_own_temperature_equals_the_fp64_oracle(entry, backend, layout):
    z, y, t = _batch(seed=11)
    weight = None
    if entry == "hidden":
        gen = generator(12)
        hidden = torch.randn(*z.shape[:2], H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
        z = hidden @ weight.T
    if layout == "per_sequence":
        t = t[:, :1].expand_as(t).contiguous()
    given_t = t[:, 0] if layout == "per_sequence" else t
    targets, rows_y, kw = y, y, {}
    if layout in ("labels", "completion"):
        targets, rows_y, given_t = _shifted(y, t, layout)
        kw["shift"] = True
    want, metrics = _oracle(z, rows_y, t)
    zo = z.clone().requires_grad_()
    _oracle(zo, rows_y, t)[0].backward()
    if entry == "logits":
        x = z.float().requires_grad_()
        out = headloss.head_loss(x, targets, SFT, temperature=given_t.float(), backend=backend, **kw)
        out.loss.backward()
        got_grad, want_grad = x.grad, zo.grad
    else:
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        out = headloss.linear_head_loss(h, w, targets, SFT, temperature=given_t.float(), backend=backend,
                                        chunk_bytes=5 * V * 4, **kw)
        out.loss.backward()
        ho = hidden.clone().requires_grad_()
        _oracle(ho @ weight.T, rows_y, t)[0].backward()
        got_grad, want_grad = h.grad, ho.grad
    assert out.loss.item() == pytest.approx(want.item(), rel=2e-6)
    for name, value in metrics.items():
        assert out.metrics[name].item() == pytest.approx(value, rel=2e-5, abs=1e-6), name
    assert (got_grad.double() - want_grad).abs().max() <= 2e-6 * want_grad.abs().max()


SPECS = {
    "distill_jsd": LossSpec(distillation={"divergence": "jsd", "temperature": 2.0}, token_accuracy=True,
                            transform={"per_row_temperature": True}),
    "dapo_kl": LossSpec(cross_entropy=None, entropy={"weight": 0.01}, transform={"per_row_temperature": True},
                        policy={"loss_type": "dapo", "kl_beta": 0.04, "eps_high": 0.28}),
    "gspo": LossSpec(cross_entropy=None, transform={"per_row_temperature": True},
                     policy={"loss_type": "grpo", "importance_sampling": "sequence"}),
    "top_entropy": LossSpec(cross_entropy=None, transform={"per_row_temperature": True},
                            policy={"loss_type": "dapo", "top_entropy_quantile": 0.5}),
    "deferred_outputs": LossSpec(z_loss={"weight": 1e-2}, reduction="none", outputs=("logprobs", "entropy"),
                                 differentiable_outputs=True, transform={"per_row_temperature": True}),
}


def _inputs(name: str, z: torch.Tensor, gen: torch.Generator) -> dict:
    b, t = z.shape[:2]
    if name.startswith("distill"):
        return {"teacher_logits": (z + torch.randn(z.shape, generator=gen, dtype=torch.float64)).float()}
    if name == "deferred_outputs":
        return {}
    old = torch.log_softmax(z, -1).max(-1).values - torch.rand(b, t, generator=gen, dtype=torch.float64)
    return {"advantages": torch.randn(b, generator=gen).float(), "old_logprobs": old.float(),
            "ref_logprobs": (old - 0.1).float()}


def _total(out) -> torch.Tensor:
    total = out.loss.sum()
    for name, w in (("logprobs", 0.3), ("entropy", -0.2)):
        value = getattr(out, name)
        if value is not None and value.requires_grad:
            total = total + w * value.sum()
    return total


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("entry", ["logits", pytest.param("hidden", marks=pytest.mark.slow)])  # (fast: the packed test)
@pytest.mark.parametrize("name", list(SPECS))
def test_a_row_at_temperature_t_scores_as_its_logits_over_t(name, entry, backend):
    """Every term and route: the call at per-row temperatures equals the call at temperature 1 on the
    logits divided by them, and d/dz = d/dx / t (the lm_head: hidden states divided by t give logits
    divided by t, so d/dh = d/dh' / t)."""
    spec = SPECS[name]
    plain = spec.model_copy(update={"transform": headloss.LogitTransform()})
    gen = generator(21)
    z, y, _ = _batch(seed=22, b=4, t=6)
    t = 0.4 + 1.4 * torch.rand(4, generator=gen, dtype=torch.float64)  # one per sequence
    inputs = _inputs(name, z, gen)
    if entry == "logits":
        x = z.float().requires_grad_()
        out = headloss.head_loss(x, y, spec, temperature=t.float(), backend=backend, **inputs)
        _total(out).backward()
        xt = (z / t[:, None, None]).float().requires_grad_()
        ref = headloss.head_loss(xt, y, plain, backend=backend, **inputs)
        _total(ref).backward()
        got, want = x.grad.double(), xt.grad.double() / t[:, None, None]
    else:
        hidden = torch.randn(4, 6, H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5
        h = hidden.float().requires_grad_()
        out = headloss.linear_head_loss(h, weight.float(), y, spec, temperature=t.float(), backend=backend,
                                        chunk_bytes=6 * V * 4, **inputs)
        _total(out).backward()
        ht = (hidden / t[:, None, None]).float().requires_grad_()
        ref = headloss.linear_head_loss(ht, weight.float(), y, plain, backend=backend, chunk_bytes=6 * V * 4,
                                        **inputs)
        _total(ref).backward()
        got, want = h.grad.double(), ht.grad.double() / t[:, None, None]
    torch.testing.assert_close(out.loss.detach().double(), ref.loss.detach().double(), rtol=3e-5, atol=1e-6)
    for key, value in ref.metrics.items():
        torch.testing.assert_close(out.metrics[key].double(), value.double(), rtol=3e-5, atol=1e-6, msg=key)
    assert (got - want).abs().max() <= 3e-5 * want.abs().max().clamp_min(1e-6)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_packed_rows_take_one_temperature_per_sequence_or_per_row(entry):
    """Rows packed by cu_seqlens with [S] or [N] temperatures equal the padded call with [B]."""
    check_packed_row_input(entry, SFT, "temperature", lambda s, gen: 0.5 + torch.rand(s, generator=gen), 31, V, H)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_temperature_that_is_not_positive_and_finite_is_named_with_its_position(bad, entry, backend):
    """The kernels find it on the device with the targets (raised in the call on CPU tensors); the
    plain-torch path raises the same error."""
    z, y, t = _batch(seed=41)
    t = t.float()
    t[1, 4] = bad
    if entry == "logits":
        call = lambda: headloss.head_loss(z.float(), y, SFT, temperature=t, backend=backend)  # noqa: E731
    else:
        w = torch.randn(V, H)
        call = lambda: headloss.linear_head_loss(torch.randn(3, 7, H), w, y, SFT, temperature=t,  # noqa: E731
                                                 backend=backend)
    with pytest.raises(ValueError, match=r"temperature: the value at position \(1, 4\) is not a positive finite"):
        call()


def test_the_temperature_input_and_the_spec_must_agree():
    z, y, t = _batch(seed=51)
    z, t = z.float(), t.float()
    with pytest.raises(ValueError, match="temperature: required by spec.transform.per_row_temperature"):
        headloss.head_loss(z, y, SFT)
    with pytest.raises(ValueError, match="temperature: given, but spec.transform.per_row_temperature is not set"):
        headloss.head_loss(z, y, LossSpec(), temperature=t)
    with pytest.raises(ValueError, match=r"temperature: shape \(3, 6\) fits neither one per row \(3, 7\)"):
        headloss.head_loss(z, y, SFT, temperature=t[:, :6])
    with pytest.raises(TypeError, match="temperature: expected a floating-point tensor"):
        headloss.head_loss(z, y, SFT, temperature=torch.ones(3, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must stay 1"):
        LossSpec(transform={"temperature": 0.7, "per_row_temperature": True})
    with pytest.raises(ValueError, match=r"temperature: shape \(5,\) fits neither"):
        headloss.linear_head_loss(torch.randn(3, 7, H), torch.randn(V, H), y, SFT, temperature=torch.ones(5))


def test_explain_names_the_input_and_demo_makes_one(tmp_path, capsys):
    text = explained_and_demoed(tmp_path, capsys, "transform: {per_row_temperature: true}\nz_loss: {weight: 0.001}\n")
    assert "inputs      logits, targets, temperature" in text
    assert "inv_temperature per row: 1 / the call's temperature" in text


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_a_compiled_call_reads_the_temperatures_as_eager_does(entry):
    """torch.compile (fullgraph): the temperatures cross the ops with the call's other tensors."""
    spec = LossSpec(transform={"per_row_temperature": True}, entropy={"weight": 0.01})
    check_compiled_row_input(entry, spec, "temperature", lambda gen: 0.5 + torch.rand(2, generator=gen), 71, V, H)
