"""The student's top-k (``student_topk: k`` with ``outputs: [topk_ids, topk_logprobs]``), bounded in the stats
pass and read again where it can be: each row's k most likely ids under the spec's transform, largest first,
ties to the lower id, and their log-probs; with a top-k teacher verl's overlap diagnostics
(``distill/overlap_ratio``, ``distill/overlap_token_advantage``). Both entry points and both paths; packed rows
as any per-row output.

The oracles are written here in fp64 (a stable sort of the transformed logits; verl's formulas from
verl/trainer/distillation/fsdp/losses.py): they share nothing with headloss.reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import explained_and_demoed, generator, needs_kernel, tiered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headloss
from headloss import LossSpec

H = 12
TRANSFORMS = {"plain": {}, "softcap-temperature": {"logit_scale": 1.3, "softcap": 4.0, "temperature": 0.7}}


def _transformed(z: torch.Tensor, logit_scale=1.0, softcap=None, temperature=1.0) -> torch.Tensor:
    x = z.double().reshape(-1, z.shape[-1]) * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x / temperature


def _oracle(z: torch.Tensor, counted: torch.Tensor, k: int, **transform):
    """fp64 (ids, log-probs) [rows, k]: a stable descending sort (ties: the lower id first); -1 / 0 at rows
    not counted."""
    x = _transformed(z, **transform)
    logp = x - torch.logsumexp(x, -1, keepdim=True)
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    counted = counted.reshape(-1, 1)
    return torch.where(counted, order, -1), torch.where(counted, logp.gather(1, order), 0.0)


def _assert_topk(ids, logprobs, want_ids, want_logprobs, atol, rtol=0.0):
    """The log-probs within tolerance; the ids equal wherever the oracle's order is not a near-tie."""
    ids, logprobs = ids.reshape(want_ids.shape), logprobs.reshape(want_ids.shape).double()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=rtol, atol=atol)
    differ = ids != want_ids
    assert torch.allclose(logprobs[differ], want_logprobs[differ], rtol=rtol, atol=atol)  # (a near-tie swapped)


@needs_kernel
@pytest.mark.parametrize(("entry", "backend", "dtype", "transform", "k"), [  # (k 12 and 64: 1-3 s a case under
    case if case.values[-1] <= 8 else pytest.param(*case.values, id=case.id, marks=(*case.marks, pytest.mark.slow))
    for case in tiered(["logits", "lm_head"], ["triton", "torch"], [torch.float32, torch.bfloat16], list(TRANSFORMS),
                       [1, 5, 12, 64], pairs=False)])  # the interpreter, every block read again: slow; they
