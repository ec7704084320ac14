"""Policy term (GRPO family): hand-computed cases that validate reference_policy_loss itself, the
Triton kernel (under TRITON_INTERPRET=1 on CPU) against the fp64 reference for every loss type,
importance-sampling level, KL estimator and option, and the input errors.

Hand formulas (TRL GRPOTrainer._compute_loss, verl compute_policy_loss / agg_loss):
ratio r = exp(logp - old) (sequence level: exp of the masked mean over the sequence),
per-token loss -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A), for A < 0 at most -A c
(dual clip), times the importance weight, plus beta * KL (k1 logp - ref, k2 (logp - ref)^2 / 2,
k3 exp(ref - logp) - (ref - logp) - 1, times r when IS-corrected); aggregated by loss_type.
"""

import math

import pytest
import torch
from conftest import (
    DTYPE_IDS,
    DTYPES,
    Pair,
    assert_matches_reference,
    assert_nontrivial,
    check_policy_objective,
    check_sequence_extremes,
    default_objective,
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

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss, head_loss
from headloss.kernels.launch import LAUNCH_OVERRIDES
from headloss.reference import reference_head_loss, transformed_logits
from headloss.spec import Distillation, Policy

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
              "seq-mean-token-sum-norm")
POLICY_METRICS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                  "clip_ratio/high_max", "ratio/mean", "ratio/min", "ratio/max", "logprob/mean", "entropy"}
HYPOTHESIS = settings(
    max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- helpers ----------------------------------------------------------------------------------


def policy_spec(loss_type="grpo", *, ce=None, max_completion_length=8, **fields) -> LossSpec:
    """A spec with only the policy term (plus whatever is passed in ``fields`` that is not a Policy field)."""
    policy_fields = {k: fields.pop(k) for k in list(fields) if k in Policy.model_fields}
    if loss_type == "dr_grpo":
        policy_fields.setdefault("max_completion_length", max_completion_length)
    return LossSpec(cross_entropy=ce, policy=Policy(loss_type=loss_type, **policy_fields), **fields)


def true_logprobs(logits: torch.Tensor, targets: torch.Tensor, spec: LossSpec) -> torch.Tensor:
    """fp64 log p(target) under the spec's transform (ignored positions: any value)."""
    x = transformed_logits(logits.detach().double(), spec, torch.float64)
    return torch.log_softmax(x, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]


def make_policy_inputs(
    logits, targets, spec, seed, *, per_token_adv=False, old=True, noise=0.3, ref=True, weights=False,
    loss_mask=None, sequence_ids=None,
) -> dict[str, torch.Tensor]:
    """fp32 per-call inputs; old = logp + noise so ratios straddle both clip bounds."""
    gen = generator(seed + 4242)
    shape = tuple(targets.shape)
    logp = true_logprobs(logits, targets, spec)
    randn = lambda: torch.randn(shape, generator=gen, dtype=torch.float64)  # noqa: E731
    adv_shape = shape if per_token_adv or len(shape) == 1 else shape[:1]
    advantages = torch.randn(adv_shape, generator=gen, dtype=torch.float64)
    inputs = {"advantages": advantages.float()}
    if old:
        inputs["old_logprobs"] = (logp + noise * randn()).float()
    if ref:
        inputs["ref_logprobs"] = (logp + 0.3 * randn()).float()
    if weights:
        inputs["importance_weights"] = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).float()
    if loss_mask is not None:
        inputs["loss_mask"] = loss_mask
    if sequence_ids is not None:
        inputs["sequence_ids"] = sequence_ids
    return inputs


def run_policy(leaf, targets, spec, inputs, *, view=lambda t: t, num_items_in_batch=None, teacher=None) -> Pair:
    """head_loss(view(leaf), **inputs, backend="triton") and the reference on fp64 logits and inputs,
    both backpropagated through conftest's default objective."""
    dtype = leaf.dtype
    leaf64 = leaf.detach().double().requires_grad_()
    kleaf = leaf.detach().clone().requires_grad_()
    view_in = view(kleaf)
    vocab = view_in.shape[-1]
    x64 = transformed_logits(view(leaf64.detach()), spec, torch.float64).reshape(-1, vocab)
    objective = default_objective(spec, view_in.shape[:-1])
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    out = head_loss(view_in, targets, spec, teacher_logits=teacher, num_items_in_batch=num_items_in_batch,
                    backend="triton", **inputs)
    ref = reference_head_loss(view(leaf64), targets, spec, num_items_in_batch=num_items_in_batch,
                              teacher_logits=None if teacher is None else teacher.double(), **inputs64)
    objective(out).backward()
    objective(ref).backward()
    return Pair(spec, out, ref, kleaf.grad, leaf64.grad, kleaf, x64, dtype)


def check(pair: Pair, *, nontrivial: bool = True) -> None:
    assert_matches_reference(pair)
    if nontrivial:
        assert_nontrivial(pair)
    want = POLICY_METRICS | ({"kl"} if pair.spec.policy.kl_beta != 0.0 else set())
    assert want <= set(pair.out.metrics), sorted(want - set(pair.out.metrics))


def case(token_shape, vocab, seed, spec, *, dtype=torch.float32, mask_frac=0.25, ignore_frac=0.0, **input_kw):
    """logits, targets, a random loss mask (first token always counts) and the inputs."""
    logits = make_logits((*token_shape, vocab), dtype, seed=seed)
    targets = make_targets(token_shape, vocab, seed=seed, ignore_frac=ignore_frac)
    loss_mask = None
    if mask_frac:
        loss_mask = (torch.rand(token_shape, generator=generator(seed + 99)) >= mask_frac).long()
        loss_mask.reshape(-1)[0] = 1
    inputs = make_policy_inputs(logits, targets, spec, seed, loss_mask=loss_mask, **input_kw)
    return logits, targets, inputs


# --- hand-computed oracle: validates reference_policy_loss itself ---------------------------


def _row_logprobs(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - lse for v in row]


def _row_entropy(row: list[float]) -> float:
    return -sum(math.exp(lp) * lp for lp in _row_logprobs(row))


LOGITS_1x2 = torch.tensor([[[1.0, -0.5, 2.0], [0.3, 0.1, -1.2]]], dtype=torch.float64)
TARGETS_1x2 = torch.tensor([[2, 0]])
LOGP_1x2 = [_row_logprobs(LOGITS_1x2[0, 0].tolist())[2], _row_logprobs(LOGITS_1x2[0, 1].tolist())[0]]


