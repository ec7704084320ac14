"""A teacher given as probabilities (spec.Distillation.teacher "probs", the call's ``teacher_probs``
[.., V]): every divergence on both entry points and both paths, against an fp64 oracle written here
from the definitions (KL(q || p), KL(p || q), the generalized JSD with M = beta q + (1 - beta) p), with
zero probabilities in the teacher's rows; its rows' mass checked on the device and on the host alike."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import explained_and_demoed, generator, needs_kernel

import headloss
from headloss import LossSpec

V, H = 41, 10
BETA = 0.3


def _divergence(s_logp: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """Per row, fp64; q may hold zeros (0 log 0 = 0)."""
    p = s_logp.exp()
    log_q = torch.where(q > 0, q.log(), 0.0)
    if kind == "forward_kl":
        return torch.where(q > 0, q * (log_q - s_logp), 0.0).sum(-1)
    if kind == "reverse_kl":
        return (p * (s_logp - log_q)).sum(-1)
    m = BETA * q + (1 - BETA) * p
    log_m = m.log()
    kl_q = torch.where(q > 0, q * (log_q - log_m), 0.0).sum(-1)
    kl_p = (p * (s_logp - log_m)).sum(-1)
    return BETA * kl_q + (1 - BETA) * kl_p


def _oracle(z: torch.Tensor, y: torch.Tensor, q: torch.Tensor, kind: str) -> tuple[torch.Tensor, float, float]:
    """(mean of CE + divergence over the counted rows, mean divergence, mean teacher entropy)."""
    s_logp = torch.log_softmax(z.double(), -1).reshape(-1, z.shape[-1])
    q = q.double().reshape(-1, z.shape[-1])
    y = y.reshape(-1)
    counted = y != -100
    ce = -s_logp.gather(1, y.clamp(min=0)[:, None])[:, 0]
    div = _divergence(s_logp, q, kind)
    entropy = -torch.where(q > 0, q * torch.where(q > 0, q.log(), 0.0), 0.0).sum(-1)
    loss = ((ce + div) * counted).sum() / counted.sum()
    return loss, div[counted].mean().item(), entropy[counted].mean().item()


def _batch(seed: int, zeros: bool):
    gen = generator(seed)
    z = torch.randn(3, 6, V, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, V, (3, 6), generator=gen)
    y[1, 3] = -100
    t = torch.randn(3, 6, V, generator=gen, dtype=torch.float64) * 2
    if zeros:  # a teacher that rules some ids out (a forward KL and the JSD take them; a reverse KL is inf there)
        t[..., :5] = -math.inf
        t[0, 0, 5:20] = -math.inf
    return z, y, torch.softmax(t, -1)


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_a_teacher_given_as_probabilities_equals_the_fp64_oracle(kind, entry, backend):
    spec = LossSpec(distillation={"teacher": "probs", "divergence": kind, "beta": BETA})
    z, y, q = _batch(seed=5, zeros=kind != "reverse_kl")
    if entry == "logits":
        want, div, entropy = _oracle(z, y, q, kind)
        zo = z.clone().requires_grad_()
        _oracle(zo, y, q, kind)[0].backward()
        x = z.float().requires_grad_()
        out = headloss.head_loss(x, y, spec, teacher_probs=q.float(), backend=backend)
        out.loss.backward()
        got_grad, want_grad = x.grad, zo.grad
    else:
        gen = generator(6)
        hidden = torch.randn(3, 6, H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
        want, div, entropy = _oracle(hidden @ weight.T, y, q, kind)
        ho = hidden.clone().requires_grad_()
        _oracle(ho @ weight.T, y, q, kind)[0].backward()
        h = hidden.float().requires_grad_()
        out = headloss.linear_head_loss(h, weight.float(), y, spec, teacher_probs=q.float(), backend=backend,
                                        chunk_bytes=5 * V * 4)
        out.loss.backward()
        got_grad, want_grad = h.grad, ho.grad
    assert out.loss.item() == pytest.approx(want.item(), rel=2e-6)
    assert out.metrics["distill/divergence"].item() == pytest.approx(div, rel=1e-5, abs=1e-6)
    assert out.metrics["distill/teacher_entropy"].item() == pytest.approx(entropy, rel=1e-5)
    assert (got_grad.double() - want_grad).abs().max() <= 2e-6 * want_grad.abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", ["forward_kl", "jsd"])
def test_a_row_whose_first_blocks_hold_only_zeros_and_subnormals(kind):
    """The kernels scale q by 2^-(the largest so far) per block: a first block of zeros and subnormal
    probabilities (largest below 2^-126) keeps that scale finite, and the row equals the oracle."""
    v = 9001  # more than two vocabulary blocks
    gen = generator(15)
    z = torch.randn(2, v, generator=gen, dtype=torch.float64)
    y = torch.tensor([3, v - 2])
    t = torch.randn(2, v, generator=gen, dtype=torch.float64)
    t[0, : v // 2] = -math.inf
    q = torch.softmax(t, -1).float()
    q[0, 100:110] = 1e-40  # subnormal in fp32
    q[0] /= q[0].double().sum().float()
    spec = LossSpec(distillation={"teacher": "probs", "divergence": kind, "beta": BETA})
    want, div, entropy = _oracle(z, y, q.double(), kind)
    out = headloss.head_loss(z.float(), y, spec, teacher_probs=q)
    assert torch.isfinite(out.loss)
    assert out.loss.item() == pytest.approx(want.item(), rel=2e-6)
    assert out.metrics["distill/teacher_entropy"].item() == pytest.approx(entropy, rel=1e-5)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_shifted_and_packed_rows_read_their_own_teacher_rows(entry):
    """shift=True with HF labels, and the same tokens packed by cu_seqlens, equal each other."""
    z, y, q = _batch(seed=8, zeros=True)
    spec = LossSpec(distillation={"teacher": "probs", "divergence": "jsd"}, token_accuracy=True)
    if entry == "logits":
        rows = z.float()

        def call(r, targets, probs, **kw):
            return headloss.head_loss(r, targets, spec, teacher_probs=probs, shift=True, **kw)
    else:
        gen = generator(9)
        rows = torch.randn(3, 6, H, generator=gen)
        weight = torch.randn(V, H, generator=gen) * 0.5

        def call(r, targets, probs, **kw):
            return headloss.linear_head_loss(r, weight, targets, spec, teacher_probs=probs, shift=True,
                                             chunk_bytes=4 * V * 4, **kw)
    padded = call(rows, y, q.float())
    cu = torch.tensor([0, 6, 12, 18], dtype=torch.int32)
    packed = call(rows.reshape(18, -1), y.reshape(-1), q.float().reshape(18, V), cu_seqlens=cu)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-6, atol=1e-7)
    for key, value in padded.metrics.items():
        torch.testing.assert_close(packed.metrics[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("fault", ["mass", "negative", "nan"])
def test_a_row_that_is_not_a_distribution_is_named_with_its_position(fault, entry, backend):
    """Checked on the device in the head kernel (the row's mass from its online sums), on the host on the
    plain-torch path: the same error."""
    z, y, q = _batch(seed=11, zeros=False)
    q = q.float()
    if fault == "mass":
        q[2, 4] *= 1.01
    elif fault == "negative":
        q[2, 4, 7] = -q[2, 4, 8]
        q[2, 4, 9] += 2 * q[2, 4, 8]
    else:
        q[2, 4, 7] = float("nan")
    spec = LossSpec(distillation={"teacher": "probs"})
    with pytest.raises(ValueError, match=r"teacher_probs: the row at position \(2, 4\) does not sum to 1 within "
                                         r"0.001, or holds a negative or NaN probability"):
        if entry == "logits":
            headloss.head_loss(z.float(), y, spec, teacher_probs=q, backend=backend)
        else:
            headloss.linear_head_loss(torch.randn(3, 6, H), torch.randn(V, H), y, spec, teacher_probs=q,
                                      backend=backend, chunk_bytes=4 * V * 4)  # chunks of 4 of the 17 rows
    headloss.head_loss(z.float(), y, spec, teacher_probs=q, backend=backend, validate=False)  # no check asked


def test_the_spec_and_the_inputs_must_agree():
    z, y, q = _batch(seed=13, zeros=False)
    z, q = z.float(), q.float()
    probs = LossSpec(distillation={"teacher": "probs"})
    with pytest.raises(ValueError, match=r"teacher_probs: required by distillation \(teacher 'probs'\)"):
        headloss.head_loss(z, y, probs)
    with pytest.raises(ValueError, match="teacher_logits: the spec's distillation takes a 'probs' teacher"):
        headloss.head_loss(z, y, probs, teacher_probs=q, teacher_logits=z)
    with pytest.raises(ValueError, match="teacher_probs: given, but the spec has a 'logits' teacher"):
        headloss.head_loss(z, y, LossSpec(distillation={}), teacher_logits=z, teacher_probs=q)
    with pytest.raises(ValueError, match="teacher_probs: given, but the spec has no distillation term"):
        headloss.head_loss(z, y, LossSpec(), teacher_probs=q)
    with pytest.raises(ValueError, match=r"teacher_probs: shape \(3, 6, 40\) does not match logits"):
        headloss.head_loss(z, y, probs, teacher_probs=q[..., :40])
    with pytest.raises(ValueError, match="temperature: a 'probs' teacher is taken as given"):
        LossSpec(distillation={"teacher": "probs", "temperature": 2.0})
    with pytest.raises(ValueError, match="teacher_hidden: the spec's distillation takes a 'probs' teacher"):
        headloss.linear_head_loss(torch.randn(3, 6, H), torch.randn(V, H), y, probs, teacher_probs=q,
                                  teacher_hidden=torch.randn(3, 6, H), teacher_weight=torch.randn(V, H))


def test_explain_names_the_input_and_demo_makes_one(tmp_path, capsys):
    text = explained_and_demoed(tmp_path, capsys, "distillation: {teacher: probs, divergence: jsd}\n")
    assert "inputs      logits, targets, teacher_probs" in text and "TEACHER_PROBS" in text
    text = explained_and_demoed(tmp_path, capsys, "distillation: {teacher: topk, topk: rest}\n")
    assert "inputs      logits, targets, teacher_ids, teacher_logprobs or teacher_probs" in text


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_a_compiled_call_reads_the_probabilities_and_checks_them_as_eager_does(entry):
    gen = generator(17)
    spec = LossSpec(distillation={"teacher": "probs", "divergence": "jsd"})
    y = torch.randint(0, V, (2, 5), generator=gen)
    q = torch.softmax(torch.randn(2, 5, V, generator=gen), -1)
    if entry == "logits":
        rows = torch.randn(2, 5, V, generator=gen)

        def call(r, probs):
            return headloss.head_loss(r, y, spec, teacher_probs=probs).loss
    else:
        rows, weight = torch.randn(2, 5, H, generator=gen), torch.randn(V, H, generator=gen)

        def call(r, probs):
            return headloss.linear_head_loss(r, weight, y, spec, teacher_probs=probs, chunk_bytes=4 * V * 4).loss
    eager = rows.clone().requires_grad_()
    want = call(eager, q)
    want.backward()
    compiled_call = torch.compile(call, backend="aot_eager", fullgraph=True)
    compiled = rows.clone().requires_grad_()
    got = compiled_call(compiled, q)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled.grad, eager.grad)
    bad = q.clone()
    bad[1, 2] *= 1.5
    with pytest.raises(ValueError, match=r"teacher_probs: the row at position \(1, 2\) does not sum to 1"):
        compiled_call(rows, bad)


# --- a top-k teacher given as probabilities (teacher 'topk' with teacher_ids + teacher_probs [.., K]) ----


def _topk_batch(seed: int, k: int = 6):
    """Student logits [3, 6, V] (fp64), targets, a teacher's top-k ids [3, 6, k] (one -1 entry) and its
    probabilities there (fp64; one 0, an entry that takes no part)."""
    gen = generator(seed)
    z = torch.randn(3, 6, V, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, V, (3, 6), generator=gen)
    y[1, 3] = -100
    ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(18)]).view(3, 6, k)
    ids[2, 1, 4] = -1
    probs = torch.softmax(torch.randn(3, 6, V, generator=gen, dtype=torch.float64) * 2, -1).gather(-1, ids.clamp(min=0))
    probs[0, 2, 3] = 0.0
    return z, y, ids, probs


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("entry", ["logits", pytest.param("hidden", marks=pytest.mark.slow)])
@pytest.mark.parametrize("topk", ["renormalized", "rest"])
@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_a_topk_teacher_given_as_probabilities_equals_trls_oracle(kind, topk, entry, backend):
    """teacher_probs [.., K] beside teacher_ids is the top-k teacher whose log-probs are their log: TRL's
    server distillation in fp64 (tests/trl_oracle.py, from its source) on log q, loss and gradient."""
    import trl_oracle

    spec = LossSpec(distillation={"teacher": "topk", "divergence": kind, "topk": topk, "beta": BETA})
    z, y, ids, probs = _topk_batch(seed=17)
    if entry == "hidden":
        gen = generator(18)
        hidden = torch.randn(3, 6, H, generator=gen, dtype=torch.float64)
        weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
        leaf = hidden.clone().requires_grad_()
        x64 = leaf @ weight.T
    else:
        leaf = z.clone().requires_grad_()
        x64 = leaf
    s_logp = torch.log_softmax(x64, -1)
    ce = -s_logp.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    div = trl_oracle.token_divergence(x64.reshape(-1, V), ids.reshape(-1, 6), probs.log().reshape(-1, 6), topk,
                                      trl_oracle.beta_of(kind, BETA))
    counted = (y != -100).reshape(-1)
    want = ((ce.reshape(-1) + div) * counted).sum() / counted.sum()
    want.backward()
    if entry == "hidden":
        h = hidden.float().requires_grad_()
        out = headloss.linear_head_loss(h, weight.float(), y, spec, teacher_ids=ids, teacher_probs=probs.float(),
                                        backend=backend, chunk_bytes=5 * V * 4)
        got = h
    else:
        got = z.float().requires_grad_()
        out = headloss.head_loss(got, y, spec, teacher_ids=ids, teacher_probs=probs.float(), backend=backend)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert (got.grad.double() - leaf.grad).abs().max() <= 1e-5 * leaf.grad.abs().max()


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_topk_probabilities_and_their_log_are_one_teacher_on_packed_rows(backend):
    """Packed sequences (cu_seqlens) with a shifted top-k teacher: the probabilities and their log as
    teacher_logprobs give the same loss, metrics and gradient."""
    z, y, ids, probs = _topk_batch(seed=19)
    z, y, ids, probs = z.reshape(1, 18, V), y.reshape(1, 18), ids.reshape(1, 18, -1), probs.reshape(1, 18, -1)
    spec = LossSpec(distillation={"teacher": "topk", "divergence": "jsd", "topk": "rest", "beta": BETA})
    cu = torch.tensor([0, 5, 11, 18], dtype=torch.int32)
    outs = []
    for teacher in ({"teacher_probs": probs.float()}, {"teacher_logprobs": probs.float().log()}):
        x = z.float().requires_grad_()
        out = headloss.head_loss(x, y, spec, teacher_ids=ids, shift=True, cu_seqlens=cu, backend=backend,
                                 **teacher)
        out.loss.backward()
        outs.append((out, x.grad))
    (a, ga), (b, gb) = outs
    assert a.loss.item() == b.loss.item()
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in b.metrics)
    assert torch.equal(ga, gb)


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize("fault", ["negative", pytest.param("nan", marks=pytest.mark.slow),
                                   pytest.param("above_one", marks=pytest.mark.slow)])
def test_a_bad_topk_probability_is_named_with_its_entry(fault, entry, backend):
    """A probability outside [0, 1] (past the rounding tolerance) or NaN is refused on both paths, naming
    teacher_probs and the entry (the kernels' path: on the device, the default validation); a value
    above 1 by rounding, and a 0, are taken."""
    z, y, ids, probs = _topk_batch(seed=21)
    q = probs.float()
    q[1, 4, 2] = {"negative": -0.01, "nan": float("nan"), "above_one": 1.01}[fault]
    spec = LossSpec(distillation={"teacher": "topk"})

    def call(teacher):
        if entry == "logits":
            return headloss.head_loss(z.float(), y, spec, teacher_ids=ids, teacher_probs=teacher, backend=backend)
        gen = generator(22)
        return headloss.linear_head_loss(torch.randn(3, 6, H, generator=gen), torch.randn(V, H, generator=gen), y,
                                         spec, teacher_ids=ids, teacher_probs=teacher, backend=backend)

    with pytest.raises(ValueError, match=r"teacher_probs: the value at row 10, entry 2 is not a probability"):
        call(q)
        headloss.check_pending(wait=True)
    q[1, 4, 2] = 1.0 + 1e-6
    assert torch.isfinite(call(q).loss)


def test_a_topk_teacher_takes_its_probabilities_or_their_log_not_both():
    z, y, ids, probs = _topk_batch(seed=23)
    spec = LossSpec(distillation={"teacher": "topk"})
    with pytest.raises(ValueError, match="teacher_probs: give the top-k teacher.s probabilities or their log"):
        headloss.head_loss(z.float(), y, spec, teacher_ids=ids, teacher_probs=probs.float(),
                           teacher_logprobs=probs.float().log())
    with pytest.raises(ValueError, match=r"teacher_probs: shape \(3, 6, 5\) does not match teacher_ids"):
        headloss.head_loss(z.float(), y, spec, teacher_ids=ids, teacher_probs=probs.float()[..., :5])
    with pytest.raises(ValueError, match="teacher_probs: given, but the spec has a 'token' teacher"):
        headloss.head_loss(z.float(), y, LossSpec(distillation={"teacher": "token"}), teacher_probs=probs.float())
