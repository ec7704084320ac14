"""verl's distillation through headloss (docs/distillation.md): :func:`forward_kl_topk`, verl's top-k
step (``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``) without the [B, T, V]
log-softmax, and :func:`distillation_loss_fn`, verl's single-sample estimator losses with headloss's
estimators; :func:`install_distillation` puts them in verl's place (headloss.integrations.verl.install
calls it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..api import head_loss
from ..bounded import memoize
from ..policy.objectives import kl_estimate
from ..spec import VERL_ESTIMATORS, Distillation, LossSpec, Policy


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """A key of a verl config: a dataclass (BaseConfig), an omegaconf DictConfig or a dict."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except (AttributeError, KeyError, TypeError):
            pass
    return getattr(config, key, default)



DISTILLATION_ESTIMATORS: dict[str, tuple[str, bool, str]] = {  # verl loss_mode -> (estimator, clamp, grad)
    **{name: (estimator, clamp, "estimator") for name, (estimator, clamp) in VERL_ESTIMATORS.items()},
    **{f"{name}+": (estimator, clamp, "k2") for name, (estimator, clamp) in VERL_ESTIMATORS.items()
       if estimator != "k2"},
}
"""verl's single-sample distillation losses (``kl_penalty``'s names, ``+``: the k2 gradient) as
headloss's per-token estimator (``spec.Distillation(teacher="token")``'s fields)."""


OVERLAP_TOPK = 64
"""The largest teacher K whose overlap diagnostics forward_kl_topk returns (the student's top-k in the pass,
``student_topk``, goes to 64); above it they are left out, as verl's consumer allows. 0: always left out,
and the pass keeps no top-k (at K 64 it costs the pass most of its time: docs/performance.md)."""


@memoize("verl.topk_spec", 64, "verl's top-k distillation spec by log_prob_min_clamp and the overlap's k")
def _topk_spec(log_prob_min_clamp: float | None, overlap_k: int | None) -> LossSpec:
    return LossSpec(cross_entropy=None, reduction="none",
                    outputs=("lse", "overlap_count", "overlap_token_advantage") if overlap_k else ("lse",),
                    student_topk=overlap_k,
                    distillation=Distillation(teacher="topk", topk="verl", log_prob_min_clamp=log_prob_min_clamp))


def forward_kl_topk(student_logits: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    teacher_topk_ids: torch.Tensor, config: Any, data_format: str = "thd") -> dict[str, torch.Tensor]:
    """verl's ``compute_forward_kl_topk`` (FSDP) by headloss: the same inputs (nested teacher tensors
    [bsz, seqlen, K] sliced for Ulysses sequence parallelism as verl slices them) and outputs, each
    [bsz, seqlen]: ``distillation_losses`` (sum_k q_k (log q_k - log p_k), with verl's
    ``log_prob_min_clamp``, already clamped at 0 as verl's loss then clamps it), ``student_mass``,
    ``teacher_mass``, and verl's overlap diagnostics: ``overlap_count`` (how many of the teacher's K ids
    are among the student's own top K) and ``overlap_token_advantage`` (the mean of -q_k (log q_k -
    log p_k) over those, 0 where none is). One pass over the logits, which also keeps the student's top K
    (``student_topk``; no [B, T, V] log-softmax or sort), its gradient in backward. With K above
    OVERLAP_TOPK (64) the two diagnostics are left out, and verl then logs no overlap metrics. The
    student's top-k costs the pass most of its time at K 64 (docs/performance.md)."""
    lp, ids = teacher_topk_log_probs, teacher_topk_ids
    if lp.is_nested:
        lp, ids = lp.values().unsqueeze(0), ids.values().unsqueeze(0)
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    if get_ulysses_sequence_parallel_world_size() > 1:
        lp, ids = slice_input_tensor(lp, dim=1), slice_input_tensor(ids, dim=1)
    if lp.shape[:2] != student_logits.shape[:2] or ids.shape != lp.shape:
        raise ValueError(f"teacher_topk_log_probs: shape {tuple(lp.shape)} (ids {tuple(ids.shape)}) does not match "
                         f"the student's rows {tuple(student_logits.shape[:2])}")
    clamp = config_value(config_value(config, "distillation_loss"), "log_prob_min_clamp")
    clamp = None if clamp is None else float(clamp)
    k = ids.shape[-1]
    overlap_k = k if 0 < k <= min(OVERLAP_TOPK, student_logits.shape[-1]) else None
    out = head_loss(student_logits, None, _topk_spec(clamp, overlap_k), teacher_ids=ids, teacher_logprobs=lp)
    with torch.no_grad():
        given = ids >= 0
        picked = student_logits.detach().gather(-1, ids.clamp(min=0)).float() - out.lse[..., None]
        student_mass = torch.where(given, picked.exp(), 0.0).sum(-1)
        teacher_mass = torch.where(given, lp.float().exp(), 0.0).sum(-1)
        result = {"distillation_losses": out.loss, "student_mass": student_mass, "teacher_mass": teacher_mass}
        if overlap_k is not None:  # (the kernel's, from the student's top-k kept in the pass)
            result.update(overlap_count=out.overlap_count, overlap_token_advantage=out.overlap_token_advantage)
    return result


