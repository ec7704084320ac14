"""The head's terms in plain torch, term by term, differentiable through autograd.

Written from the definitions, not from the kernel: log_softmax, torch's own cross-entropy with
label smoothing, an explicit entropy, TRL's generalized JSD. The policy term is reference/policy.py.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..layouts import TEACHER_KEY
from ..output import HeadLossOutput, guard_second_backward
from ..plan import in_metric_order
from ..spec import LossSpec, row_local
from ..transform import transformed_logits
from ..validation import (
    MASS_TOLERANCE,
    NOT_BINARY,
    CheckContext,
    Normaliser,
    check_row_input,
    check_selected_given,
    raise_if_bad,
    raise_selected,
    raise_teacher,
)
from .policy import reference_policy_loss
from .sparse import estimator, topk_distillation


def reference_head_loss(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    spec: LossSpec,
    *,
    compute_dtype: torch.dtype | None = None,
    validate: str = "off",
    **inputs: Any,
) -> HeadLossOutput:
    """Reference for :func:`headloss.head_loss`; math in ``compute_dtype`` (default: fp32,
    or fp64 for fp64 logits). Gradients flow through autograd to ``logits``.

    ``inputs``: head_loss's per-call keywords, by the same names -- ``teacher_logits``, or a sparse
    teacher's ``teacher_ids`` / ``teacher_logprobs``; ``num_items_in_batch``; the rest are the policy
    term's inputs (``advantages``, ``old_logprobs``, ``loss_mask``, ...).

    ``validate`` (async / sync / off, as headloss.inputs.validation_mode gives it): check targets
    and num_items_in_batch values; the reference reads them on the host (under torch.compile, a
    device-side assert). Like the kernel path, a loss whose plan runs the fused mode takes one
    backward: a second one (retain_graph=True) raises the same error."""
    teacher_logits, teacher_ids, teacher_logprobs, num_items_in_batch, temperature, teacher_probs, weights, \
        selected = (inputs.pop(name, None) for name in (
            "teacher_logits", "teacher_ids", "teacher_logprobs", "num_items_in_batch", "temperature", "teacher_probs",
            "token_weights", "selected_ids"))
    policy_inputs = inputs
    if (weights is None) != (spec.token_weights is None):
        raise ValueError("token_weights: " + ("required by spec.token_weights but not given" if weights is None else
                                              "given, but spec.token_weights is not set"))
    check_selected_given(spec, selected is not None)
    if selected is not None and validate != "off":
        _check_selected(selected, logits.shape[-1], tuple(logits.shape[:-1]))
    if teacher_probs is not None:  # a teacher given as probabilities: its log, at temperature 1
        if validate != "off":
            _check_probabilities(teacher_probs)
        wide = torch.float64 if teacher_probs.dtype == torch.float64 else torch.float32
        teacher_logits = torch.log(teacher_probs.detach().to(wide))
    if temperature is not None and validate != "off":
        check_row_input("temperature", temperature, tuple(logits.shape[:-1]))
    if weights is not None and validate != "off":
        check_row_input("token_weights", weights, tuple(logits.shape[:-1]))
    if validate != "off" and targets is not None:
        _check_values(targets, logits.shape[-1], spec.ignore_index, num_items_in_batch,
                      policy_inputs.get("sequence_ids"), policy_inputs.get("loss_mask"))
    if compute_dtype is None:
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    token_shape = logits.shape[:-1]
    vocab = logits.shape[-1]
    x = transformed_logits(logits, spec, compute_dtype, temperature).reshape(-1, vocab)
    y, valid, nan_if_bad = _targets(targets, x, spec.ignore_index, policy_inputs.get("loss_mask"))

    # an ignored row takes no part: whatever it holds (NaN, inf) reaches neither a value nor a gradient
    x = torch.where(valid[:, None], x, 0.0)
    logp_all = torch.log_softmax(x, dim=-1)
    lse = torch.logsumexp(x, dim=-1)
    teacher = teacher_logits
    if teacher_logprobs is not None:  # a sparse teacher, its rows flat like the logits'
        teacher = _Sparse(None if teacher_ids is None else teacher_ids.reshape(-1, teacher_ids.shape[-1]),
                          teacher_logprobs.reshape(-1) if teacher_ids is None else
                          teacher_logprobs.reshape(-1, teacher_ids.shape[-1]))
    token_loss, per_term, entropy, distill_rows = _terms(x, logp_all, lse, y, valid, nan_if_bad, spec, teacher)
    top_ids = top_logprobs = None
    overlap = None
    if spec.student_topk is not None:
        top_ids, top_logprobs = _student_topk(x, logp_all, valid, spec.student_topk)
        if isinstance(teacher, _Sparse) and teacher.ids is not None:
            overlap = _overlap(logp_all, top_ids, teacher, spec)
            distill_rows.update({"distill/overlap_ratio": overlap["count"] / top_ids.shape[-1],
                                 "distill/overlap_token_advantage": overlap["advantage"]})
    token_loss = torch.where(valid, token_loss, 0.0)
    count = valid.sum().clamp(min=1).to(compute_dtype)  # the metrics' divisor: tokens, unweighted
    divisor = count
    if weights is not None:  # each token's loss (and through it its gradient) times its weight
        w = torch.where(valid, weights.reshape(-1).to(compute_dtype), 0.0)
        token_loss = token_loss * w
        if spec.token_weights.normalize == "weights":  # a weighted mean; weights that sum to 0 give 0
            total = w.sum()
            divisor = torch.where(total > 0, total, torch.ones_like(total))

    entropy_for_policy = None
    if spec.policy is not None:
        probs = logp_all.exp()
        entropy_for_policy = -(probs * torch.where(probs > 0, logp_all, 0.0)).sum(-1)

    n_valid = valid.sum()
    loss = _reduced(token_loss, divisor, spec, num_items_in_batch, token_shape)

    policy_metrics: dict[str, torch.Tensor] = {}
    if spec.policy is not None:
        logp_tok = torch.where(valid, logp_all.gather(-1, y[:, None])[:, 0], 0.0)
        policy_loss, policy_metrics = reference_policy_loss(
            logp_tok, entropy_for_policy, valid, spec, token_shape, num_items_in_batch, policy_inputs,
            None if weights is None else (weights.reshape(-1), spec.token_weights.normalize == "tokens"))
        loss = loss + policy_loss
    logp_y = torch.where(valid, logp_all.gather(-1, y[:, None])[:, 0] + nan_if_bad, 0.0)
    pred = torch.where(valid, x.argmax(-1), -1)
    metrics = {"loss": (loss.sum() if spec.reduction == "none" else loss).detach().clone(), **policy_metrics,
               **_metrics(per_term, distill_rows, logp_y=logp_y, pred=pred, y=y, valid=valid, count=count, spec=spec)}
    metrics["n_tokens"] = n_valid.detach()

    fused_mode = not (spec.reduction == "none" or spec.differentiable_outputs
                      or (spec.policy is not None and not row_local(spec.policy)))
    if fused_mode and loss.requires_grad:
        loss = _OneBackward.apply(loss)
    out_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    rows = {"predicted_tokens": pred, "logprobs": logp_y, "lse": torch.where(valid, lse, 0.0),
            "token_loss": token_loss,
            "entropy": torch.where(valid, entropy, 0.0) if entropy is not None else None,
            "selected_logprobs": None if selected is None else _selected(logp_all, selected, valid),
            "topk_ids": top_ids, "topk_logprobs": top_logprobs,
            "overlap_count": None if overlap is None else torch.where(valid, overlap["count"], 0).long(),
            "overlap_token_advantage": None if overlap is None else torch.where(valid, overlap["advantage"], 0.0)}
    return _output(loss, metrics, rows, spec, token_shape, out_dtype)


def _selected(logp_all: torch.Tensor, selected: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log p of each selected id [rows, K]: 0 where the id is -1 or the row does not count, NaN at an id
    outside [0, V) (validation off; as the kernels, never an IndexError)."""
    ids = selected.reshape(-1, selected.shape[-1]).long()
    given = (ids != -1) & valid[:, None]
    in_range = (ids >= 0) & (ids < logp_all.shape[-1])
    picked = logp_all.gather(-1, torch.where(in_range, ids, 0))
    return torch.where(given, torch.where(in_range, picked, float("nan")), 0.0)