# compile in the fast tier's sm_90 check and run in the slow tier and on the GPU
def test_topk_ids_and_logprobs_match_an_fp64_oracle(entry, backend, dtype, transform, k):
    vocab = 300
    gen = generator(k + len(transform))
    y = torch.randint(0, vocab, (2, 5), generator=gen)
    y[0, 3] = -100
    spec = LossSpec(student_topk=k, outputs=("topk_ids", "topk_logprobs"), transform=TRANSFORMS[transform])
    if entry == "logits":
        z = (torch.randn(2, 5, vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
        out = headloss.head_loss(z, y, spec, backend=backend)
        logits64 = z.double()
    else:
        hidden = torch.randn(2, 5, H, generator=gen, dtype=torch.float64).to(dtype)
        weight = torch.randn(vocab, H, generator=gen, dtype=torch.float64).to(dtype)
        out = headloss.linear_head_loss(hidden, weight, y, spec, backend=backend, chunk_bytes=3 * vocab * 4)
        logits64 = hidden.double() @ weight.double().T
    want_ids, want_logprobs = _oracle(logits64, y != -100, k, **TRANSFORMS[transform])
    assert out.topk_ids.shape == (2, 5, k) and out.topk_ids.dtype == torch.int64
    assert (out.topk_ids[0, 3] == -1).all() and (out.topk_logprobs[0, 3] == 0).all()
    half = dtype == torch.bfloat16  # (the lm_head's logits: the GEMM's, rounded to bf16)
    _assert_topk(out.topk_ids, out.topk_logprobs, want_ids, want_logprobs, atol=3e-2 if half else 2e-5,
                 rtol=2e-2 if half else 0.0)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
"""Every edge case on fp32 and on both 16-bit dtypes (whose rounding makes many more equal logits)."""


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ties_go_to_the_lower_id_within_and_across_blocks(backend, dtype):
    """Equal logits at ids in different vocabulary blocks (V 5000, blocks of 2048) and in one block, and a
    masked (-inf) vocabulary: the lower id first, exactly."""
    vocab = 5000
    z = torch.randn(3, vocab, generator=generator(3)).to(dtype)
    top = float(z.max()) + 1.0
    z[0, [4500, 100, 2100]] = top  # three blocks
    z[1, [7, 9, 8]] = top
    z[2, :] = float("-inf")
    z[2, [4999, 3, 2048]] = 0.5
    z[1, 11], z[1, 10] = -0.0, 0.0  # (equal: a tie)
    out = headloss.head_loss(z, None, LossSpec(cross_entropy=None, student_topk=4, outputs=("topk_ids",)),
                             backend=backend)
    assert out.topk_ids[0, :3].tolist() == [100, 2100, 4500]
    assert out.topk_ids[1, :3].tolist() == [7, 8, 9]
    assert out.topk_ids[2, :3].tolist() == [3, 2048, 4999]
    want, _ = _oracle(z, torch.ones(3, dtype=torch.bool), 4)
    assert torch.equal(out.topk_ids, want)


@needs_kernel
@pytest.mark.parametrize("entry", ["logits", pytest.param("lm_head", marks=pytest.mark.slow)])
def test_asking_for_the_topk_changes_neither_the_loss_nor_its_gradient(entry):
    gen = generator(9)
    vocab = 300
    y = torch.randint(0, vocab, (3, 4), generator=gen)
    y[1, 2] = -100
    rows = torch.randn(3, 4, vocab if entry == "logits" else H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen)
    base = LossSpec(entropy={"weight": 0.1}, token_accuracy=True)

    def call(spec):
        leaf = rows.clone().requires_grad_()
        if entry == "logits":
            out = headloss.head_loss(leaf, y, spec)
        else:
            out = headloss.linear_head_loss(leaf, weight, y, spec, chunk_bytes=4 * vocab * 4)
        out.loss.backward()
        return out, leaf.grad

    plain, g_plain = call(base)
    got, g_got = call(base.model_copy(update={"student_topk": 8, "outputs": ("topk_ids", "topk_logprobs")}))
    torch.testing.assert_close(got.loss, plain.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_got, g_plain, rtol=1e-6, atol=1e-9)
    assert list(got.metrics) == list(plain.metrics) and not got.topk_logprobs.requires_grad
    want_ids, _ = _oracle(rows if entry == "logits" else rows.double() @ weight.double().T, y != -100, 8)
    assert torch.equal(got.topk_ids.reshape(want_ids.shape), want_ids)


@needs_kernel
@pytest.mark.parametrize(("k", "dtype"), [(1, torch.float32), pytest.param(2, torch.bfloat16, marks=pytest.mark.slow),
                                          pytest.param(8, torch.float32, marks=pytest.mark.slow),
                                          pytest.param(8, torch.bfloat16, marks=pytest.mark.slow),
                                          pytest.param(5, torch.float16, marks=pytest.mark.slow),
                                          pytest.param(9, torch.float32, marks=pytest.mark.slow)])
def test_rows_whose_top_k_shares_a_group_or_ties_are_exact(k, dtype):
    """Rows whose top logits sit in one group of lanes (columns 4096 apart: the same position of a 2048- or
    4096-wide block, in several blocks), an all -inf row, a row of equal logits, a tie of five in one group, a
    group holding 40 distinct top logits (more keys at least the bound than the row's buffer holds, no tie)
    and a row with +inf: the crossings of the bound's blocks and groups, or the running insertion where the
    buffer overflows (the equal row; the 40 from k 2) or the row holds +inf, give a stable sort's ids."""
    gen = generator(31 + k)
    vocab = 4 * 4096 + 77
    z = torch.randn(8, vocab, generator=gen) * 2
    for j, col in enumerate((5, 5 + 4096, 5 + 2 * 4096, 5 + 3 * 4096)):  # row 0: the top four in one group
        z[0, col] = 40.0 - j
    z[1, 3 * 4096 + 11] = 50.0  # row 1: one clear maximum late, then the rest
    z[1, 3 * 4096 + 11 + 4096] = 49.0  # (and its runner-up in the same group)
    z[2] = float("-inf")  # row 2: all -inf (ids by position)
    z[3] = 1.5  # row 3: all equal
    z[4, :: 4096] = 30.0  # row 4: one group holds a tie of five
    cols = (torch.arange(5)[:, None] * 4096 + torch.arange(8)[None, :]).flatten()
    z[5, cols[cols < vocab]] = 100.0 - 0.5 * torch.arange(40.0)  # row 5: 40 distinct top logits in group 0
    z[6, [17, 9000]] = float("inf")  # row 6: +inf twice
    z[6, 3] = 60.0
    z = z.to(dtype)  # (16-bit: many more equal logits, the rounding's)
    spec = LossSpec(student_topk=k, outputs=("topk_ids", "topk_logprobs"))
    y = torch.randint(0, vocab, (8,), generator=gen)
    out = headloss.head_loss(z, y, spec, backend="triton")
    want = torch.sort(z.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(out.topk_ids, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 8])
def test_logits_the_transform_makes_equal_go_to_the_lower_id(dtype, k):
    """Where the softcap makes different raw 16-bit logits one transformed value (tanh is 1.0 in fp32 from about
    9 on) the k ids are still the lowest of the tied, as a stable sort of the transformed logits gives them, the
    larger raw values sitting at the higher ids in every block."""
    gen = generator(61 + k)
    vocab = 3 * 2048 + 300
    z = torch.randn(4, vocab, generator=gen)
    for row in range(4):
        cols = torch.randperm(vocab, generator=gen)[:12].sort().values
        z[row, cols] = torch.linspace(20.0, 40.0, 12)  # raw order: the higher id larger
    z[3, 100] = 41.0  # (and one the others tie below in one lane's block)
    z = z.to(dtype)
    transform = {"softcap": 1.0}
    spec = LossSpec(student_topk=k, outputs=("topk_ids", "topk_logprobs"), transform=transform)
    got = headloss.head_loss(z, None, spec.model_copy(update={"cross_entropy": None}), backend="triton")
    x = torch.tanh(z.float())  # (the kernel's fp32 transform, whose ties the oracle's fp64 would not make)
    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(got.topk_ids, want)
    ref = headloss.head_loss(z, None, spec.model_copy(update={"cross_entropy": None}), backend="torch")
    assert torch.equal(ref.topk_ids, want)


def _verl_overlap(z, teacher_ids, teacher_logprobs, k, clamp):
    """verl's compute_forward_kl_topk diagnostics in fp64, per row: (how many of the teacher's ids are among
    the student's top-k, the mean of -q (log q - log p) over them, 0 where none is)."""
    x = z.double().reshape(-1, z.shape[-1])
    logp = x - torch.logsumexp(x, -1, keepdim=True)
    student = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    ids = teacher_ids.reshape(-1, teacher_ids.shape[-1])
    lq = teacher_logprobs.reshape(ids.shape).double()
    given = ids != -1
    lps = logp.gather(1, ids.clamp(min=0))
    if clamp is not None:
        lq, lps = lq.clamp_min(clamp), lps.clamp_min(clamp)
    overlap = given & (ids[:, :, None] == student[:, None, :]).any(-1)
    count = overlap.sum(-1)
    advantage = torch.where(overlap, -(lq.exp() * (lq - lps)), 0.0).sum(-1) / count.clamp_min(1)
    return count, advantage


@needs_kernel
@pytest.mark.parametrize(("entry", "backend", "clamp"), [
    case if (case[1], case[0], case[2]) == ("triton", "lm_head", None) or case[1] == "torch"
    else pytest.param(*case, marks=pytest.mark.slow)  # (the Triton path: the lm_head without a clamp in the fast
    # tier; the logits entry and the clamp on the torch path)
    for case in itertools.product(["logits", "lm_head"], ["triton", "torch"], [None, -6.0])])
def test_overlap_diagnostics_with_a_topk_teacher_equal_verls(entry, backend, clamp):
    """The metrics (means over counted tokens) and the per-token outputs overlap_count and
    overlap_token_advantage (0 at an ignored token) against verl's definitions in fp64."""
    gen = generator(17)
    vocab = 300
    y = torch.randint(0, vocab, (3, 5), generator=gen)
    y[2, 1] = -100
    hidden = torch.randn(3, 5, H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen) * 0.7
    z = torch.randn(3, 5, vocab, generator=gen) * 3 if entry == "logits" else hidden.double() @ weight.double().T
    top = torch.log_softmax(z.double() + torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64), -1).topk(
        8, dim=-1)
    teacher_ids, teacher_logprobs = top.indices.clone(), top.values.float()
    teacher_ids[0, 0, 6:] = -1
    spec = LossSpec(student_topk=6, distillation={"teacher": "topk", "log_prob_min_clamp": clamp},
                    outputs=("overlap_count", "overlap_token_advantage"))
    if entry == "logits":
        out = headloss.head_loss(z, y, spec, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs,
                                 backend=backend)
    else:
        out = headloss.linear_head_loss(hidden, weight, y, spec, teacher_ids=teacher_ids,
                                        teacher_logprobs=teacher_logprobs, backend=backend, chunk_bytes=4 * vocab * 4)
    count, advantage = _verl_overlap(z, teacher_ids, teacher_logprobs, 6, clamp)
    counted = y.reshape(-1) != -100
    ratio = (count[counted] / 6).mean()
    assert 0 < float(ratio) < 1
    assert float(out.metrics["distill/overlap_ratio"]) == pytest.approx(float(ratio), rel=1e-6)
    assert float(out.metrics["distill/overlap_token_advantage"]) == pytest.approx(
        float(advantage[counted].mean()), rel=1e-5, abs=1e-7)
    assert out.overlap_count.dtype == torch.int64 and out.overlap_count.shape == y.shape
    assert torch.equal(out.overlap_count.reshape(-1), torch.where(counted, count, 0))
    assert not out.overlap_token_advantage.requires_grad
    torch.testing.assert_close(out.overlap_token_advantage.reshape(-1).double(),
                               torch.where(counted, advantage, 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", [dict(outputs=("overlap_count",)),
                                  dict(student_topk=4, outputs=("overlap_token_advantage",)),
                                  dict(student_topk=4, outputs=("overlap_count",),
                                       distillation={"teacher": "logits"})])
def test_overlap_outputs_without_a_topk_teacher_and_student_topk_are_refused(spec):
    with pytest.raises(ValueError, match="outputs: overlap_"):
        LossSpec(**spec)


@needs_kernel
@pytest.mark.slow  # (packed rows with selected ids and outputs: test_selected's, in the fast tier)
@pytest.mark.parametrize("entry", ["logits", "lm_head"])
def test_packed_rows_equal_the_padded_call(entry):
    lengths = [4, 6, 3]
    n, s, tmax = sum(lengths), len(lengths), max(lengths)
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(s), torch.tensor(lengths))
    pos = torch.cat([torch.arange(length) for length in lengths])
    gen = generator(23)
    vocab = 300
    rows = torch.randn(n, vocab if entry == "logits" else H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen)
    y = torch.randint(0, vocab, (n,), generator=gen)
    padded = torch.zeros(s, tmax, rows.shape[-1])
    padded[seq, pos] = rows
    padded_y = torch.full((s, tmax), -100)
    padded_y[seq, pos] = y
    spec = LossSpec(student_topk=5, outputs=("topk_ids", "topk_logprobs"))

    def call(r, targets, **kw):
        if entry == "logits":
            return headloss.head_loss(r, targets, spec, shift=True, **kw)
        return headloss.linear_head_loss(r, weight, targets, spec, shift=True, chunk_bytes=4 * vocab * 4, **kw)

    want, got = call(padded, padded_y), call(rows, y, cu_seqlens=cu)
    assert torch.equal(got.topk_ids.reshape(n, 5), want.topk_ids[seq, pos])
    torch.testing.assert_close(got.topk_logprobs.reshape(n, 5), want.topk_logprobs[seq, pos])


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_topk_the_vocabulary_cannot_hold_is_refused(backend):
    spec = LossSpec(student_topk=9, outputs=("topk_ids",))
    with pytest.raises(ValueError, match=r"student_topk: 9 ids per row, but the vocabulary holds 8"):
        headloss.head_loss(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), spec, backend=backend)
    with pytest.raises(ValueError, match=r"student_topk: 9 ids per row, but the vocabulary holds 8"):
        headloss.linear_head_loss(torch.randn(2, 4), torch.randn(8, 4), torch.zeros(2, dtype=torch.long), spec,
                                  backend=backend)
    with pytest.raises(ValueError, match=r"outputs: topk_ids, topk_logprobs need student_topk"):
        LossSpec(outputs=("topk_ids", "topk_logprobs"))
    with pytest.raises(ValueError, match=r"student_topk"):
        LossSpec(student_topk=65)