def _old_for_ratios(ratios) -> torch.Tensor:
    """old_logprobs that give these ratios exactly: old = logp - log r."""
    return torch.tensor([[lp - math.log(r) for lp, r in zip(LOGP_1x2, ratios)]], dtype=torch.float64)


def _both_backends():
    return ["torch", pytest.param("triton", marks=needs_kernel)]


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize(
    "advantage,fields,want",
    [
        # ratios (1.5, 0.5), eps 0.2: A > 0 clips the 1.5 at 1.2 and keeps the 0.5 (min picks 0.5)
        (1.0, {}, (-1.2 - 0.5) / 2),
        # A < 0: -min(-1.5, -1.2) = 1.5 and -min(-0.5, -0.8) = 0.8
        (-1.0, {}, (1.5 + 0.8) / 2),
        # verl's dual clip c = 1.4 caps the 1.5 at 1.4 for A < 0
        (-1.0, {"dual_clip_c": 1.4}, (1.4 + 0.8) / 2),
        # two-sided clip delta = 1.3: min(1.5, 1.3) = 1.3 for A < 0; A > 0 still clipped at 1.2
        (-1.0, {"delta": 1.3}, (1.3 + 0.8) / 2),
        (1.0, {"delta": 1.3}, (-1.2 - 0.5) / 2),
        # asymmetric clip (DAPO clip-higher) eps_high 0.6: 1.5 is inside, A > 0
        (2.0, {"eps_high": 0.6}, (-3.0 - 1.0) / 2),
    ],
    ids=["pos", "neg", "dual_clip", "delta_neg", "delta_pos", "clip_higher"],
)
def test_clipped_surrogate_equals_the_hand_computed_value(backend, advantage, fields, want):
    spec = policy_spec("grpo", **fields)
    out = head_loss(LOGITS_1x2.float() if backend == "triton" else LOGITS_1x2, TARGETS_1x2, spec, backend=backend,
                    advantages=torch.tensor([advantage]), old_logprobs=_old_for_ratios((1.5, 0.5)))
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-6)
    assert float(out.metrics["ratio/min"]) == pytest.approx(0.5, rel=1e-6)
    assert float(out.metrics["ratio/max"]) == pytest.approx(1.5, rel=1e-6)
    assert float(out.metrics["ratio/mean"]) == pytest.approx(1.0, rel=1e-6)
    assert float(out.metrics["logprob/mean"]) == pytest.approx(sum(LOGP_1x2) / 2, rel=1e-6)
    eps_high = fields.get("eps_high", 0.2)
    low, high = (0.5 if advantage < 0 else 0.0), (0.5 if advantage > 0 and 1.5 > 1 + eps_high else 0.0)
    assert float(out.metrics["clip_ratio/low_mean"]) == pytest.approx(low)
    assert float(out.metrics["clip_ratio/high_mean"]) == pytest.approx(high)
    assert float(out.metrics["clip_ratio/region_mean"]) == pytest.approx(low + high)


