"""Distillation term: an independent fp64 oracle for the divergences, the Triton kernel (under
TRITON_INTERPRET=1 on CPU) against the fp64 reference, input errors and spec validation.

Conventions checked (issue + TRL's generalized_jsd_loss): p = student softmax, q = teacher softmax,
both at the distillation temperature T; forward KL = KL(q || p), reverse KL = KL(p || q),
jsd = beta KL(q || M) + (1 - beta) KL(p || M) with M = beta q + (1 - beta) p, and jsd at beta 0 / 1
is the forward / reverse KL (TRL's convention).
"""

import math

import pytest
import torch
import yaml
from conftest import (
    DTYPE_IDS,
    DTYPES,
    Pair,
    assert_close_norm,
    assert_matches_reference,
    assert_nontrivial,
    default_objective,
    fast_log1p_error,
    generator,
    make_logits,
    make_targets,
    needs_kernel,
    seed_of,
    tiered,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from headloss import CrossEntropy, Entropy, HeadLoss, LogitTransform, LossSpec, ZLoss, head_loss
from headloss.kernels.launch import LAUNCH_OVERRIDES
from headloss.reference import reference_head_loss, transformed_logits
from headloss.spec import Distillation

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
HYPOTHESIS = settings(
    max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- helpers ----------------------------------------------------------------------------------


def make_teacher(student: torch.Tensor, dtype: torch.dtype, seed: int, scale: float = 2.0) -> torch.Tensor:
    """A teacher correlated with the student (so top-1 agreement is neither 0 nor 1), in ``dtype``."""
    noise = torch.randn(student.shape, generator=generator(seed + 31337), dtype=torch.float64) * scale
    return (0.8 * student.detach().double() + noise).to(dtype)


def run_distill(
    leaf: torch.Tensor,
    targets: torch.Tensor | None,
    teacher: torch.Tensor,
    spec: LossSpec,
    *,
    view=lambda t: t,
    num_items_in_batch=None,
    inplace_grad: bool = False,
) -> Pair:
    """head_loss(view(leaf), teacher_logits=teacher, backend="triton") and the reference on the
    fp64 upcast student and teacher; both backpropagated through conftest's default objective."""
    dtype = leaf.dtype
    leaf64 = leaf.detach().double().requires_grad_()
    kleaf = leaf.detach().clone().requires_grad_()
    view_in = view(kleaf)
    vocab = view_in.shape[-1]
    x64 = transformed_logits(view(leaf64.detach()), spec, torch.float64).reshape(-1, vocab)
    objective = default_objective(spec, view_in.shape[:-1])
    out = head_loss(
        view_in, targets, spec, teacher_logits=teacher, num_items_in_batch=num_items_in_batch,
        inplace_grad=inplace_grad, backend="triton",
    )
    ref = reference_head_loss(
        view(leaf64), targets, spec, teacher_logits=teacher.double(), num_items_in_batch=num_items_in_batch
    )
    objective(out).backward()
    objective(ref).backward()
    return Pair(spec, out, ref, kleaf.grad, leaf64.grad, kleaf, x64, dtype)


def distill_spec(divergence="forward_kl", *, beta=0.3, temperature=1.0, scaled=False, weight=1.3, **fields) -> LossSpec:
    dist = Distillation(
        divergence=divergence, beta=beta, temperature=temperature, scale_by_temperature_squared=scaled, weight=weight
    )
    return LossSpec(distillation=dist, **fields)


# --- the independent oracle: explicit sums over the vocabulary, python floats ----------------


def _softmax(row: list[float], temperature: float) -> list[float]:
    scaled = [v / temperature for v in row]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def _kl(a: list[float], b: list[float]) -> float:
    """KL(a || b) = sum a log(a / b), with 0 log 0 = 0."""
    return sum(ai * (math.log(ai) - math.log(bi)) for ai, bi in zip(a, b) if ai > 0.0)


def oracle_divergence(student: list[float], teacher: list[float], divergence: str, beta: float, temperature: float):
    p, q = _softmax(student, temperature), _softmax(teacher, temperature)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        return _kl(q, p)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        return _kl(p, q)
    mix = [beta * qi + (1.0 - beta) * pi for pi, qi in zip(p, q)]
    return beta * _kl(q, mix) + (1.0 - beta) * _kl(p, mix)


def oracle_teacher_entropy(teacher: list[float], temperature: float) -> float:
    q = _softmax(teacher, temperature)
    return -sum(qi * math.log(qi) for qi in q if qi > 0.0)


def _argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda i: (row[i], -i))


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().double().reshape(-1, t.shape[-1]).tolist()


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.5)])
def test_reference_divergence_and_metrics_equal_explicit_sum_oracle(divergence, beta, temperature):
    student = make_logits((5, 11), torch.float64, seed=seed_of(divergence, beta, temperature))
    teacher = make_teacher(student, torch.float64, seed=3)
    targets = torch.tensor([1, -100, 4, 0, 10])
    spec = distill_spec(divergence, beta=beta, temperature=temperature, scaled=True, weight=0.7, cross_entropy=None,
                        reduction="none")
    ref = reference_head_loss(student, targets, spec, teacher_logits=teacher)
    rows_s, rows_t = _rows(student), _rows(teacher)
    valid = [i for i, y in enumerate(targets.tolist()) if y != -100]
    div = [oracle_divergence(s, t, divergence, beta, temperature) for s, t in zip(rows_s, rows_t)]
    want_loss = [0.7 * temperature**2 * div[i] if i in valid else 0.0 for i in range(5)]
    assert ref.loss.tolist() == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    mean = lambda values: sum(values[i] for i in valid) / len(valid)  # noqa: E731
    assert float(ref.metrics["distill/divergence"]) == pytest.approx(mean(div), rel=1e-12)
    ent = [oracle_teacher_entropy(t, temperature) for t in rows_t]
    assert float(ref.metrics["distill/teacher_entropy"]) == pytest.approx(mean(ent), rel=1e-12)
    agree = [float(_argmax(s) == _argmax(t)) for s, t in zip(rows_s, rows_t)]
    assert float(ref.metrics["distill/top1_agreement"]) == pytest.approx(mean(agree), abs=1e-12)
    assert min(div) > 0