def _check_selected(selected: torch.Tensor, vocab: int, token_shape: tuple[int, ...]) -> None:
    """The selected ids read on the host: each -1 or in [0, V); the first bad one named as the kernels'
    verdict names it (under torch.compile a device-side assert)."""
    flat = selected.reshape(-1)
    bad = (flat != -1) & ((flat < 0) | (flat >= vocab))
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), "headloss: a selected id outside [0, V) and not -1")
        return
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise_selected(first, CheckContext(token_shape, vocab, 0, selected_k=selected.shape[-1]),
                       entry_id=int(flat[first]))


def _output(loss, metrics: dict, rows: dict, spec: LossSpec, token_shape, out_dtype) -> HeadLossOutput:
    """The HeadLossOutput: the per-token outputs the spec asks for, shaped as the tokens."""

    def per_token(name: str) -> torch.Tensor | None:
        value = rows[name]
        if name not in spec.outputs or value is None:
            return None
        value = value.reshape(*token_shape, *value.shape[1:])  # (selected_logprobs: [.., K])
        if value.is_floating_point():
            value = value.to(out_dtype)
        return value if spec.differentiable_outputs else value.detach()

    return HeadLossOutput(
        loss=loss.to(out_dtype),
        metrics={k: (v.to(out_dtype) if v.is_floating_point() else v) for k, v in in_metric_order(metrics).items()},
        predicted_tokens=per_token("predicted_tokens"), logprobs=per_token("logprobs"), lse=per_token("lse"),
        token_loss=per_token("token_loss"), entropy=per_token("entropy"),
        selected_logprobs=per_token("selected_logprobs"),
        topk_ids=per_token("topk_ids"), topk_logprobs=per_token("topk_logprobs"),  # (detached where made)
        overlap_count=per_token("overlap_count"), overlap_token_advantage=per_token("overlap_token_advantage"),
    )