@pytest.mark.parametrize("backend", _both_backends())
def test_gradient_of_the_surrogate_equals_the_hand_computed_one(backend):
    """Ratios (1.5, 0.5), A = 1: token 0 is clipped (no gradient); token 1 gives -A r / 2 d logp,
    and d logp / d x = onehot(y) - softmax(x)."""
    logits = (LOGITS_1x2.float() if backend == "triton" else LOGITS_1x2.clone()).requires_grad_()
    out = head_loss(logits, TARGETS_1x2, policy_spec("grpo"), backend=backend, advantages=torch.tensor([1.0]),
                    old_logprobs=_old_for_ratios((1.5, 0.5)))
    out.loss.backward()
    probs = [math.exp(lp) for lp in _row_logprobs(LOGITS_1x2[0, 1].tolist())]
    want_row1 = [-0.5 * 0.5 * ((1.0 if i == 0 else 0.0) - p) for i, p in enumerate(probs)]
    assert logits.grad[0, 0].abs().max() == 0
    assert logits.grad[0, 1].tolist() == pytest.approx(want_row1, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("correction", [False, True], ids=["plain", "is_corrected"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_and_metric_equal_the_hand_computed_estimators(backend, estimator, correction):
    ratios, d = (1.5, 0.5), (0.4, -0.7)  # d = ref - logp
    ref = torch.tensor([[lp + di for lp, di in zip(LOGP_1x2, d)]], dtype=torch.float64)
    k = {"k1": lambda v: -v, "k2": lambda v: 0.5 * v * v, "k3": lambda v: math.exp(v) - v - 1.0}[estimator]
    kl = [k(v) * (r if correction else 1.0) for v, r in zip(d, ratios)]
    spec = policy_spec("bnpo", kl_beta=0.1, kl_estimator=estimator, kl_importance_correction=correction)
    out = head_loss(LOGITS_1x2.float() if backend == "triton" else LOGITS_1x2, TARGETS_1x2, spec, backend=backend,
                    advantages=torch.tensor([1.0]), old_logprobs=_old_for_ratios(ratios), ref_logprobs=ref)
    surrogate = [-1.2, -0.5]
    assert float(out.loss.detach()) == pytest.approx(sum(s + 0.1 * v for s, v in zip(surrogate, kl)) / 2, rel=1e-5)
    assert float(out.metrics["kl"]) == pytest.approx(sum(kl) / 2, rel=1e-5)


@pytest.mark.parametrize("backend", _both_backends())
def test_sequence_level_importance_ratio_is_the_exp_of_the_mean_log_ratio(backend):
    """GSPO: log ratios (ln 2, 0) -> one ratio sqrt(2) for both tokens."""
    old = _old_for_ratios((2.0, 1.0))
    logits = LOGITS_1x2.float() if backend == "triton" else LOGITS_1x2
    for advantage, want in ((1.0, -1.2), (-1.0, math.sqrt(2.0))):
        spec = policy_spec("grpo", importance_sampling="sequence")
        out = head_loss(logits, TARGETS_1x2, spec, backend=backend, advantages=torch.tensor([advantage]),
                        old_logprobs=old)
        assert float(out.loss.detach()) == pytest.approx(want, rel=1e-6)
        assert float(out.metrics["ratio/min"]) == pytest.approx(math.sqrt(2.0), rel=1e-6)
        assert float(out.metrics["ratio/max"]) == pytest.approx(math.sqrt(2.0), rel=1e-6)


# Aggregation on [2, 3] with the mask [[1, 1, 0], [1, 0, 0]], on-policy (ratio 1), A = (1, -3):
# per-token losses (-1, -1, .) and (3, ., .); token sum 1, sequence sums (-2, 3), 3 tokens.
AGGREGATED = {
    "grpo": (-1.0 + 3.0) / 2,
    "seq-mean-token-mean": (-1.0 + 3.0) / 2,
    "bnpo": 1.0 / 3,
    "token-mean": 1.0 / 3,
    "dr_grpo": 1.0 / (2 * 4),  # max_completion_length 4
    "dapo": 1.0 / 3,  # no num_items_in_batch: the token count
    "seq-mean-token-sum": (-2.0 + 3.0) / 2,
    "seq-mean-token-sum-norm": 1.0 / 3,  # T = 3
}


def _aggregation_case():
    logits = make_logits((2, 3, 5), torch.float64, seed=7)
    targets = torch.tensor([[1, 4, 0], [2, 3, 3]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logits, targets, mask


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregation_equals_the_trainers_definition(backend, loss_type):
    logits, targets, mask = _aggregation_case()
    logits = logits.float() if backend == "triton" else logits
    spec = policy_spec(loss_type, max_completion_length=4)
    out = head_loss(logits, targets, spec, backend=backend, advantages=torch.tensor([1.0, -3.0]), loss_mask=mask)
    assert float(out.loss.detach()) == pytest.approx(AGGREGATED[loss_type], rel=1e-6)
    assert int(out.metrics["n_tokens"]) == 3


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("num_items,num_processes,want", [(5, 1, 1.0 / 5), (5, 2, 1.0 / 2.5), (6.0, 3, 1.0 / 2)])
def test_dapo_divides_by_num_items_in_batch_over_num_processes(backend, num_items, num_processes, want):
    logits, targets, mask = _aggregation_case()
    logits = logits.float() if backend == "triton" else logits
    spec = policy_spec("dapo", num_processes=num_processes)
    for n in (num_items, torch.tensor(num_items)):
        out = head_loss(logits, targets, spec, backend=backend, advantages=torch.tensor([1.0, -3.0]),
                        loss_mask=mask, num_items_in_batch=n)
        assert float(out.loss.detach()) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("backend", _both_backends())
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_entropy_bonus_subtracts_coef_times_the_aggregated_entropy(backend, loss_type):
    logits, targets, mask = _aggregation_case()
    h = [[_row_entropy(row) for row in seq] for seq in logits.tolist()]
    logits = logits.float() if backend == "triton" else logits
    spec = policy_spec(loss_type, entropy_coef=0.05)
    out = head_loss(logits, targets, spec, backend=backend, advantages=torch.tensor([1.0, -3.0]), loss_mask=mask)
    agg_h = (h[0][0] + h[0][1]) / 2 / 2 + h[1][0] / 2 if loss_type == "grpo" else (h[0][0] + h[0][1] + h[1][0]) / 3
    assert float(out.loss.detach()) == pytest.approx(AGGREGATED[loss_type] - 0.05 * agg_h, rel=1e-6)
    assert float(out.metrics["entropy"]) == pytest.approx((h[0][0] + h[0][1] + h[1][0]) / 3, rel=1e-6)


@pytest.mark.parametrize("backend", _both_backends())
def test_on_policy_gradient_is_minus_advantage_times_dlogp(backend):
    """No old_logprobs: ratio 1 with gradient; grpo on one token: loss = -A, d loss / d x = -A (onehot - p)."""
    row = [0.5, -1.0, 2.0, 0.0]
    logits = torch.tensor([[row]], dtype=torch.float32 if backend == "triton" else torch.float64,
                          requires_grad=True)
    out = head_loss(logits, torch.tensor([[1]]), policy_spec("grpo"), backend=backend, advantages=torch.tensor([2.0]))
    out.loss.backward()
    probs = [math.exp(lp) for lp in _row_logprobs(row)]
    assert float(out.loss.detach()) == pytest.approx(-2.0)
    assert float(out.metrics["ratio/mean"]) == pytest.approx(1.0)
    assert logits.grad[0, 0].tolist() == pytest.approx([-2.0 * ((i == 1) - p) for i, p in enumerate(probs)],
                                                       rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("backend", _both_backends())
def test_importance_weights_scale_the_surrogate_but_not_the_kl(backend):
    logits = LOGITS_1x2.float() if backend == "triton" else LOGITS_1x2
    ref = torch.tensor([LOGP_1x2], dtype=torch.float64) + 0.5  # d = 0.5 on both tokens
    spec = policy_spec("bnpo", kl_beta=0.2, kl_estimator="k2")
    out = head_loss(logits, TARGETS_1x2, spec, backend=backend, advantages=torch.tensor([1.0]),
                    old_logprobs=_old_for_ratios((1.5, 0.5)), ref_logprobs=ref,
                    importance_weights=torch.tensor([[2.0, 0.5]]))
    assert float(out.loss.detach()) == pytest.approx((-1.2 * 2.0 - 0.5 * 0.5 + 2 * 0.2 * 0.125) / 2, rel=1e-5)


def test_temperature_divides_the_logits_before_the_log_probs():
    """TRL: logits / temperature, then log_softmax; the ratio uses those log-probs."""
    row = [1.0, 3.0, -2.0]
    spec = policy_spec("bnpo", transform=LogitTransform(temperature=0.5))
    lp = _row_logprobs([v / 0.5 for v in row])[1]
    old = torch.tensor([[lp - math.log(1.1)]], dtype=torch.float64)
    out = head_loss(torch.tensor([[row]], dtype=torch.float64), torch.tensor([[1]]), spec, backend="torch",
                    advantages=torch.tensor([1.0]), old_logprobs=old)
    assert float(out.loss.detach()) == pytest.approx(-1.1, rel=1e-9)
    assert float(out.metrics["logprob/mean"]) == pytest.approx(lp, rel=1e-9)


@pytest.mark.parametrize("backend", _both_backends())
def test_clip_ratio_low_min_is_the_min_over_sequences_of_their_clipped_fraction(backend):
    """Documented choice: TRL's low_min / high_max are extremes over processes of per-process means
    (for one call, equal to the means); headloss reports extremes over the batch's sequences."""
    logits, targets, mask = _aggregation_case()
    logits = logits.float() if backend == "triton" else logits
    logp = true_logprobs(logits, targets, LossSpec())
    old = logp - math.log(0.5)  # ratio 0.5 everywhere: A < 0 tokens are low-clipped, A > 0 are not
    out = head_loss(logits, targets, policy_spec("grpo"), backend=backend, advantages=torch.tensor([1.0, -3.0]),
                    loss_mask=mask, old_logprobs=old)
    assert float(out.metrics["clip_ratio/low_mean"]) == pytest.approx(1.0 / 3)
    assert float(out.metrics["clip_ratio/low_min"]) == pytest.approx(0.0)  # the A > 0 sequence: none clipped


@pytest.mark.parametrize("backend", _both_backends())
def test_sequence_level_clip_ratios_are_means_over_sequences(backend):
    """As TRL's global_masked_mean of the [B, 1] sequence-level indicators: over sequences."""
    logits, targets, mask = _aggregation_case()
    logits = logits.float() if backend == "triton" else logits
    logp = true_logprobs(logits, targets, LossSpec())
    old = logp - math.log(2.0)  # sequence ratio 2 for both sequences: A > 0 sequence (2 tokens) high-clipped
    spec = policy_spec("grpo", importance_sampling="sequence")
    out = head_loss(logits, targets, spec, backend=backend, advantages=torch.tensor([1.0, -3.0]), loss_mask=mask,
                    old_logprobs=old)
    assert float(out.metrics["clip_ratio/high_mean"]) == pytest.approx(1.0 / 2)  # 1 of the 2 sequences


# --- kernel vs fp64 reference -----------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("loss_type, level, estimator", tiered(list(LOSS_TYPES), ["token", "sequence"],
                                                                ["k1", "k2", "k3"]))
def test_kernel_matches_reference_per_loss_type_is_level_and_kl_estimator(loss_type, level, estimator):
    seed = seed_of(loss_type, level, estimator)
    spec = policy_spec(loss_type, importance_sampling=level, kl_beta=0.05, kl_estimator=estimator)
    logits, targets, inputs = case((2, 3), 29, seed, spec)
    check(run_policy(logits, targets, spec, inputs))


@needs_kernel
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kernel_matches_reference_with_importance_corrected_kl(level, estimator):
    seed = seed_of("is-kl", level, estimator)
    loss_type = {"k1": "bnpo", "k2": "grpo", "k3": "dr_grpo"}[estimator]
    spec = policy_spec(loss_type, importance_sampling=level, kl_beta=0.1, kl_estimator=estimator,
                       kl_importance_correction=True)
    logits, targets, inputs = case((2, 3), 31, seed, spec, noise=0.5)
    check(run_policy(logits, targets, spec, inputs))


# name -> (policy/spec fields, input options)
FEATURES = {
    "delta": ({"loss_type": "bnpo", "delta": 1.25, "kl_beta": 0.02}, {"noise": 0.6}),
    "dual_clip": ({"loss_type": "token-mean", "dual_clip_c": 2.0}, {"noise": 1.2}),
    "dual_clip_and_delta_sequence": ({"loss_type": "grpo", "dual_clip_c": 1.5, "delta": 1.3, "kl_beta": 0.02,
                                      "importance_sampling": "sequence"}, {"noise": 1.0}),
    "clip_higher": ({"loss_type": "dapo", "eps_low": 0.1, "eps_high": 0.28}, {"noise": 0.4}),
    "importance_weights": ({"loss_type": "seq-mean-token-sum", "kl_beta": 0.05}, {"weights": True}),
    "entropy_coef": ({"loss_type": "seq-mean-token-mean", "entropy_coef": 0.05}, {}),
    "entropy_coef_sequence_kl": ({"loss_type": "dr_grpo", "entropy_coef": 0.1, "kl_beta": 0.2,
                                  "importance_sampling": "sequence"}, {}),
    "on_policy_token": ({"loss_type": "grpo", "kl_beta": 0.1}, {"old": False}),
    "on_policy_sequence": ({"loss_type": "bnpo", "importance_sampling": "sequence"}, {"old": False}),
    "on_policy_entropy": ({"loss_type": "seq-mean-token-sum-norm", "entropy_coef": 0.02}, {"old": False}),
    "per_token_advantages": ({"loss_type": "grpo", "kl_beta": 0.05}, {"per_token_adv": True}),
    "per_token_advantages_sequence": ({"loss_type": "token-mean", "importance_sampling": "sequence"},
                                      {"per_token_adv": True}),
    "temperature_softcap": ({"loss_type": "dapo", "kl_beta": 0.05,
                             "transform": LogitTransform(temperature=0.7, softcap=6.0)}, {}),
    "ce_aux_z_loss_ignored_targets": ({"loss_type": "grpo", "ce": CrossEntropy(weight=0.1, label_smoothing=0.05),
                                       "z_loss": ZLoss(weight=1e-3)}, {"ignore_frac": 0.3}),
    "ce_aux_sum_reduction": ({"loss_type": "bnpo", "ce": CrossEntropy(weight=0.2), "reduction": "sum"}, {}),
    "entropy_term_and_accuracy": ({"loss_type": "seq-mean-token-sum", "entropy": Entropy(weight=-0.01),
                                   "token_accuracy": True, "entropy_coef": 0.01}, {}),
    "logprobs_output": ({"loss_type": "dapo", "outputs": ("logprobs", "entropy", "predicted_tokens")}, {}),
    "differentiable_logprobs": ({"loss_type": "grpo", "outputs": ("logprobs", "entropy"),
                                 "differentiable_outputs": True, "entropy_coef": 0.01}, {}),
    "no_loss_mask": ({"loss_type": "grpo", "kl_beta": 0.05}, {"mask_frac": 0.0}),
}


@needs_kernel
@pytest.mark.parametrize("name", list(FEATURES))
def test_kernel_matches_reference_for_option(name):
    fields, opts = FEATURES[name]
    opts = dict(opts)
    seed = seed_of("feature", name)
    spec = policy_spec(**fields)
    mask_frac, ignore_frac = opts.pop("mask_frac", 0.25), opts.pop("ignore_frac", 0.0)
    logits, targets, inputs = case((2, 3), 33, seed, spec, mask_frac=mask_frac, ignore_frac=ignore_frac, **opts)
    pair = run_policy(logits, targets, spec, inputs)
    check(pair)
    if name.startswith("dual_clip") or name == "delta":
        # the ratios reach the region the option acts on
        assert float(pair.ref.metrics["ratio/max"]) > fields.get("delta", fields.get("dual_clip_c", 0.0))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=DTYPE_IDS[1:])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_kernel_matches_reference_for_half_precision_logits(dtype, level):
    seed = seed_of("half", dtype, level)
    spec = policy_spec("grpo", importance_sampling=level, kl_beta=0.05, entropy_coef=0.01, ce=CrossEntropy(weight=0.1))
    logits, targets, inputs = case((2, 3), 37, seed, spec, dtype=dtype)
    check(run_policy(logits, targets, spec, inputs))


@needs_kernel
@pytest.mark.parametrize("kind,value", [("int", 7), ("float", 9.0), ("tensor", torch.tensor(11))])
def test_kernel_matches_reference_for_dapo_with_num_items_in_batch(kind, value):
    spec = policy_spec("dapo", num_processes=2, kl_beta=0.05, ce=CrossEntropy(weight=0.1))
    logits, targets, inputs = case((2, 3), 23, seed_of("dapo", kind), spec)
    check(run_policy(logits, targets, spec, inputs, num_items_in_batch=value))


@needs_kernel
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kernel_matches_reference_with_an_empty_sequence(loss_type):
    seed = seed_of("empty", loss_type)
    spec = policy_spec(loss_type, kl_beta=0.05)
    logits, targets, inputs = case((3, 3), 21, seed, spec)
    inputs["loss_mask"][1] = 0
    pair = run_policy(logits, targets, spec, inputs)
    check(pair)
    assert bool((pair.grad[1] == 0).all())


@needs_kernel
@pytest.mark.parametrize("ids", [[0, 0, 0, 2, 2, 7, 7, 7, 7], [2, 0, 2, 7, 0, 7, 7, 2, 0]],
                         ids=["packed", "interleaved"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kernel_matches_reference_for_flat_rows_with_sequence_ids(loss_type, ids):
    seed = seed_of("flat", loss_type, ids)
    spec = policy_spec(loss_type, importance_sampling="sequence" if ids[0] == 2 else "token", kl_beta=0.05)
    logits, targets, inputs = case((9,), 25, seed, spec, sequence_ids=torch.tensor(ids))
    check(run_policy(logits, targets, spec, inputs))


@needs_kernel
@pytest.mark.parametrize("loss_type", ["grpo", "seq-mean-token-sum-norm", "dr_grpo"])
def test_kernel_matches_reference_for_flat_rows_with_a_fully_masked_sequence(loss_type):
    ids = torch.tensor([0, 0, 3, 3, 3, 5, 5], dtype=torch.int32)
    spec = policy_spec(loss_type, kl_beta=0.05, importance_sampling="sequence")
    logits, targets, inputs = case((7,), 19, seed_of("flat-empty", loss_type), spec, sequence_ids=ids)
    inputs["loss_mask"] = (ids != 3).long()
    check(run_policy(logits, targets, spec, inputs))


@needs_kernel
@pytest.mark.parametrize(
    "token_shape,level",
    [((1, 4), "token"), ((1, 4), "sequence"), ((3, 1), "token"), ((3, 1), "sequence"), ((1, 1), "sequence"),
     ((1,), "token")],
    ids=["B1", "B1_seq", "T1", "T1_seq", "B1T1", "N1"],
)
def test_kernel_matches_reference_for_tiny_shapes(token_shape, level):
    seed = seed_of("tiny", token_shape, level)
    spec = policy_spec("grpo", importance_sampling=level, kl_beta=0.05, entropy_coef=0.01)
    ids = torch.zeros(1, dtype=torch.long) if len(token_shape) == 1 else None
    logits, targets, inputs = case(token_shape, 27, seed, spec, mask_frac=0.0, sequence_ids=ids)
    check(run_policy(logits, targets, spec, inputs))


@needs_kernel
def test_kernel_matches_reference_for_a_strided_view_and_several_vocab_blocks(monkeypatch):
    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", 16)  # (HEADLOSS_BLOCK_V is read at import)
    spec = policy_spec("grpo", kl_beta=0.05, entropy_coef=0.02, ce=CrossEntropy(weight=0.1))
    logits = make_logits((2, 4, 45), torch.float32, seed=17)
    targets = make_targets((2, 3), 45, seed=17)
    inputs = make_policy_inputs(logits[:, :-1], targets, spec, 17)
    pair = run_policy(logits, targets, spec, inputs, view=lambda t: t[:, :-1])
    check(pair)
    assert bool((pair.grad[:, -1] == 0).all())


@needs_kernel
def test_kernel_matches_reference_for_policy_with_distillation():
    spec = policy_spec("grpo", kl_beta=0.05, ce=CrossEntropy(weight=0.1),
                       distillation=Distillation(divergence="reverse_kl", temperature=1.5, weight=0.3))
    logits, targets, inputs = case((2, 3), 29, 23, spec)
    teacher = (logits.double() * 0.7 + torch.randn(logits.shape, generator=generator(1), dtype=torch.float64)).float()
    pair = run_policy(logits, targets, spec, inputs, teacher=teacher)
    check(pair)
    assert "distill/divergence" in pair.out.metrics


@needs_kernel
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "seq-mean-token-sum-norm"])
def test_every_token_masked_gives_zero_loss_zero_gradient_and_default_metrics(loss_type):
    spec = policy_spec(loss_type, kl_beta=0.05)
    logits, targets, inputs = case((2, 3), 17, seed_of("all-masked", loss_type), spec)
    inputs["loss_mask"] = torch.zeros(2, 3, dtype=torch.long)
    pair = run_policy(logits, targets, spec, inputs)
    check(pair, nontrivial=False)
    assert float(pair.out.loss.detach()) == 0.0
    assert bool((pair.grad == 0).all())
    assert float(pair.out.metrics["ratio/min"]) == 1.0 and float(pair.out.metrics["ratio/max"]) == 1.0


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_masked_positions_inputs_do_not_matter(backend):
    """Tokens outside loss_mask are skipped: any finite values there change nothing."""
    spec = policy_spec("grpo", kl_beta=0.1, ce=CrossEntropy(weight=0.1))
    logits, targets, inputs = case((2, 3), 19, 5, spec, per_token_adv=True, weights=True)
    inputs["loss_mask"] = torch.tensor([[1, 0, 1], [0, 0, 1]])
    masked = inputs["loss_mask"] == 0
    other = {k: v.clone() for k, v in inputs.items()}
    for name in ("old_logprobs", "ref_logprobs", "advantages", "importance_weights"):
        other[name][masked] = 50.0
    a = head_loss(logits, targets, spec, backend=backend, **inputs)
    b = head_loss(logits, targets, spec, backend=backend, **other)
    assert torch.equal(a.loss, b.loss)
    for name in a.metrics:
        assert torch.equal(a.metrics[name], b.metrics[name]), name


# --- errors -----------------------------------------------------------------------------------


def _inputs_for_errors(token_shape=(2, 3), vocab=11):
    logits = make_logits((*token_shape, vocab), torch.float32, seed=0)
    targets = make_targets(token_shape, vocab, seed=0)
    return logits, targets


@pytest.mark.parametrize("backend", _both_backends())
def test_missing_advantages_is_an_error_naming_it(backend):
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match="advantages: required"):
        head_loss(logits, targets, policy_spec(), backend=backend)


@pytest.mark.parametrize("backend", _both_backends())
def test_missing_ref_logprobs_with_kl_beta_is_an_error_naming_it(backend):
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match="ref_logprobs: required"):
        head_loss(logits, targets, policy_spec(kl_beta=0.1), advantages=torch.zeros(2), backend=backend)


def test_missing_targets_with_a_policy_term_is_an_error_naming_them():
    logits, _ = _inputs_for_errors()
    with pytest.raises(ValueError, match="targets: required by policy"):
        head_loss(logits, None, policy_spec(), advantages=torch.zeros(2), backend="torch")


@pytest.mark.parametrize("name", ["old_logprobs", "ref_logprobs", "loss_mask", "importance_weights"])
@pytest.mark.parametrize("shape", [(2, 4), (3, 2), (6,), (2, 3, 1)])
def test_per_token_input_shape_mismatch_is_an_error_naming_it(name, shape):
    logits, targets = _inputs_for_errors()
    kwargs = {"advantages": torch.zeros(2), "ref_logprobs": torch.zeros(2, 3)}
    kwargs[name] = torch.zeros(shape, dtype=torch.long if name == "loss_mask" else torch.float32)
    with pytest.raises(ValueError, match=f"{name}: expected shape"):
        head_loss(logits, targets, policy_spec(kl_beta=0.1), backend="torch", **kwargs)


@pytest.mark.parametrize("shape", [(3,), (2, 4), (6,), (2, 3, 1)])
def test_advantages_shape_mismatch_is_an_error_naming_it(shape):
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match="advantages: expected"):
        head_loss(logits, targets, policy_spec(), advantages=torch.zeros(shape), backend="torch")