def test_reference_distills_the_transformed_student_and_the_raw_teacher():
    """softcap / logit_scale / transform temperature apply to the student only; T_d to both."""
    student = make_logits((4, 9), torch.float64, seed=11, scale=4.0)
    teacher = make_teacher(student, torch.float64, seed=12)
    spec = distill_spec("reverse_kl", temperature=1.7, cross_entropy=None, reduction="none",
                        transform=LogitTransform(logit_scale=1.3, softcap=3.0, temperature=0.8))
    ref = reference_head_loss(student, None, spec, teacher_logits=teacher)
    transformed = [[3.0 * math.tanh(1.3 * z / 3.0) / 0.8 for z in row] for row in _rows(student)]
    want = [1.3 * oracle_divergence(s, t, "reverse_kl", 0.0, 1.7) for s, t in zip(transformed, _rows(teacher))]
    assert ref.loss.tolist() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_jsd_at_beta_0_and_1_equals_forward_and_reverse_kl(backend):
    student = make_logits((2, 3, 23), torch.float32, seed=5)
    teacher = make_teacher(student, torch.float32, seed=6)
    targets = make_targets((2, 3), 23, seed=5, ignore_frac=0.3)

    def divergence(name, beta):
        spec = distill_spec(name, beta=beta, temperature=2.5, weight=1.0, cross_entropy=None, reduction="none")
        return head_loss(student, targets, spec, teacher_logits=teacher, backend=backend).loss

    forward, reverse = divergence("forward_kl", 0.5), divergence("reverse_kl", 0.5)
    assert torch.equal(divergence("jsd", 0.0), forward)
    assert torch.equal(divergence("jsd", 1.0), reverse)
    assert not torch.allclose(forward, reverse)
    # the oracle, for the KLs' direction (TRL: beta 0 -> KL(teacher || student))
    rows_s, rows_t = _rows(student), _rows(teacher)
    for i, y in enumerate(targets.reshape(-1).tolist()):
        if y == -100:
            continue
        assert float(forward.reshape(-1)[i]) == pytest.approx(_kl(_softmax(rows_t[i], 2.5), _softmax(rows_s[i], 2.5)),
                                                              rel=1e-5, abs=1e-6)
        assert float(reverse.reshape(-1)[i]) == pytest.approx(_kl(_softmax(rows_s[i], 2.5), _softmax(rows_t[i], 2.5)),
                                                              rel=1e-5, abs=1e-6)


