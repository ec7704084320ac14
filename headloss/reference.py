"""Plain-torch reference: term by term, differentiable through autograd.

Written from the definitions, not from the kernel: log_softmax, torch's own cross-entropy with
label smoothing, an explicit entropy. It is the test oracle (run it in float64) and the CPU path
when the Triton interpreter is off. Same inputs and same output type as :func:`headloss.head_loss`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .output import HeadLossOutput
from .spec import LossSpec


def transformed_logits(logits: torch.Tensor, spec: LossSpec, dtype: torch.dtype) -> torch.Tensor:
    """softcap(logit_scale * z) / temperature, computed in ``dtype``."""
    t = spec.transform
    x = logits.to(dtype) * t.logit_scale
    if t.softcap is not None:
        x = t.softcap * torch.tanh(x / t.softcap)
    return x / t.temperature


def reference_head_loss(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    spec: LossSpec,
    *,
    teacher_logits: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
) -> HeadLossOutput:
    """Reference for :func:`headloss.head_loss`; math in ``compute_dtype`` (default: fp32,
    or fp64 for fp64 logits). Gradients flow through autograd to ``logits``."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    token_shape = logits.shape[:-1]
    vocab = logits.shape[-1]
    x = transformed_logits(logits, spec, compute_dtype).reshape(-1, vocab)
    rows = x.shape[0]
    if targets is None:
        y_raw = torch.zeros(rows, dtype=torch.long, device=logits.device)
        valid = torch.ones(rows, dtype=torch.bool, device=logits.device)
    else:
        y_raw = targets.reshape(-1).long()
        valid = y_raw != spec.ignore_index
    # unvalidated out-of-range targets give NaN in their rows, like the kernel, not an IndexError
    in_range = (y_raw >= 0) & (y_raw < vocab)
    y = torch.where(valid & in_range, y_raw, 0)
    nan_if_bad = torch.where(valid & ~in_range, float("nan"), 0.0).to(compute_dtype)

    logp_all = torch.log_softmax(x, dim=-1)
    lse = torch.logsumexp(x, dim=-1)
    zero = torch.zeros(rows, dtype=compute_dtype, device=logits.device)
    token_loss = zero
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
    entropy = None
    if spec.entropy is not None or "entropy" in spec.outputs:
        probs = logp_all.exp()
        entropy = -(probs * torch.where(probs > 0, logp_all, 0.0)).sum(-1)
        if spec.entropy is not None:
            per_term["entropy"] = entropy
            token_loss = token_loss + spec.entropy.weight * entropy
    distill_rows: dict[str, torch.Tensor] = {}
    if spec.distillation is not None:
        div, distill_rows = _distillation(x, teacher_logits.reshape(-1, vocab).to(compute_dtype), spec)
        per_term["distill/divergence"] = div
        token_loss = token_loss + spec.distillation.weight * div * (
            spec.distillation.temperature**2 if spec.distillation.scale_by_temperature_squared else 1.0
        )
    token_loss = torch.where(valid, token_loss, 0.0)

    n_valid = valid.sum()
    count = n_valid.clamp(min=1).to(compute_dtype)
    if spec.reduction == "none":
        loss = token_loss.reshape(token_shape)
    elif spec.reduction == "sum":
        loss = token_loss.sum()
    elif num_items_in_batch is not None:
        loss = token_loss.sum() / torch.as_tensor(num_items_in_batch, dtype=compute_dtype, device=x.device)
    else:
        loss = token_loss.sum() / count

    metrics: dict[str, torch.Tensor] = {"loss": (loss.sum() if spec.reduction == "none" else loss).detach()}
    for name, values in per_term.items():
        metrics[name] = (torch.where(valid, values, 0.0).sum() / count).detach()
    logp_y = torch.where(valid, logp_all.gather(-1, y[:, None])[:, 0] + nan_if_bad, 0.0)
    if spec.cross_entropy is not None and spec.cross_entropy.label_smoothing > 0:
        metrics["nll"] = (-logp_y.sum() / count).detach()
    pred = torch.where(valid, x.argmax(-1), -1)
    if spec.token_accuracy:
        metrics["token_accuracy"] = (((pred == y) & valid).to(compute_dtype).sum() / count).detach()
    for name, values in distill_rows.items():
        metrics[name] = (torch.where(valid, values.to(compute_dtype), 0.0).sum() / count).detach()
    metrics["n_tokens"] = n_valid.detach()

    out_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32

    def per_token(name: str, value: torch.Tensor) -> torch.Tensor | None:
        if name not in spec.outputs:
            return None
        value = value.reshape(token_shape)
        if value.is_floating_point():
            value = value.to(out_dtype)
        return value if spec.differentiable_outputs else value.detach()

    return HeadLossOutput(
        loss=loss.to(out_dtype),
        metrics={k: (v.to(out_dtype) if v.is_floating_point() else v) for k, v in metrics.items()},
        predicted_tokens=per_token("predicted_tokens", pred),
        logprobs=per_token("logprobs", logp_y),
        lse=per_token("lse", torch.where(valid, lse, 0.0)),
        token_loss=per_token("token_loss", token_loss),
        entropy=per_token("entropy", torch.where(valid, entropy, 0.0)) if entropy is not None else None,
    )


def _distillation(x: torch.Tensor, teacher: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, dict]:
    """Per-row divergence, and the teacher metrics, the way TRL's generalized_jsd_loss writes it."""
    d = spec.distillation
    s_logp = torch.log_softmax(x / d.temperature, dim=-1)
    t_logp = torch.log_softmax(teacher / d.temperature, dim=-1)
    kl = lambda log_p, log_q: F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # KL(p || q)
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
        teacher_entropy = -(t_logp.exp() * t_logp).sum(-1)
        agreement = (x.argmax(-1) == teacher.argmax(-1)).to(x.dtype)
    return div, {"distill/teacher_entropy": teacher_entropy, "distill/top1_agreement": agreement}