def test_advantages_that_are_not_a_tensor_is_an_error_naming_them():
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match="advantages"):
        head_loss(logits, targets, policy_spec(), advantages=[1.0, 2.0], backend="torch")


def test_flat_logits_without_sequence_ids_is_an_error_naming_them():
    logits, targets = _inputs_for_errors((6,))
    with pytest.raises(ValueError, match="sequence_ids: required"):
        head_loss(logits, targets, policy_spec(), advantages=torch.zeros(6), backend="torch")


def test_sequence_ids_with_batched_logits_is_an_error_naming_them():
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match="sequence_ids: only for"):
        head_loss(logits, targets, policy_spec(), advantages=torch.zeros(2), sequence_ids=torch.zeros(6).long(),
                  backend="torch")


@pytest.mark.parametrize("ids", [[0, 1, 2, 3, 4, 6], [-1, 0, 0, 1, 1, 1]], ids=["too_large", "negative"])
def test_sequence_ids_out_of_range_is_an_error_with_validation_on(ids):
    logits, targets = _inputs_for_errors((6,))
    with pytest.raises(ValueError, match="sequence_ids: values must lie in"):
        head_loss(logits, targets, policy_spec(), advantages=torch.zeros(6), sequence_ids=torch.tensor(ids),
                  backend="torch")