def test_jsd_is_symmetric_at_half_and_bounded_by_the_binary_entropy_of_beta():
    student = make_logits((6, 17), torch.float64, seed=21, scale=5.0)
    teacher = make_logits((6, 17), torch.float64, seed=22, scale=5.0)

    def jsd(s, t, beta):
        spec = distill_spec("jsd", beta=beta, weight=1.0, cross_entropy=None, reduction="none")
        return reference_head_loss(s, None, spec, teacher_logits=t).loss

    half = jsd(student, teacher, 0.5)
    assert torch.allclose(half, jsd(teacher, student, 0.5), rtol=1e-12, atol=1e-15)
    assert bool((half > 0).all()) and bool((half <= math.log(2.0)).all())
    for beta in (0.1, 0.3, 0.9):
        bound = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        value = jsd(student, teacher, beta)
        assert bool((value >= 0).all()) and bool((value <= bound + 1e-12).all())
        # swapping the roles swaps beta
        assert torch.allclose(value, jsd(teacher, student, 1.0 - beta), rtol=1e-12, atol=1e-15)
    # identical distributions: every divergence is 0
    for name in DIVERGENCES:
        spec = distill_spec(name, cross_entropy=None, reduction="none")
        assert float(reference_head_loss(student, None, spec, teacher_logits=student).loss.abs().max()) < 1e-12


# --- kernel vs fp64 reference ------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("divergence, temperature, scaled, reduction", tiered(
    list(DIVERGENCES), [1.0, 2.5], [False, True], ["mean", "sum", "none"],
    ids=[list(DIVERGENCES), ["1.0", "2.5"], ["plain", "T2"], ["mean", "sum", "none"]]))
