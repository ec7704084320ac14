"""The log-probs of selected ids (``outputs: [selected_logprobs]`` with the call's ``selected_ids`` [.., K]):
log p of each id under the spec's transform, 0 where the id is -1 or the row is not scored, differentiable
with ``differentiable_outputs`` (the caller's gradient on them reaches the logits, or the hidden states and
the weight), on both entry points and both paths, packed rows and vocab-parallel (tests/test_parallel.py).

The oracle is written here in fp64 from the definition (softcap(scale * z) / T, log_softmax, a gather) and
differentiated by autograd: it shares nothing with headloss.reference."""

from __future__ import annotations

import pytest
import torch
from conftest import explained_and_demoed, generator, needs_kernel, tiered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headloss
from headloss import LossSpec

V, H = 37, 12


def _transformed(z: torch.Tensor, logit_scale=1.0, softcap=None, temperature=1.0) -> torch.Tensor:
    """fp64 [rows, V]: softcap(scale z) / T (a per-row T: one per row of z)."""
    x = z.double() * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    t = temperature if not torch.is_tensor(temperature) else temperature.double().reshape(-1, 1)
    return x.reshape(-1, z.shape[-1]) / t


def _oracle(z: torch.Tensor, ids: torch.Tensor, counted: torch.Tensor, **transform):
    """fp64 [rows, K]: log_softmax(softcap(scale z) / T) at each id, 0 at -1 and at rows not counted."""
    x = _transformed(z, **transform)
    logp = x - torch.logsumexp(x, -1, keepdim=True)
    flat = ids.reshape(-1, ids.shape[-1])
    picked = logp.gather(1, flat.clamp(min=0))
    return torch.where((flat != -1) & counted.reshape(-1, 1), picked, 0.0)


def _batch(seed: int, b: int, t: int, k: int, vocab: int = V):
    gen = generator(seed)
    z = torch.randn(b, t, vocab, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, vocab, (b, t), generator=gen)
    ids = torch.randint(-1, vocab, (b, t, k), generator=gen)
    if b * t > 2:
        y[0, min(1, t - 1)] = -100
    if k > 1:  # an id twice in one row
        ids[-1, -1, k - 1] = ids[-1, -1, 0] = vocab - 1
    g = torch.randn(b, t, k, generator=gen, dtype=torch.float64)
    return z, y, ids, g


TRANSFORMS = {"plain": {}, "softcap-temperature": {"logit_scale": 1.3, "softcap": 4.0, "temperature": 0.7}}


@needs_kernel
@pytest.mark.parametrize(("entry", "backend", "dtype", "transform", "k"), tiered(
    ["logits", "lm_head"], ["triton", "torch"], [torch.float32, torch.bfloat16], list(TRANSFORMS), [1, 7, 64],
    pairs=False))