@pytest.mark.parametrize("ids", [torch.zeros(5, dtype=torch.long), torch.zeros(6), torch.zeros(2, 3).long()],
                         ids=["short", "float", "2d"])
def test_sequence_ids_of_the_wrong_shape_or_dtype_is_an_error_naming_them(ids):
    logits, targets = _inputs_for_errors((6,))
    with pytest.raises(ValueError, match="sequence_ids: expected integer"):
        head_loss(logits, targets, policy_spec(), advantages=torch.zeros(6), sequence_ids=ids, backend="torch")


@pytest.mark.parametrize("name", ["advantages", "old_logprobs", "ref_logprobs", "loss_mask", "importance_weights",
                                  "sequence_ids"])
def test_a_policy_input_without_a_policy_term_is_an_error_naming_it(name):
    logits, targets = _inputs_for_errors()
    with pytest.raises(ValueError, match=f"{name}: given, but the spec has no policy term"):
        head_loss(logits, targets, LossSpec(), backend="torch", **{name: torch.zeros(2, 3)})


def test_dr_grpo_without_max_completion_length_is_a_spec_error_naming_it():
    with pytest.raises(ValidationError, match="max_completion_length"):
        Policy(loss_type="dr_grpo")
    with pytest.raises(ValidationError, match="max_completion_length"):
        LossSpec.model_validate({"policy": {"loss_type": "dr_grpo"}})