def test_kernel_matches_reference_per_divergence_temperature_scaling_reduction(divergence, temperature, scaled,
                                                                               reduction):
    seed = seed_of(divergence, temperature, scaled, reduction)
    student = make_logits((2, 3, 37), torch.float32, seed=seed)
    teacher = make_teacher(student, torch.float32, seed=seed)
    targets = make_targets((2, 3), 37, seed=seed, ignore_frac=0.3)
    spec = distill_spec(divergence, temperature=temperature, scaled=scaled, reduction=reduction,
                        cross_entropy=CrossEntropy(weight=0.4), z_loss=ZLoss(weight=1e-3), entropy=Entropy(weight=0.0))
    pair = run_distill(student, targets, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert {"distill/divergence", "distill/teacher_entropy", "distill/top1_agreement", "ce", "z_loss",
            "entropy"} <= set(pair.out.metrics)


@needs_kernel
@pytest.mark.parametrize("teacher_dtype", DTYPES, ids=[f"teacher_{i}" for i in DTYPE_IDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_matches_reference_for_student_and_teacher_dtypes(divergence, dtype, teacher_dtype):
    seed = seed_of(divergence, dtype, teacher_dtype)
    student = make_logits((2, 2, 41), dtype, seed=seed)
    teacher = make_teacher(student, teacher_dtype, seed=seed)
    targets = make_targets((2, 2), 41, seed=seed, ignore_frac=0.25)
    spec = distill_spec(divergence, beta=0.7, temperature=2.5, scaled=True,
                        cross_entropy=CrossEntropy(weight=0.5, label_smoothing=0.1), z_loss=ZLoss(weight=1e-3),
                        entropy=Entropy(weight=-0.05))
    pair = run_distill(student, targets, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@needs_kernel
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_matches_reference_across_several_vocab_blocks(divergence, monkeypatch):
    """BLOCK_V=16 and V=53: three full blocks and a masked tail, for the teacher's online softmax too."""
    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 16)  # (HEADLOSS_BLOCK_V is read at import)
    seed = seed_of("blocks", divergence)
    student = make_logits((3, 53), torch.float32, seed=seed)
    teacher = make_teacher(student, torch.bfloat16, seed=seed)
    # the teacher's and the student's maxima in different blocks (argmax across blocks)
    student[0, 50], teacher[0, 3] = 30.0, 30.0
    student[1, 20], teacher[1, 20] = 30.0, 30.0
    targets = torch.tensor([4, -100, 52])
    spec = distill_spec(divergence, temperature=2.5, cross_entropy=CrossEntropy(weight=0.3),
                        entropy=Entropy(weight=0.0), outputs=("predicted_tokens",))
    pair = run_distill(student, targets, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    # row 0 disagrees, row 1 (ignored) would agree, row 2 is random: agreement over rows 0 and 2
    assert float(pair.out.metrics["distill/top1_agreement"]) in (0.0, 0.5)


@needs_kernel
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_matches_reference_with_softcap_scale_and_temperature_on_the_student(divergence):
    seed = seed_of("softcap", divergence)
    student = make_logits((2, 3, 29), torch.float32, seed=seed, scale=5.0)
    teacher = make_teacher(student, torch.float16, seed=seed)
    targets = make_targets((2, 3), 29, seed=seed, ignore_frac=0.2)
    spec = distill_spec(divergence, temperature=1.6, scaled=True, z_loss=ZLoss(weight=1e-3),
                        transform=LogitTransform(logit_scale=1.4, softcap=4.0, temperature=0.7))
    pair = run_distill(student, targets, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)


@needs_kernel
@pytest.mark.parametrize("mode", ["fused", "deferred_outputs"])
def test_kernel_matches_reference_with_ignored_rows_and_every_output(mode):
    """ignore_index masks both the hard-label and the soft term, in both kernel modes."""
    student = make_logits((3, 4, 31), torch.float32, seed=41)
    teacher = make_teacher(student, torch.float32, seed=41)
    targets = make_targets((3, 4), 31, seed=41, ignore_frac=0.5)
    targets[2] = -100  # a fully ignored sequence
    spec = distill_spec("jsd", beta=0.4, temperature=2.0, entropy=Entropy(weight=0.1), token_accuracy=True,
                        outputs=("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"),
                        differentiable_outputs=mode == "deferred_outputs")
    pair = run_distill(student, targets, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    ignored = targets.reshape(-1) == -100
    assert int(pair.out.metrics["n_tokens"]) == int((~ignored).sum())
    assert bool((pair.out.token_loss.reshape(-1)[ignored] == 0).all())
    assert bool((pair.grad.reshape(-1, 31)[ignored] == 0).all())


@needs_kernel
def test_ignored_rows_contribute_nothing_to_the_distillation_term():
    """Changing the teacher at an ignored row changes nothing."""
    student = make_logits((4, 19), torch.float32, seed=51)
    teacher = make_teacher(student, torch.float32, seed=51)
    targets = torch.tensor([3, -100, 7, -100])
    spec = distill_spec("reverse_kl", temperature=2.5)
    other = teacher.clone()
    other[1] = -other[1] * 5
    other[3] = 0.0
    a = head_loss(student, targets, spec, teacher_logits=teacher, backend="triton")
    b = head_loss(student, targets, spec, teacher_logits=other, backend="triton")
    assert torch.equal(a.loss, b.loss)
    for name in a.metrics:
        assert torch.equal(a.metrics[name], b.metrics[name]), name


@needs_kernel
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_matches_reference_without_targets_every_row_counts(divergence):
    student = make_logits((5, 24), torch.float32, seed=seed_of("no targets", divergence))
    teacher = make_teacher(student, torch.float32, seed=61)
    spec = distill_spec(divergence, temperature=0.5, cross_entropy=None, entropy=Entropy(weight=0.0))
    pair = run_distill(student, None, teacher, spec)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert int(pair.out.metrics["n_tokens"]) == 5


@needs_kernel
def test_kernel_matches_reference_for_strided_student_and_teacher_views_and_num_items():
    """[B, T, V] views with row strides (logits[:, :-1]) for the student and a padded teacher."""
    student = make_logits((2, 4, 33), torch.bfloat16, seed=71)
    teacher_full = make_logits((2, 3, 40), torch.float16, seed=72)
    teacher = teacher_full[..., :33]
    assert not teacher.is_contiguous()
    targets = make_targets((2, 3), 33, seed=71, ignore_frac=0.2)
    spec = distill_spec("jsd", beta=0.6, temperature=2.5, scaled=True)
    pair = run_distill(student, targets, teacher, spec, view=lambda t: t[:, :-1], num_items_in_batch=11)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert bool((pair.grad[:, -1] == 0).all())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_teacher_receives_no_gradient(backend):
    student = make_logits((2, 3, 17), torch.float32, seed=81).requires_grad_()
    teacher = make_teacher(student, torch.float32, seed=81).requires_grad_()
    targets = make_targets((2, 3), 17, seed=81)
    for divergence in DIVERGENCES:
        spec = distill_spec(divergence, temperature=2.0, reduction="none" if divergence == "jsd" else "mean")
        out = head_loss(student, targets, spec, teacher_logits=teacher, backend=backend)
        out.loss.sum().backward()
        assert teacher.grad is None
        assert student.grad is not None and float(student.grad.norm()) > 0
        student.grad = None


@needs_kernel
@pytest.mark.parametrize("reduction", ["mean", "none"], ids=["fused", "deferred"])
def test_inplace_grad_with_a_teacher_overwrites_only_the_student(reduction):
    student = make_logits((3, 2, 45), torch.float32, seed=91)
    teacher = make_teacher(student, torch.bfloat16, seed=91)
    teacher_before = teacher.clone()
    targets = make_targets((3, 2), 45, seed=91, ignore_frac=0.3)
    spec = distill_spec("jsd", beta=0.25, temperature=2.5, scaled=True, reduction=reduction,
                        z_loss=ZLoss(weight=1e-3))
    pair = run_distill(student, targets, teacher, spec, inplace_grad=True)
    assert_matches_reference(pair)
    assert_nontrivial(pair)
    assert pair.grad.data_ptr() == pair.leaf.data_ptr()  # the logits now hold the gradient
    assert torch.equal(teacher, teacher_before)


@needs_kernel
def test_headloss_module_takes_teacher_logits_as_a_call_input():
    student = make_logits((4, 20), torch.float32, seed=101)
    teacher = make_teacher(student, torch.float32, seed=101)
    targets = make_targets((4,), 20, seed=101)
    spec = distill_spec("reverse_kl", temperature=2.0)
    module = HeadLoss(spec, backend="triton")
    got = module(student, targets, teacher_logits=teacher)
    want = reference_head_loss(student.double(), targets, spec, teacher_logits=teacher.double())
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-5)


@needs_kernel
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_gives_finite_divergence_over_a_masked_vocabulary(divergence):
    """-inf at the same columns of student and teacher (a shared masked vocabulary): those columns
    drop out; the result equals the fp64 reference on the remaining columns."""
    student = make_logits((3, 12), torch.float32, seed=111)
    teacher = make_teacher(student, torch.float32, seed=111)
    student[:, 9:] = float("-inf")
    teacher[:, 9:] = float("-inf")
    targets = torch.tensor([0, 8, -100])
    spec = distill_spec(divergence, temperature=2.0)
    kleaf = student.clone().requires_grad_()
    out = head_loss(kleaf, targets, spec, teacher_logits=teacher, backend="triton")
    out.loss.backward()
    kept = student[:, :9].double().requires_grad_()
    ref = reference_head_loss(kept, targets, spec, teacher_logits=teacher[:, :9].double())
    ref.loss.backward()
    assert_close_norm(out.loss, ref.loss, rtol=1e-5, atol=1e-6, name="loss")
    for name in ("distill/divergence", "distill/teacher_entropy", "distill/top1_agreement"):
        assert_close_norm(out.metrics[name], ref.metrics[name], rtol=1e-5, atol=1e-6, name=name)
    assert_close_norm(kleaf.grad[:, :9], kept.grad, rtol=1e-5, atol=1e-7, name="grad")
    assert bool((kleaf.grad[:, 9:] == 0).all())


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_reference_gives_finite_divergence_over_a_masked_vocabulary(divergence):
    """Regression: F.kl_div(log_target=True) gave exp(-inf) * (-inf - -inf) = NaN at masked columns."""
    student = make_logits((3, 12), torch.float64, seed=111)
    teacher = make_teacher(student, torch.float64, seed=111)
    student[:, 9:] = float("-inf")
    teacher[:, 9:] = float("-inf")
    spec = distill_spec(divergence, temperature=2.0, cross_entropy=None, reduction="none")
    got = reference_head_loss(student, None, spec, teacher_logits=teacher).loss
    want = [oracle_divergence(s[:9], t[:9], divergence, 0.3, 2.0) * 1.3 for s, t in zip(_rows(student),
                                                                                         _rows(teacher))]
    assert got.tolist() == pytest.approx(want, rel=1e-10)


@needs_kernel
@pytest.mark.xfail(reason="LIMITATION: divergence values carry ~1e-7 absolute fp32 error (the lse difference of "
                          "teacher and student), like an fp32 torch computation; below ~1e-6 (teacher within ~1e-3 "
                          "of the student) that is a large relative error. The gradient is unaffected.",
                   strict=True)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kernel_divergence_is_nonnegative_and_accurate_when_the_teacher_is_close_to_the_student(divergence):
    student = make_logits((16, 64), torch.float64, seed=0, scale=10.0)
    teacher = (student + 0.01 * torch.randn(student.shape, generator=generator(5), dtype=torch.float64)).float()
    student = student.float()
    spec = distill_spec(divergence, weight=1.0, cross_entropy=None, reduction="none")
    got = head_loss(student, None, spec, teacher_logits=teacher, backend="triton").loss.double()
    want = reference_head_loss(student.double(), None, spec, teacher_logits=teacher.double()).loss
    assert bool((want > 0).all())
    assert bool((got >= 0).all()), f"negative divergence {float(got.min()):.3e}"
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-10), f"max rel err {float(((got - want) / want).abs().max())}"


@needs_kernel
def test_kernel_jsd_stays_finite_when_a_tail_probability_is_denormal():
    """Regression: log2(beta q + (1 - beta) p) of a mixture that rounds to 0 while p > 0 (the smallest
    fp32 denormal, seen under the interpreter) gave an inf JSD and a -inf/NaN gradient."""
    student = torch.tensor([[0.0, -103.3]]).requires_grad_()
    teacher = torch.tensor([[0.0, -200.0]])
    spec = distill_spec("jsd", beta=0.5, weight=1.0, cross_entropy=None, reduction="none")
    out = head_loss(student, None, spec, teacher_logits=teacher, backend="triton")
    out.loss.sum().backward()
    want = reference_head_loss(student.detach().double(), None, spec, teacher_logits=teacher.double()).loss
    assert bool(torch.isfinite(out.loss).all()) and bool(torch.isfinite(student.grad).all())
    assert float(out.loss.detach()) == pytest.approx(float(want), abs=1e-30)


# --- errors -----------------------------------------------------------------------------------


def _student_and_targets():
    return make_logits((2, 3, 11), torch.float32, seed=0), make_targets((2, 3), 11, seed=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_missing_teacher_logits_is_an_error_naming_it(backend):
    student, targets = _student_and_targets()
    with pytest.raises(ValueError, match="teacher_logits.*required"):
        head_loss(student, targets, distill_spec(), backend=backend)


@pytest.mark.parametrize("shape", [(2, 3, 12), (2, 4, 11), (6, 11), (3, 2, 11)])
def test_teacher_shape_mismatch_is_an_error_naming_it(shape):
    student, targets = _student_and_targets()
    with pytest.raises(ValueError, match="teacher_logits: shape"):
        head_loss(student, targets, distill_spec(), teacher_logits=torch.zeros(shape), backend="torch")


def test_teacher_without_a_distillation_term_is_an_error_naming_it():
    student, targets = _student_and_targets()
    with pytest.raises(ValueError, match="teacher_logits: given, but the spec has no distillation"):
        head_loss(student, targets, LossSpec(), teacher_logits=student.clone(), backend="torch")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_teacher_is_a_type_error_naming_it(dtype):
    student, targets = _student_and_targets()
    with pytest.raises(TypeError, match="teacher_logits: expected a floating-point tensor"):
        head_loss(student, targets, distill_spec(), teacher_logits=torch.zeros(student.shape, dtype=dtype),
                  backend="torch")


def test_teacher_that_is_not_a_tensor_is_a_type_error_naming_it():
    student, targets = _student_and_targets()
    with pytest.raises(TypeError, match="teacher_logits"):
        head_loss(student, targets, distill_spec(), teacher_logits=student.tolist(), backend="torch")


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"beta": -0.1}, "beta"),
        ({"beta": 1.5}, "beta"),
        ({"weight": -0.5}, "weight"),
        ({"divergence": "tvd"}, "divergence"),
        ({"temperature": float("nan")}, "temperature"),
        ({"scale_by_temperature_square": True}, "scale_by_temperature_square"),
    ],
)
def test_invalid_distillation_field_is_a_validation_error_naming_it(fields, name):
    with pytest.raises(ValidationError, match=name):
        Distillation(**fields)
    with pytest.raises(ValidationError, match=f"distillation.{name}"):
        LossSpec.model_validate({"distillation": fields})