def test_selected_logprobs_and_their_gradient_match_an_fp64_oracle(entry, backend, dtype, transform, k):
    """Values and the gradient of loss + sum(g * selected) against fp64: logits, or hidden states and weight
    (whose logits the oracle computes in fp64 from the same rounded inputs)."""
    z, y, ids, g = _batch(seed=k + len(transform), b=2, t=5, k=k)
    spec = LossSpec(cross_entropy=None, z_loss={"weight": 1e-3}, outputs=("selected_logprobs",),
                    differentiable_outputs=True,
                    transform=TRANSFORMS[transform])
    gen = generator(7)
    if entry == "logits":
        leaf = z.to(dtype).requires_grad_()
        out = headloss.head_loss(leaf, y, spec, selected_ids=ids, backend=backend)
        leaves = (leaf,)
        ref_leaves = (leaf.detach().double().requires_grad_(),)
        logits64 = ref_leaves[0]
    else:
        hidden = torch.randn(2, 5, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
        out = headloss.linear_head_loss(hidden, weight, y, spec, selected_ids=ids, backend=backend,
                                        chunk_bytes=3 * V * 4)
        leaves = (hidden, weight)
        ref_leaves = tuple(t.detach().double().requires_grad_() for t in leaves)
        logits64 = ref_leaves[0] @ ref_leaves[1].T
    counted = y != -100
    want = _oracle(logits64, ids, counted, **TRANSFORMS[transform])
    lse = torch.logsumexp(_transformed(logits64, **TRANSFORMS[transform]), -1)
    ref_loss = 1e-3 * (lse[counted.reshape(-1)] ** 2).mean()
    (ref_loss + (want * g.reshape(want.shape)).sum()).backward()
    assert out.selected_logprobs.shape == (2, 5, k)
    tol = dict(rtol=2e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(out.selected_logprobs.double().reshape(want.shape), want.detach(), **tol)
    assert (out.selected_logprobs[ids == -1] == 0).all() and (out.selected_logprobs[0, 1] == 0).all()
    (out.loss + (out.selected_logprobs * g.to(out.selected_logprobs.dtype)).sum()).backward()
    for got, ref in zip(leaves, ref_leaves):
        scale = ref.grad.abs().max()
        torch.testing.assert_close(got.grad.double() / scale, ref.grad / scale, **tol)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", "lm_head"])
def test_asking_for_selected_logprobs_changes_neither_the_loss_nor_its_gradient(entry):
    """Fused mode (no differentiable outputs): the same loss, metrics and gradient as the call without them;
    the values detached, equal to the deferred mode's."""
    z, y, ids, _ = _batch(seed=3, b=3, t=4, k=5)
    base = LossSpec(entropy={"weight": 0.1}, token_accuracy=True)
    spec = base.model_copy(update={"outputs": ("selected_logprobs",)})
    deferred = spec.model_copy(update={"differentiable_outputs": True})
    weight = torch.randn(V, H, generator=generator(1)) * 0.5
    rows = z.float() if entry == "logits" else torch.randn(3, 4, H, generator=generator(2))

    def call(s, **kw):
        leaf = rows.clone().requires_grad_()
        if entry == "logits":
            out = headloss.head_loss(leaf, y, s, **kw)
        else:
            out = headloss.linear_head_loss(leaf, weight, y, s, chunk_bytes=4 * V * 4, **kw)
        out.loss.backward()
        return out, leaf.grad

    plain, g_plain = call(base)
    got, g_got = call(spec, selected_ids=ids)
    assert got.route == plain.route and not got.selected_logprobs.requires_grad
    torch.testing.assert_close(got.loss, plain.loss, rtol=0, atol=0)
    torch.testing.assert_close(g_got, g_plain, rtol=0, atol=0)
    assert got.metrics.keys() == plain.metrics.keys()
    other, _ = call(deferred, selected_ids=ids)
    torch.testing.assert_close(other.selected_logprobs.detach(), got.selected_logprobs, rtol=1e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1), (3, 4)])
@pytest.mark.parametrize("vocab", [5, 300])
def test_one_row_and_a_vocabulary_under_or_over_a_block(shape, vocab):
    """One row and K over V (every id, then more); a vocabulary of several blocks."""
    k = 9
    z, y, ids, g = _batch(seed=vocab, b=shape[0], t=shape[1], k=k, vocab=vocab)
    spec = LossSpec(outputs=("selected_logprobs",), differentiable_outputs=True)
    leaf = z.float().requires_grad_()
    out = headloss.head_loss(leaf, y, spec, selected_ids=ids)
    (out.selected_logprobs * g.float()).sum().backward()
    ref = z.clone().requires_grad_()
    want = _oracle(ref, ids, y != -100)
    (want * g.reshape(want.shape)).sum().backward()
    torch.testing.assert_close(out.selected_logprobs.double().reshape(want.shape), want.detach(), rtol=1e-4,
                               atol=2e-5)
    torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-4, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", "lm_head"])