def test_reduction_none_with_a_policy_term_is_a_spec_error_naming_it():
    with pytest.raises(ValidationError, match="reduction"):
        LossSpec(policy=Policy(), reduction="none")


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_low": 1.5}, "eps_low"),
        ({"eps_high": -0.1}, "eps_high"),
        ({"delta": 1.0}, "delta"),
        ({"dual_clip_c": 0.5}, "dual_clip_c"),
        ({"kl_beta": -0.1}, "kl_beta"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"importance_sampling": "sentence"}, "importance_sampling"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"num_processes": 0}, "num_processes"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"epsilon": 0.2}, "epsilon"),
    ],
)
def test_invalid_policy_field_is_a_validation_error_naming_it(fields, name):
    with pytest.raises(ValidationError, match=name):
        Policy(**fields)


# --- hypothesis: GRPO + CE auxiliary (+ z-loss, entropy) over random specs and shapes ------------


@st.composite
def policy_cases(draw):
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    kl_beta = draw(st.sampled_from([0.0, 0.05, 0.3]))
    objective = draw(st.sampled_from(["clip", "clip", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl", "reinforce",
                                      "gmpo", "vespo", "kl_cov"]))
    per_token_ratio = objective not in ("clip", "cispo", "sapo")
    if objective == "gmpo":
        loss_type = draw(st.sampled_from(["grpo", "seq-mean-token-mean"]))
    policy = Policy(
        objective=objective,
        convention=draw(st.sampled_from(["trl", "verl"])),
        entropy_aggregation=draw(st.sampled_from(["loss", "token-mean"])),
        sapo_tau_pos=draw(st.sampled_from([1.0, 2.0])),
        sapo_tau_neg=draw(st.sampled_from([1.05, 0.5])),
        dro_beta=draw(st.sampled_from([0.1, 1.0])) if objective == "dro" else None,
        dppo_ratio_cap=draw(st.sampled_from([3.0, 1.1])),
        reinforce_is_max=draw(st.sampled_from([2.0, 1.1])),
        kl_clamp=draw(st.booleans()),
        kl_grad=draw(st.sampled_from(["estimator", "k2"])),
        loss_type=loss_type,
        eps_low=draw(st.sampled_from([0.2, 0.1])),
        eps_high=draw(st.sampled_from([0.2, 0.28])),
        delta=draw(st.none() | st.just(1.4)),
        dual_clip_c=draw(st.none() | st.just(2.0)),
        kl_beta=kl_beta,
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3", "abs"])),
        kl_importance_correction=draw(st.booleans()),
        importance_sampling="token" if per_token_ratio else draw(st.sampled_from(["token", "sequence",
                                                                                  "sequence_token"])),
        off_policy_mask=draw(st.none() | st.just(0.05)),
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5])),
        cov_ratio=0.3,
        max_completion_length=draw(st.integers(3, 8)) if loss_type == "dr_grpo" else None,
        num_processes=draw(st.sampled_from([1, 2])),
        entropy_coef=draw(st.sampled_from([0.0, 0.02])),
        kl_entropy_loss_type=draw(st.sampled_from([None, None, "token-mean", "seq-mean-token-mean", "grpo"])),
    )
    spec = LossSpec(
        policy=policy,
        cross_entropy=draw(st.none() | st.builds(CrossEntropy, weight=st.floats(0.01, 0.5),
                                                  label_smoothing=st.sampled_from([0.0, 0.1]))),
        z_loss=draw(st.none() | st.just(ZLoss(weight=1e-3))),
        entropy=draw(st.none() | st.builds(Entropy, weight=st.sampled_from([0.0, -0.01]))),
        transform=draw(st.sampled_from([LogitTransform(), LogitTransform(temperature=0.8)])),
        reduction=draw(st.sampled_from(["mean", "sum"])),
    )
    flat = draw(st.booleans())
    if flat:
        rows = draw(st.integers(1, 7))
        token_shape = (rows,)
        ids = draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows))
    else:
        token_shape, ids = (draw(st.integers(1, 3)), draw(st.integers(1, 3))), None
    opts = dict(
        per_token_adv=draw(st.booleans()), old=draw(st.booleans()), noise=draw(st.sampled_from([0.3, 1.0])),
        ref=kl_beta > 0 or draw(st.booleans()), weights=draw(st.booleans()),
    )
    num_items = draw(st.none() | st.integers(1, 12)) if spec.reduction == "mean" else None
    return spec, token_shape, ids, draw(st.integers(2, 40)), draw(st.sampled_from(DTYPES)), opts, num_items, \
        draw(st.sampled_from([0.0, 0.3])), draw(st.integers(0, 10_000))