def test_distillation_spec_round_trips_through_yaml_and_json():
    spec = distill_spec("jsd", beta=0.2, temperature=2.5, scaled=True, weight=0.5)
    assert LossSpec.model_validate(spec.to_dict()) == spec
    assert LossSpec.model_validate(yaml.safe_load(spec.to_yaml())) == spec


# --- hypothesis: random specs mixing CE, z-loss, entropy and distillation -----------------------


@st.composite
def distill_cases(draw):
    ce = draw(st.none() | st.builds(CrossEntropy, weight=st.floats(0.0, 2.0),
                                     label_smoothing=st.just(0.0) | st.floats(0.01, 0.5)))
    z = draw(st.none() | st.builds(ZLoss, weight=st.floats(0.0, 0.05)))
    entropy = draw(st.none() | st.builds(Entropy, weight=st.just(0.0) | st.floats(-0.5, 0.5)))
    divergence = draw(st.sampled_from(DIVERGENCES))
    beta = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.05, 0.95))
    temperature = draw(st.sampled_from([1.0]) | st.floats(0.5, 3.0))
    dist = Distillation(divergence=divergence, beta=beta, temperature=temperature,
                        scale_by_temperature_squared=draw(st.booleans()), weight=draw(st.floats(0.05, 2.0)))
    transform = draw(st.sampled_from([
        LogitTransform(), LogitTransform(softcap=5.0), LogitTransform(temperature=0.7, logit_scale=1.2),
    ]))
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    spec = LossSpec(cross_entropy=ce, z_loss=z, entropy=entropy, distillation=dist, transform=transform,
                    reduction=reduction, token_accuracy=draw(st.booleans()))
    flat = draw(st.booleans())
    tokens = (draw(st.integers(1, 5)),) if flat else (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    vocab = draw(st.integers(2, 40))
    dtype, teacher_dtype = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(DTYPES))
    with_targets = spec.needs_targets or draw(st.booleans())
    ignore_frac = draw(st.sampled_from([0.0, 0.4]))
    return spec, tokens, vocab, dtype, teacher_dtype, with_targets, ignore_frac, draw(st.integers(0, 10_000))


@pytest.mark.slow
@needs_kernel
@HYPOTHESIS
@given(case=distill_cases())
def test_kernel_matches_reference_for_random_specs_mixing_ce_z_entropy_and_distillation(case):
    spec, tokens, vocab, dtype, teacher_dtype, with_targets, ignore_frac, seed = case
    student = make_logits((*tokens, vocab), dtype, seed=seed)
    teacher = make_teacher(student, teacher_dtype, seed=seed)
    targets = make_targets(tokens, vocab, seed=seed, ignore_frac=ignore_frac) if with_targets else None
    assert_matches_reference(run_distill(student, targets, teacher, spec))


@needs_kernel
def test_fast_log1p_matches_fp64_log1p():
    # under the interpreter fast_log2 is numpy's exact log2: the series and its switch at 1/16
    # (test_gpu.py runs the same check on lg2.approx)
    assert fast_log1p_error("cpu") < 1.5e-6  # the rounding of 1 + x above the switch
    assert fast_log1p_error("cpu", series_only=True) < 2.5e-7  # the series to x^6 (to x^5: ~3e-7)