def test_a_per_row_temperature_scores_each_row_at_its_own(entry):
    z, y, ids, g = _batch(seed=11, b=2, t=5, k=4)
    temperature = 0.5 + torch.rand(2, 5, generator=generator(4))
    spec = LossSpec(outputs=("selected_logprobs",), transform={"per_row_temperature": True})
    if entry == "logits":
        out = headloss.head_loss(z.float(), y, spec, selected_ids=ids, temperature=temperature)
        logits = z
    else:
        hidden, weight = torch.randn(2, 5, H, generator=generator(5)), torch.randn(V, H, generator=generator(6))
        out = headloss.linear_head_loss(hidden, weight, y, spec, selected_ids=ids, temperature=temperature)
        logits = hidden.double() @ weight.double().T
    want = _oracle(logits, ids, y != -100, temperature=temperature)
    torch.testing.assert_close(out.selected_logprobs.double().reshape(want.shape), want, rtol=1e-4, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", "lm_head"])
def test_packed_rows_equal_the_padded_call(entry):
    """Rows packed by cu_seqlens (selected ids [N, K] and [1, N, K]) against the padded [S, T] call, shifted
    within each sequence: the values and the gradient of their weighted sum."""
    lengths = [4, 6, 3]
    n, s, tmax, k = sum(lengths), len(lengths), max(lengths), 5
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
    pos = torch.cat([torch.arange(length) for length in lengths])
    gen = generator(21)
    width = V if entry == "logits" else H
    rows = torch.randn(n, width, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    y = torch.randint(0, V, (n,), generator=gen)
    ids = torch.randint(-1, V, (n, k), generator=gen)
    g = torch.randn(n, k, generator=gen)
    spec = LossSpec(outputs=("selected_logprobs",), differentiable_outputs=True)
    padded = torch.zeros(s, tmax, width)
    padded[seq, pos] = rows
    padded_y = torch.full((s, tmax), -100)
    padded_y[seq, pos] = y
    padded_ids = torch.full((s, tmax, k), -1)
    padded_ids[seq, pos] = ids
    padded_g = torch.zeros(s, tmax, k)
    padded_g[seq, pos] = g

    def call(r, targets, selected, grad_out, **kw):
        leaf = r.clone().requires_grad_()
        if entry == "logits":
            out = headloss.head_loss(leaf, targets, spec, shift=True, selected_ids=selected, **kw)
        else:
            out = headloss.linear_head_loss(leaf, weight, targets, spec, shift=True, selected_ids=selected,
                                            chunk_bytes=4 * V * 4, **kw)
        (out.selected_logprobs * grad_out).sum().backward()
        return out.selected_logprobs.detach(), leaf.grad

    want, want_grad = call(padded, padded_y, padded_ids, padded_g)
    for packed_ids in (ids, ids[None]):
        got, got_grad = call(rows, y, packed_ids, g.view(packed_ids.shape), cu_seqlens=cu)
        torch.testing.assert_close(got.reshape(n, k), want[seq, pos], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grad, want_grad[seq, pos], rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_selected_ids_are_refused_naming_the_argument(backend):
    z, y, ids, _ = _batch(seed=5, b=2, t=3, k=4)
    spec = LossSpec(outputs=("selected_logprobs",))
    x = z.float()
    bad = ids.clone()
    bad[1, 2, 3] = V
    with pytest.raises(ValueError, match=r"selected_ids: the id( 37)? at position \(1, 2\), entry 3 is outside "
                                         r"\[0, 37\)"):
        headloss.head_loss(x, y, spec, selected_ids=bad, backend=backend, validate="sync")
    bad[1, 2, 3] = -2
    with pytest.raises(ValueError, match=r"selected_ids: .* is outside \[0, 37\) \(-1 marks no entry\)"):
        headloss.head_loss(x, y, spec, selected_ids=bad, backend=backend)
        headloss.check_pending(wait=True)
    with pytest.raises(ValueError, match=r"selected_ids: 65 ids per row; at most 64"):
        headloss.head_loss(x, y, spec, selected_ids=torch.zeros(2, 3, 65, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match=r"selected_ids: shape \(2, 4, 4\) is not \(2, 3, 'K'\)"):
        headloss.head_loss(x, y, spec, selected_ids=torch.zeros(2, 4, 4, dtype=torch.long), backend=backend)
    with pytest.raises(TypeError, match=r"selected_ids: expected an int64 or int32 tensor, got torch.float32"):
        headloss.head_loss(x, y, spec, selected_ids=ids.float(), backend=backend)
    with pytest.raises(ValueError, match=r"selected_ids: required by outputs: selected_logprobs but not given"):
        headloss.head_loss(x, y, spec, backend=backend)
    with pytest.raises(ValueError, match=r"selected_ids: given, but the spec's outputs do not list"):
        headloss.head_loss(x, y, LossSpec(), selected_ids=ids, backend=backend)
    hidden, weight = torch.randn(2, 3, H), torch.randn(V, H)
    bad[1, 2, 3] = V + 3
    with pytest.raises(ValueError, match=r"selected_ids: the id.* entry 3 is outside \[0, 37\)"):
        headloss.linear_head_loss(hidden, weight, y, spec, selected_ids=bad, backend=backend, validate="sync")


@needs_kernel
def test_an_unchecked_bad_id_gives_nan_in_its_entry_only():
    """validate=False: an id outside [0, V) reads nothing out of bounds; its entry is NaN, the others exact."""
    z, y, ids, _ = _batch(seed=8, b=1, t=3, k=4)
    ids[0, 2, 2] = V + 100
    spec = LossSpec(outputs=("selected_logprobs",))
    for backend in ("triton", "torch"):
        out = headloss.head_loss(z.float(), y, spec, selected_ids=ids, backend=backend, validate=False)
        values = out.selected_logprobs
        assert values[0, 2, 2].isnan()
        keep = torch.ones_like(values, dtype=torch.bool)
        keep[0, 2, 2] = False
        want = _oracle(z, ids.clamp(max=V - 1), y != -100).reshape(values.shape)
        torch.testing.assert_close(values[keep].double(), want[keep], rtol=1e-4, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", pytest.param("lm_head", marks=pytest.mark.slow)])
def test_compiled_call_equals_eager(entry):
    """torch.compile (fullgraph, aot_eager) with the selected ids a graph input: the values and the gradient of
    their weighted sum equal eager's."""
    gen = generator(31)
    y = torch.randint(0, V, (2, 5), generator=gen)
    ids = torch.randint(-1, V, (2, 5, 3), generator=gen)
    g = torch.randn(2, 5, 3, generator=gen)
    spec = LossSpec(outputs=("selected_logprobs",), differentiable_outputs=True)
    weight = torch.randn(V, H, generator=gen)
    rows = torch.randn(2, 5, V if entry == "logits" else H, generator=gen)

    def call(r, y, selected):
        if entry == "logits":
            out = headloss.head_loss(r, y, spec, selected_ids=selected)
        else:
            out = headloss.linear_head_loss(r, weight, y, spec, selected_ids=selected, chunk_bytes=4 * V * 4)
        return out.loss + (out.selected_logprobs * g).sum(), out.selected_logprobs

    eager = rows.clone().requires_grad_()
    want, want_values = call(eager, y, ids)
    want.backward()
    compiled = rows.clone().requires_grad_()
    got, got_values = torch.compile(call, backend="aot_eager", fullgraph=True)(compiled, y, ids)
    got.backward()
    torch.testing.assert_close(got_values, want_values)
    torch.testing.assert_close(compiled.grad, eager.grad)


def test_explain_names_the_selected_ids(tmp_path, capsys):
    text = explained_and_demoed(tmp_path, capsys, "outputs: [selected_logprobs]\ndifferentiable_outputs: true\n")
    assert "selected_ids" in text and "selected    log p of the call's selected_ids" in text
    assert "+ K logits per row at the selected ids" in text


@needs_kernel
@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 9), vocab=st.integers(2, 700), k=st.integers(1, 64), seed=st.integers(0, 2**16),
       softcap=st.sampled_from([None, 3.0]), deferred=st.booleans())
def test_any_shape_and_k_match_the_oracle(rows, vocab, k, seed, softcap, deferred):
    """Hypothesis over rows, V (under and over a block), K and the spec: values, and with differentiable
    outputs the gradient of a weighted sum, against fp64."""
    gen = generator(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, vocab, (rows,), generator=gen)
    y[torch.rand(rows, generator=gen) < 0.2] = -100
    ids = torch.randint(-1, vocab, (rows, k), generator=gen)
    g = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    transform = {} if softcap is None else {"softcap": softcap}
    spec = LossSpec(cross_entropy=None, outputs=("selected_logprobs",), differentiable_outputs=deferred,
                    transform=transform)
    leaf = z.float().requires_grad_()
    out = headloss.head_loss(leaf, y, spec, selected_ids=ids)
    ref = z.clone().requires_grad_()
    want = _oracle(ref, ids, y != -100, **transform)
    torch.testing.assert_close(out.selected_logprobs.double(), want.detach(), rtol=1e-4, atol=3e-5)
    if deferred:
        (out.selected_logprobs * g.float()).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-4, atol=3e-5)


@needs_kernel
@pytest.mark.parametrize("policy", [{"importance_sampling": "sequence"}, {"objective": "kl_cov", "cov_ratio": 0.2},
                                    {"top_entropy_quantile": 0.5}], ids=["sequences", "covariance", "entropy-guess"])
def test_the_lm_heads_policy_routes_give_the_selected_logprobs(policy):
    """The lm_head's routes beyond plain rows (sequence chunks with their gradient in forward; the corrected
    routes, which run the base plan) score the selected ids as the plain-torch path does, the loss's gradient
    unchanged by them."""
    gen = generator(41)
    b, t = 3, 6
    hidden, weight = torch.randn(b, t, H, generator=gen), torch.randn(V, H, generator=gen)
    y = torch.randint(0, V, (b, t), generator=gen)
    ids = torch.randint(-1, V, (b, t, 4), generator=gen)
    adv = torch.randn(b, generator=gen)
    spec = LossSpec(cross_entropy=None, policy=policy, outputs=("selected_logprobs",))
    outs = {}
    for backend in ("triton", "torch"):
        h = hidden.clone().requires_grad_()
        out = headloss.linear_head_loss(h, weight, y, spec, selected_ids=ids, advantages=adv, backend=backend)
        out.loss.backward()
        outs[backend] = (out, h.grad)
    (got, got_grad), (want, want_grad) = outs["triton"], outs["torch"]
    assert got.route.startswith("lm_head:") and got.selected_logprobs is not None
    torch.testing.assert_close(got.selected_logprobs, want.selected_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


@needs_kernel
@pytest.mark.slow
def test_a_compiled_call_recompiles_for_another_k():
    """fullgraph: a second K is a new graph (K a constant of the plan), not a failed trace."""
    spec = LossSpec(outputs=("selected_logprobs",), differentiable_outputs=True)
    gen = generator(43)
    z, y = torch.randn(2, 5, V, generator=gen), torch.randint(0, V, (2, 5), generator=gen)

    def step(z, y, ids):
        out = headloss.head_loss(z, y, spec, selected_ids=ids)
        return out.loss + out.selected_logprobs.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for k in (3, 5):
        ids = torch.randint(-1, V, (2, 5, k), generator=gen)
        torch.testing.assert_close(compiled(z, y, ids), step(z, y, ids))


@needs_kernel
def test_an_unchecked_bad_id_takes_no_gradient_on_either_path():
    """validate=False: the NaN entry's upstream gradient goes nowhere (the row's gradient still sums to 0), as
    on the plain-torch path."""
    z, y, ids, _ = _batch(seed=8, b=1, t=3, k=4)
    ids[0, 2, 2] = V + 100
    spec = LossSpec(cross_entropy=None, outputs=("selected_logprobs",), differentiable_outputs=True)
    grads = []
    for backend in ("triton", "torch"):
        leaf = z.float().requires_grad_()
        out = headloss.head_loss(leaf, y, spec, selected_ids=ids, backend=backend, validate=False)
        torch.nan_to_num(out.selected_logprobs, nan=0.0).sum().backward()
        grads.append(leaf.grad)
    assert abs(float(grads[0][0, 2].sum())) < 1e-5
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("given", "error"), [
    ([[1, 2]], r"selected_ids: expected an int64 or int32 tensor, got list"),
    (torch.tensor(3), r"selected_ids: shape \(\) holds no ids"),
    (torch.zeros(2, 3, 0, dtype=torch.long), r"selected_ids: shape \(2, 3, 0\) holds no ids"),
])
def test_selected_ids_that_are_no_ids_are_named(given, error):
    spec = LossSpec(outputs=("selected_logprobs",))
    with pytest.raises((TypeError, ValueError), match=error):
        headloss.head_loss(torch.randn(2, 3, V), torch.zeros(2, 3, dtype=torch.long), spec, selected_ids=given,
                           backend="torch")


@needs_kernel
@pytest.mark.parametrize(("backend", "teacher", "softcap"), tiered(
    ["triton", "torch"], ["none", "dense", "topk", "topk-rest"], [None, 4.0], pairs=False))
def test_the_selected_ids_share_of_the_gradient_is_the_same_beside_every_teacher(backend, teacher, softcap,
                                                                                   monkeypatch):
    """The gradient with the selected ids' term minus the same call's without it is the fp64 gradient of
    sum g log p(ids), beside no teacher, a dense one and a top-k one: blocks of 16 (three a row; the gradient
    pass meets the ids walking the row down, or up beside a dense teacher), ids on the target's column and on
    the teacher's ids (columns rewritten whole after the pass), an id twice in a row, at the first and last
    columns, and -1; a row whose list is full and whose largest id is a teacher's (the binary search's last
    step)."""
    from headloss.kernels.launch import LAUNCH_OVERRIDES

    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 16)
    b, t, k = 2, 4, 8
    z, y, ids, g = _batch(seed=12, b=b, t=t, k=k)
    gen = generator(13)
    teacher_ids = torch.stack([torch.randperm(V, generator=gen)[:5] for _ in range(b * t)]).reshape(b, t, 5)
    teacher_ids[1, 0, 4] = -1
    ids[0, 0, 2] = y[0, 0]
    top = int(teacher_ids[0, 2].max())
    ids[0, 2] = torch.randint(0, top + 1, (k,), generator=gen)
    ids[0, 2, :4] = torch.cat([teacher_ids[0, 2, :3], torch.tensor([top])])
    ids[1, 1, 6] = ids[1, 1, 7] = teacher_ids[1, 1, 0]
    ids[1, 2, 3], ids[1, 2, 4], ids[1, 2, 5] = 0, V - 1, -1
    ids[1, 3, 1] = y[1, 3]
    extra, distill = {}, None
    if teacher == "dense":
        extra["teacher_logits"] = torch.randn(b, t, V, generator=gen, dtype=torch.float64).float() * 2
        distill = {"divergence": "forward_kl"}
    elif teacher != "none":
        extra["teacher_ids"] = teacher_ids
        extra["teacher_logprobs"] = (torch.log_softmax(torch.randn(b, t, 5, generator=gen), -1) - 0.3).masked_fill(
            teacher_ids == -1, float("-inf"))
        distill = {"teacher": "topk", "topk": "rest" if teacher == "topk-rest" else "renormalized"}
    transform = {"temperature": 0.7} if softcap is None else {"softcap": softcap, "logit_scale": 1.3}
    spec = LossSpec(distillation=distill, transform=transform, outputs=("logprobs", "selected_logprobs"),
                    differentiable_outputs=True)
    without = spec.model_copy(update={"outputs": ("logprobs",)})
    grads = []
    for with_ids in (True, False):
        leaf = z.float().requires_grad_()
        out = headloss.head_loss(leaf, y, spec if with_ids else without, backend=backend,
                                 **({"selected_ids": ids} if with_ids else {}), **extra)
        total = out.loss + out.logprobs.sum()
        if with_ids:
            total = total + (out.selected_logprobs * g.float()).sum()
        total.backward()
        grads.append(leaf.grad.double())
    z64 = z.float().double().requires_grad_()
    (_oracle(z64, ids, y != -100, **transform) * g.reshape(-1, k)).sum().backward()
    torch.testing.assert_close(grads[0] - grads[1], z64.grad, rtol=1e-4, atol=2e-5)