@pytest.mark.slow
@needs_kernel
@HYPOTHESIS
@given(params=policy_cases())
def test_kernel_matches_reference_for_random_policy_specs_with_auxiliary_terms(params):
    spec, token_shape, ids, vocab, dtype, opts, num_items, mask_frac, seed = params
    seq_ids = torch.tensor(ids) if ids is not None else None
    logits, targets, inputs = case(token_shape, vocab, seed, spec, dtype=dtype, mask_frac=mask_frac,
                                   sequence_ids=seq_ids, **opts)
    pair = run_policy(logits, targets, spec, inputs, num_items_in_batch=num_items)
    check(pair, nontrivial=False)


# --- the per-sequence extremes: two launches against torch's ops --------------------------------


@pytest.mark.slow
@needs_kernel
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(batch=st.integers(1, 40), length=st.integers(1, 1100), strided=st.booleans(), nan=st.booleans(),
       empty=st.sampled_from(["none", "one", "all"]), seed=st.integers(0, 2**16), inf=st.booleans())
def test_sequence_extremes_kernel_equals_the_torch_ops(batch, length, strided, nan, empty, seed, inf):
    """policy_extremes on [B, T] rows launches sequence_extremes_kernel + extremes_finish_kernel; the
    torch ops it replaces (the path of rows with sequence_ids) give the same values bit for bit: an
    empty sequence is left out of the clipped fractions' extremes, a NaN ratio at a counted token
    makes the ratio extremes NaN, and with no counted token the fractions are 0 and the ratios 1."""
    check_sequence_extremes("cpu", batch, length, strided, nan, empty, seed, inf)


@needs_kernel
@pytest.mark.parametrize("batch, length, strided, nan, empty, inf", [
    (3, 37, True, True, "one", False), (1, 1, False, False, "all", True), (5, 300, False, False, "none", True)])
def test_sequence_extremes_kernel_on_fixed_cases(batch, length, strided, nan, empty, inf):
    """The fast tier's cases of the sweep above: a NaN ratio and an empty sequence, one token and no
    counted token, sequences longer than the kernel's block with an infinite ratio."""
    check_sequence_extremes("cpu", batch, length, strided, nan, empty, seed=batch * 1000 + length, inf=inf)


# --- deferred mode's policy term: two launches against torch's ops ---------------------------------