def _student_topk(x: torch.Tensor, logp_all: torch.Tensor, valid: torch.Tensor, k: int) -> tuple:
    """(ids, log-probs) [rows, k] of each row's k largest transformed logits, largest first, ties to the lower
    id (a stable sort); -1 and 0 at rows that do not count."""
    ids = torch.sort(x.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    logprobs = logp_all.detach().gather(-1, ids)
    return torch.where(valid[:, None], ids, -1), torch.where(valid[:, None], logprobs, 0.0)


def _overlap(logp_all: torch.Tensor, top_ids: torch.Tensor, teacher: _Sparse, spec: LossSpec) -> dict:
    """verl's overlap diagnostics per row: ``count``, how many of the teacher's ids are among the student's
    top-k, and ``advantage``, the mean of -q (log q - log p) over them (0 where none is)."""
    ids, lq = teacher.ids.long(), teacher.logprobs.to(logp_all.dtype)
    given = (ids != -1) & (lq != float("-inf")) & (ids >= 0) & (ids < logp_all.shape[-1])
    hit = given & (ids[:, :, None] == top_ids[:, None, :]).any(-1)
    lps = logp_all.detach().gather(-1, torch.where(given, ids, 0))
    lq = torch.where(given, lq, 0.0)
    clamp = spec.distillation.log_prob_min_clamp
    if clamp is not None:
        lps, lq = lps.clamp_min(clamp), lq.clamp_min(clamp)
    count = hit.sum(-1).to(logp_all.dtype)
    advantage = torch.where(hit, -(lq.exp() * (lq - lps)), 0.0).sum(-1) / count.clamp_min(1.0)
    return {"count": count, "advantage": advantage}


class _Sparse(NamedTuple):
    """A top-k teacher's ids and log-probs [rows, K], or a per-token teacher's log-probs [rows] (ids None)."""

    ids: torch.Tensor | None
    logprobs: torch.Tensor


def _targets(targets, x, ignore_index: int, loss_mask):
    """(targets in range, the rows that count, NaN at a counted row whose target is out of range -- like
    the kernel, not an IndexError -- else 0) of the [rows, V] logits ``x``."""
    rows, vocab = x.shape
    if targets is None:
        y_raw = torch.zeros(rows, dtype=torch.long, device=x.device)
        valid = torch.ones(rows, dtype=torch.bool, device=x.device)
    else:
        y_raw = targets.reshape(-1).long()
        valid = y_raw != ignore_index
        if loss_mask is not None:
            valid = valid & loss_mask.reshape(-1).bool()
    in_range = (y_raw >= 0) & (y_raw < vocab)
    return torch.where(valid & in_range, y_raw, 0), valid, torch.where(valid & ~in_range, float("nan"), 0.0).to(x.dtype)


def _metrics(per_term, distill_rows, logp_y, pred, y, valid, count, spec: LossSpec) -> dict:
    """The rows' metrics: each term's token mean, nll, accuracy, the distillation's (after the loss and the
    policy's; headloss.plan.METRIC_ORDER orders them)."""
    metrics: dict[str, torch.Tensor] = {}
    for name, values in per_term.items():
        metrics[name] = (torch.where(valid, values, 0.0).sum() / count).detach()
    if spec.cross_entropy is not None and spec.cross_entropy.label_smoothing > 0:
        metrics["nll"] = (-logp_y.sum() / count).detach()
    if spec.token_accuracy:
        metrics["token_accuracy"] = (((pred == y) & valid).to(count.dtype).sum() / count).detach()
    for name, values in distill_rows.items():
        metrics[name] = (torch.where(valid, values.to(count.dtype), 0.0).sum() / count).detach()
    return metrics


def _terms(x, logp_all, lse, y, valid, nan_if_bad, spec: LossSpec, teacher):
    """(token loss, each term's per-token values, the entropy or None, the distillation's per-row
    metrics) of the transformed logits ``x`` [rows, V]; ``teacher``: its logits, or a sparse teacher
    (:class:`_Sparse`, per row)."""
    vocab = x.shape[-1]
    # an empty slice's sum: zeros that still hang off the logits, so a spec with no loss term
    # backpropagates zero gradients (as the kernel path does) instead of raising
    token_loss = x[:, :0].sum(-1)
    per_term: dict[str, torch.Tensor] = {}

    if spec.cross_entropy is not None:
        ce = F.cross_entropy(
            x, torch.where(valid, y, -100), reduction="none", ignore_index=-100,
            label_smoothing=spec.cross_entropy.label_smoothing,
        ) + nan_if_bad
        per_term["ce"] = ce
        token_loss = token_loss + spec.cross_entropy.weight * ce
    if spec.z_loss is not None:
        per_term["z_loss"] = lse**2
        token_loss = token_loss + spec.z_loss.weight * lse**2
    if spec.dft is not None:
        # dynamic fine-tuning: the target's log-prob weighted by its own probability, held constant
        logp_target = torch.where(valid, logp_all.gather(-1, y[:, None])[:, 0] + nan_if_bad, 0.0)
        dft = -logp_target.detach().exp() * logp_target
        per_term["dft"] = dft
        token_loss = token_loss + spec.dft.weight * dft
    entropy = None
    if spec.entropy is not None or "entropy" in spec.outputs:
        probs = logp_all.exp()
        entropy = -(probs * torch.where(probs > 0, logp_all, 0.0)).sum(-1)
        if spec.entropy is not None:
            per_term["entropy"] = entropy
            token_loss = token_loss + spec.entropy.weight * entropy
    distill_rows: dict[str, torch.Tensor] = {}
    d = spec.distillation
    if d is not None and d.teacher == "topk":
        div, distill_rows = topk_distillation(x, lse, teacher.ids, teacher.logprobs, d)
    elif d is not None and d.teacher == "token":
        logp_target = torch.where(valid, logp_all.gather(-1, y[:, None])[:, 0] + nan_if_bad, 0.0)
        div = estimator(logp_target, teacher.logprobs.to(x.dtype), d)
    elif d is not None:
        div, distill_rows = _distillation(x, teacher.reshape(-1, vocab).to(x.dtype), spec)
    if d is not None:
        per_term["distill/divergence"] = div
        token_loss = token_loss + spec.distillation.weight * div * (
            spec.distillation.temperature**2 if spec.distillation.scale_by_temperature_squared else 1.0
        )
    return token_loss, per_term, entropy, distill_rows


def _reduced(token_loss, count, spec: LossSpec, num_items_in_batch, token_shape):
    """The loss of the per-token losses under the spec's reduction (and normaliser)."""
    if spec.reduction == "none":
        return token_loss.reshape(token_shape).clone()  # a tensor of its own, as on the kernel path
    if spec.reduction == "sum":
        return token_loss.sum()
    if num_items_in_batch is not None:
        return token_loss.sum() / torch.as_tensor(num_items_in_batch, dtype=count.dtype, device=token_loss.device)
    return token_loss.sum() / count


class _OneBackward(torch.autograd.Function):
    """The kernel path's fused mode computes its gradient once, in forward: a second backward
    through its loss raises. The reference keeps the same promise (headloss.engine's guard)."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, d_loss):
        guard_second_backward(ctx)
        return d_loss


def _check_values(targets, vocab: int, ignore_index: int, num_items, sequence_ids, loss_mask=None) -> None:
    """The kernel path's device-side checks, on the host (the reference syncs freely), or as a
    device-side assert under torch.compile."""
    targets = targets.long()  # (a narrow dtype would wrap the bounds: uint8 >= 300 is >= 44)
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if isinstance(loss_mask, torch.Tensor) and loss_mask.dtype != torch.bool:
        not_binary = (loss_mask != 0) & (loss_mask != 1)
        targets = torch.where(not_binary, NOT_BINARY, targets)  # its error names loss_mask
        bad = bad | not_binary
    bad_items = None
    if isinstance(num_items, torch.Tensor):
        n = num_items.reshape(()).double()
        bad_items = ~((n > 0) & (n < float("inf")))
    bad_ids = None
    if isinstance(sequence_ids, torch.Tensor) and sequence_ids.numel():  # (packed rows: derived, in range)
        bad_ids = ((sequence_ids < 0) | (sequence_ids >= sequence_ids.numel())).any()
    if torch.compiler.is_compiling():
        ok = ~bad.any()
        for flag in (bad_items, bad_ids):
            if flag is not None:
                ok = ok & ~flag
        torch._assert_async(ok, "headloss: a target outside [0, V), a num_items_in_batch that is not positive, "
                                "a sequence id out of range, or a loss_mask value neither 0 nor 1")
        return
    where = -1
    value = 0
    if bool(bad.any()):
        where = int(bad.reshape(-1).nonzero()[0, 0])
        value = int(targets.reshape(-1)[where])
    flags = [int(bool(f)) if f is not None else 0 for f in (bad_items, bad_ids)]
    raise_if_bad([where, value, *flags], tuple(targets.shape), vocab, ignore_index,
                 Normaliser(0.0, num_items if isinstance(num_items, torch.Tensor) else None))


def _distillation(x: torch.Tensor, teacher: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, dict]:
    """Per-row divergence, and the teacher metrics, the way TRL's generalized_jsd_loss writes it."""
    d = spec.distillation
    s_logp = torch.log_softmax(x / d.temperature, dim=-1)
    t_logp = torch.log_softmax(teacher / d.temperature, dim=-1)
    with torch.no_grad():
        teacher_entropy = -torch.where(t_logp == float("-inf"), 0.0, t_logp.exp() * t_logp).sum(-1)
    # a column that both hold at -inf (a masked vocabulary) adds nothing: a finite stand-in there keeps
    # -inf - -inf (NaN) out of the values and of their gradients
    both = (s_logp == float("-inf")) & (t_logp == float("-inf"))
    s_logp, t_logp = torch.where(both, 0.0, s_logp), torch.where(both, 0.0, t_logp)

    def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
        """KL(p || q) = sum p (log p - log q), 0 where p = 0 (a masked -inf column); NaN stays NaN."""
        skip = both | (log_p == float("-inf"))
        log_p, log_q = torch.where(skip, 0.0, log_p), torch.where(skip, 0.0, log_q)
        return torch.where(skip, 0.0, log_p.exp() * (log_p - log_q)).sum(-1)

    if d.divergence == "forward_kl" or (d.divergence == "jsd" and d.beta == 0.0):
        div = kl(t_logp, s_logp)
    elif d.divergence == "reverse_kl" or (d.divergence == "jsd" and d.beta == 1.0):
        div = kl(s_logp, t_logp)
    else:
        log_mix = torch.logsumexp(
            torch.stack([s_logp + math.log(1.0 - d.beta), t_logp + math.log(d.beta)]), dim=0
        )
        div = d.beta * kl(t_logp, log_mix) + (1.0 - d.beta) * kl(s_logp, log_mix)
    with torch.no_grad():
        agreement = (x.argmax(-1) == teacher.argmax(-1)).to(x.dtype)
    return div, {"distill/teacher_entropy": teacher_entropy, "distill/top1_agreement": agreement}


def _check_probabilities(probs: torch.Tensor) -> None:
    """A teacher given as probabilities: every row sums to 1 within MASS_TOLERANCE (a negative or NaN
    probability fails it too), named as the kernels' verdict names it."""
    mass = probs.double().sum(-1)
    bad = ~((mass >= 1.0 - MASS_TOLERANCE) & (mass <= 1.0 + MASS_TOLERANCE)) | (probs < 0).any(-1)
    if torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), "headloss: a teacher_probs row that does not sum to 1")
        return
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0, 0])
        raise_teacher(first * TEACHER_KEY.N + TEACHER_KEY.mass, CheckContext(tuple(bad.shape), probs.shape[-1], -100))