@needs_kernel
@pytest.mark.slow  # (the selected ids' compiled logits call runs the same custom op in the fast tier)
def test_compiled_call_equals_eager():
    gen = generator(31)
    y = torch.randint(0, 50, (2, 5), generator=gen)
    rows = torch.randn(2, 5, 50, generator=gen)
    spec = LossSpec(student_topk=4, outputs=("topk_ids", "topk_logprobs"))

    def call(r, y):
        out = headloss.head_loss(r, y, spec)
        return out.loss, out.topk_ids, out.topk_logprobs

    want = call(rows, y)
    got = torch.compile(call, backend="aot_eager", fullgraph=True)(rows, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_explain_names_the_students_topk(tmp_path, capsys):
    text = explained_and_demoed(tmp_path, capsys, "student_topk: 8\noutputs: [topk_ids, topk_logprobs]\n")
    assert "STUDENT_TOPK=8" in text and "topk_logprobs" in text


@needs_kernel
@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 6), vocab=st.integers(1, 5000), k=st.integers(1, 64), seed=st.integers(0, 2**16),
       ties=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_any_shape_and_k_match_the_oracle(rows, vocab, k, seed, ties, dtype):
    """Hypothesis over rows, V (one block and several), k <= V, the logits' dtype and logits with many exact
    ties (rounded)."""
    k = min(k, vocab)
    z = torch.randn(rows, vocab, generator=generator(seed)) * 3
    if ties:
        z = z.round()
    z = z.to(dtype)
    out = headloss.head_loss(z, None, LossSpec(cross_entropy=None, student_topk=k,
                                               outputs=("topk_ids", "topk_logprobs")))
    want_ids, want_logprobs = _oracle(z, torch.ones(rows, dtype=torch.bool), k)
    assert torch.equal(out.topk_ids, want_ids)
    torch.testing.assert_close(out.topk_logprobs.double(), want_logprobs, rtol=0, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("policy", [
    {"importance_sampling": "sequence"},
    pytest.param({"objective": "kl_cov", "cov_ratio": 0.2}, marks=pytest.mark.slow),
    pytest.param({"top_entropy_quantile": 0.5}, marks=pytest.mark.slow),
    pytest.param({}, marks=pytest.mark.slow)], ids=["sequences", "covariance", "entropy-guess", "fused"])
def test_every_lm_head_route_gives_the_topk(policy):
    """The lm_head's routes (sequence chunks, the corrected routes' base plan, the fused epilogue) give the same
    top-k as the plain-torch path, and the same gradient as without it."""
    gen = generator(47)
    b, t, vocab = 3, 6, 37
    hidden, weight = torch.randn(b, t, H, generator=gen), torch.randn(vocab, H, generator=gen)
    y = torch.randint(0, vocab, (b, t), generator=gen)
    y[0, 2] = -100
    adv = torch.randn(b, generator=gen)
    spec = LossSpec(cross_entropy=None, policy=policy, student_topk=4, outputs=("topk_ids", "topk_logprobs"))
    outs = {}
    for backend in ("triton", "torch"):
        h = hidden.clone().requires_grad_()
        out = headloss.linear_head_loss(h, weight, y, spec, advantages=adv, backend=backend)
        out.loss.backward()
        outs[backend] = (out, h.grad)
    (got, got_grad), (want, want_grad) = outs["triton"], outs["torch"]
    assert got.route.startswith("lm_head:") and torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_nan_of_either_sign_ranks_first_on_both_paths(sign):
    """validate=False: a NaN logit (its sign bit set or not) is the largest, as torch's sort ranks it."""
    z = torch.randn(2, 300, generator=generator(53))
    z[1, 7] = sign * float("nan")
    spec = LossSpec(cross_entropy=None, student_topk=4, outputs=("topk_ids",))
    got = [headloss.head_loss(z, None, spec, backend=b, validate=False).topk_ids for b in ("triton", "torch")]
    assert got[0][1, 0] == 7 and torch.equal(got[0], got[1])


@needs_kernel
@pytest.mark.parametrize("k", [3, pytest.param(20, marks=pytest.mark.slow)])
def test_rows_of_hundreds_of_blocks_list_every_block_reaching_the_bound(monkeypatch, k):
    """Blocks of 256 (LAUNCH_OVERRIDES: 32 groups a block), 251 of them a row: the blocks reaching the bound,
    far down the row, are listed and their crossings read again, at k 3 in one step of 32 cells, at k 20 in
    many (each step's slots after the last's). A stable sort's ids on both paths."""
    from headloss.kernels.launch import LAUNCH_OVERRIDES

    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 256)
    gen = generator(97 + k)
    vocab = 251 * 256 - 41
    z = torch.randn(2, vocab, generator=gen)
    for j, block in enumerate((250, 70, 200, 130, 3)):  # row 0: the top five in blocks of every word
        z[0, block * 256 + 7 * j] = 9.0 - j
    z[1, [100 * 256 + 1, 199 * 256, 64 * 256]] = 7.0  # row 1: a tie in three words
    spec = LossSpec(cross_entropy=None, student_topk=k, outputs=("topk_ids",))
    want = torch.sort(z.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    for backend in ("triton", "torch"):
        assert torch.equal(headloss.head_loss(z, None, spec, backend=backend).topk_ids, want)


def test_the_bound_keeps_a_power_of_two_of_blocks_at_most_max_blocks():
    from headloss.kernels.topk import MAX_BLOCKS, bound_blocks

    assert [bound_blocks(v, 2048) for v in (1, 2048, 2049, 128256, 151936)] == [1, 1, 2, 64, 128]
    assert bound_blocks(MAX_BLOCKS * 2048 + 1, 2048) == MAX_BLOCKS == 256


@needs_kernel
@pytest.mark.parametrize("k", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_blocks_past_the_ones_the_bound_keeps_are_read_whole(monkeypatch, k):
    """A row of more blocks than the bound keeps a maximum for (kernels.topk.MAX_BLOCKS, 2 here) takes the
    running insertion over every block, wherever the top k lies; the same ids as a stable sort, on both
    paths."""
    import headloss.kernels.topk as topk

    monkeypatch.setattr(topk, "MAX_BLOCKS", 2)
    gen = generator(71 + k)
    vocab = 5 * 2048 + 77  # (six blocks of 2048: four past the two kept)
    z = torch.randn(3, vocab, generator=gen)
    z[0, [vocab - 1, 4 * 2048 + 5, 3 * 2048]] = 9.0  # row 0: the top three past the kept blocks, tied
    z[1, [1, 3 * 2048 + 1]] = 8.0  # row 1: one in a kept block, one past them
    spec = LossSpec(cross_entropy=None, student_topk=k, outputs=("topk_ids",))
    want = torch.sort(z.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    for backend in ("triton", "torch"):
        assert torch.equal(headloss.head_loss(z, None, spec, backend=backend).topk_ids, want)