@st.composite
def deferred_policies(draw):
    """Policies whose deferred-mode term the kernels compute: every row-local objective, sequence-level
    ratios, the off-policy mask, KL options, the entropy bonus, loss types."""
    objective = draw(st.sampled_from(["clip", "clip", "cispo", "sapo", "gpg", "dro", "dppo_tv", "dppo_kl",
                                      "reinforce"]))
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    kl_beta = draw(st.sampled_from([0.0, 0.1]))
    return Policy(
        objective=objective,
        convention=draw(st.sampled_from(["trl", "verl"])),
        importance_sampling="token" if objective not in ("clip", "cispo", "sapo") else
        draw(st.sampled_from(["token", "sequence", "sequence", "sequence_token"])),
        loss_type=loss_type,
        max_completion_length=draw(st.integers(3, 9)) if loss_type == "dr_grpo" else None,
        eps_low=draw(st.sampled_from([0.2, 0.05])),
        eps_high=draw(st.sampled_from([0.28, 0.05, 1.2])),
        delta=draw(st.none() | st.just(1.3)),
        dual_clip_c=draw(st.none() | st.just(2.0)),
        sapo_tau_pos=draw(st.sampled_from([1.0, 2.0])),
        sapo_tau_neg=draw(st.sampled_from([1.05, 0.5])),
        dro_beta=0.3 if objective == "dro" else None,
        dppo_ratio_cap=draw(st.sampled_from([3.0, 1.1])),
        reinforce_is_max=draw(st.sampled_from([2.0, 1.1])),
        kl_beta=kl_beta,
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3", "abs"])),
        kl_clamp=draw(st.booleans()),
        kl_grad=draw(st.sampled_from(["estimator", "k2"])),
        kl_importance_correction=draw(st.booleans()),
        off_policy_mask=draw(st.none() | st.sampled_from([0.02, 0.5])),
        entropy_coef=draw(st.sampled_from([0.0, 0.03])),
        entropy_aggregation=draw(st.sampled_from(["loss", "token-mean"])),
        num_processes=draw(st.sampled_from([1, 2])),
        rollout_is=draw(st.sampled_from([None, None, "token", "sequence"])),
    )


@pytest.mark.slow
@needs_kernel
@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(policy=deferred_policies(), batch=st.integers(1, 5), length=st.integers(1, 24), vocab=st.integers(2, 40),
       shift=st.booleans(), empty=st.sampled_from(["none", "none", "one", "all"]), per_token_adv=st.booleans(),
       weights=st.booleans(), rollout=st.booleans(), seed=st.integers(0, 10_000),
       input_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_deferred_policy_kernels_equal_the_torch_ops(policy, batch, length, vocab, shift, empty, per_token_adv,
                                                     weights, rollout, seed, input_dtype):
    """Deferred mode's policy term on [B, T] rows launches policy_sequence_kernel + its finishing kernel
    (policy.objective_route), on the inputs as given (any float dtype, NaN at masked tokens) and on fp32
    copies; the loss, every metric (names and order too) and the gradient equal the torch ops'
    (policy.policy_objective)."""
    check_policy_objective("cpu", policy, batch, length, vocab, seed, shift=shift, empty=empty,
                           per_token_adv=per_token_adv, weights=weights, rollout=rollout, input_dtype=input_dtype)


@needs_kernel
@pytest.mark.slow  # (the deferred kernels' one-block sequences run in the fast tier's oracle tests)
@pytest.mark.parametrize("importance_sampling", ["sequence", "sequence_token"])
def test_deferred_policy_kernels_loop_over_long_sequences(monkeypatch, importance_sampling):
    """Sequences longer than the kernel's block (OBJECTIVE_BLOCK, here 16 tokens) take several steps of
    each pass."""
    import headloss.kernels.policy as kernels

    monkeypatch.setattr(kernels, "OBJECTIVE_BLOCK", 16)
    policy = Policy(loss_type="grpo", importance_sampling=importance_sampling, kl_beta=0.05,
                    kl_importance_correction=True, off_policy_mask=0.5, entropy_coef=0.01)
    check_policy_objective("cpu", policy, 3, 41, 5, seed=3, shift=True, empty="one", rollout=True)


@needs_kernel
@pytest.mark.parametrize("length", [4, 16])
def test_deferred_policy_kernels_infinite_sequence_ratio(length):
    """A sequence whose ratio is inf (old log-probs far below): the clipped objective is finite, as with
    the torch ops, whether or not the sequence fills the kernel's block (its lanes past the sequence)."""
    gen = generator(11)
    logits = torch.randn(1, length, 8, generator=gen)
    ids = torch.randint(0, 8, (1, length), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    spec = LossSpec(cross_entropy=None, policy={"importance_sampling": "sequence"})
    inputs = dict(advantages=torch.tensor([1.0]), old_logprobs=logp - 100.0)
    kernel = head_loss(logits, ids, spec, route="deferred+kernels", **inputs)
    ops = head_loss(logits, ids, spec, route="deferred+torch", **inputs)
    assert math.isfinite(kernel.loss.item())
    torch.testing.assert_close(kernel.loss, ops.loss.detach())
    assert kernel.metrics["ratio/mean"].item() == math.inf == ops.metrics["ratio/mean"].item()


@needs_kernel
def test_deferred_policy_inputs_that_want_a_gradient_get_it():
    """Advantages or reference log-probs with requires_grad take the torch ops (the kernels give d loss
    / d rows only): their gradient is there, and equals the one with every input detached but them."""
    gen = generator(12)
    logits = torch.randn(2, 5, 9, generator=gen, requires_grad=True)
    ids = torch.randint(0, 9, (2, 5), generator=gen)
    spec = LossSpec(cross_entropy=None, policy={"importance_sampling": "sequence", "kl_beta": 0.1})
    adv = torch.randn(2, generator=gen).requires_grad_()
    ref = (torch.randn(2, 5, generator=gen) - 2).requires_grad_()
    old = torch.randn(2, 5, generator=gen) - 2
    out = head_loss(logits, ids, spec, advantages=adv, ref_logprobs=ref, old_logprobs=old)
    assert out.route == "deferred+torch"
    with pytest.raises(ValueError, match="route: 'deferred\\+kernels' cannot run this call"):
        head_loss(logits, ids, spec, advantages=adv, ref_logprobs=ref, old_logprobs=old, route="deferred+kernels")
    out.loss.backward()
    assert adv.grad is not None and ref.grad is not None and adv.grad.abs().sum() > 0
    assert out.metrics["ratio/mean"].grad_fn is None
    with torch.no_grad():  # no gradient wanted: the kernels' route, the same loss
        kernel = head_loss(logits, ids, spec, advantages=adv, ref_logprobs=ref, old_logprobs=old)
    assert kernel.route == "deferred+kernels"
    torch.testing.assert_close(kernel.loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