def distillation_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """verl's single-sample estimator loss ``loss_mode`` (``DISTILLATION_ESTIMATORS``) by headloss, with
    ``register_distillation_loss``'s signature ``(config, distillation_config, model_output, data) ->
    (per-token losses, metrics)``: the student's log-probs (``model_output["log_probs"]``) against the
    teacher's (``data["teacher_logprobs"]``), and verl's ``distillation/abs_loss``."""
    if loss_mode not in DISTILLATION_ESTIMATORS:
        raise ValueError(f"loss_mode: headloss runs {sorted(DISTILLATION_ESTIMATORS)}, got {loss_mode!r}")
    estimator, clamp, grad = DISTILLATION_ESTIMATORS[loss_mode]
    policy = Policy(kl_estimator=estimator, kl_clamp=clamp, kl_grad=grad)

    def compute_distillation_loss(config: Any, distillation_config: Any, model_output: dict, data: Any):
        from verl.utils.metric import AggregationType, Metric
        from verl.workers.utils.padding import no_padding_2_padding

        student = no_padding_2_padding(model_output["log_probs"], data)
        teacher = no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1)
        mask = data["response_mask"]
        mask = mask.bool().to_padded_tensor(False) if mask.is_nested else mask.bool()
        if teacher.shape != student.shape or mask.shape != student.shape:
            raise ValueError(f"teacher_logprobs: shape {tuple(teacher.shape)} does not match the student's "
                             f"log-probs {tuple(student.shape)} and the response mask {tuple(mask.shape)}")
        losses = kl_estimate(student, teacher, policy)
        return losses, {"distillation/abs_loss": Metric(AggregationType.MEAN, losses[mask].abs().mean())}

    compute_distillation_loss.__name__ = compute_distillation_loss.__qualname__ = f"headloss_{loss_mode}"
    compute_distillation_loss.__doc__ = f"verl's {loss_mode!r} distillation loss, computed by headloss."
    return compute_distillation_loss


def register_distillation_losses() -> list[str]:
    """Register each of verl's estimator losses as ``headloss_<name>`` (verl's registry refuses a name
    twice: names already there are left as they are); returns the names registered now."""
    from verl.trainer.distillation import losses

    names = []
    for mode in DISTILLATION_ESTIMATORS:
        name = f"headloss_{mode}"
        if name in losses.DISTILLATION_LOSS_REGISTRY:
            continue
        settings = losses.DistillationLossSettings(names=[name], use_estimator=True)
        losses.register_distillation_loss(settings)(distillation_loss_fn(mode))
        names.append(name)
    return names


def install_distillation() -> None:
    """verl's FSDP top-k step (``compute_forward_kl_topk``, which verl looks up on its module at each
    call) becomes :func:`forward_kl_topk`; the estimator losses are registered. Idempotent."""
    import importlib

    try:
        fsdp_losses = importlib.import_module("verl.trainer.distillation.fsdp.losses")
    except ImportError:  # a verl without distillation
        return
    fsdp_losses.compute_forward_kl_topk = forward_kl_topk
    register_distillation_losses()
