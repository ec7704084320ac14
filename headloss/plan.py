"""spec (+ which inputs are present) -> KernelPlan. The only place that maps a spec to kernel flags.

A plan has two halves:

* ``flags`` -- structure, passed to the kernel as ``tl.constexpr``: which statistics the stats
  pass accumulates, which per-row values are stored, whether the gradient pass runs. One
  distinct ``flags`` value is one compiled kernel variant.
* ``scalars`` -- values (weights, smoothing, temperature, ...), passed as runtime arguments, so
  a new weight or temperature reuses the compiled variant.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Literal

from .spec import LossSpec

Mode = Literal["fused", "deferred"]


@dataclass(frozen=True)
class KernelFlags:
    """Constexpr structure of one head-kernel variant (field names are the kernel's)."""

    HAS_TARGETS: bool  # targets given: ignore_index masks rows, x[y] is loaded
    HAS_CE: bool  # cross-entropy term present
    HAS_SMOOTHING: bool  # label smoothing > 0: needs sum(x)
    HAS_Z: bool  # z-loss term present
    HAS_ENTROPY: bool  # entropy computed: needs sum(e * x)
    HAS_ENTROPY_GRAD: bool  # entropy carries gradient (weight != 0 or differentiable output)
    HAS_ARGMAX: bool  # running argmax (token accuracy, predicted tokens)
    STORE_LOGP: bool  # per-row log p(target)
    HAS_SOFTCAP: bool  # c * tanh(u / c) in the transform
    FUSED_GRAD: bool  # gradient pass in the forward launch (fused mode)
    HAS_POLICY: bool  # token-level policy objective in the epilogue (fused with the other terms)
    HAS_OLD: bool  # old_logprobs given (else on-policy: ratio 1 with gradient)
    HAS_IW: bool  # rollout importance weights given
    KL_EST: int  # policy KL penalty: 0 none, 1 k1, 2 k2, 3 k3
    KL_IS_CORR: bool  # KL times the importance ratio
    HAS_TEACHER: bool  # distillation: teacher logits are read in both passes
    DISTILL_KIND: int  # 0 forward KL, 1 reverse KL, 2 mixture JSD (an extra pass)
    OWN_TEMP: bool  # distillation temperature != 1: the student's softmax at T_d is its own

    def as_kwargs(self) -> dict[str, bool | int]:
        """The flags as kernel keyword arguments (a fresh dict; built per launch, kept cheap)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class KernelScalars:
    """Runtime values of a plan: changing one never recompiles."""

    ignore_index: int
    w_ce: float
    smoothing: float
    w_z: float
    w_entropy: float
    logit_scale: float
    softcap: float
    inv_temperature: float
    w_distill: float  # weight (x T**2 when scaled)
    inv_distill_temp: float
    jsd_beta: float
    eps_low: float
    eps_high: float
    pol_delta: float  # inf when off
    dual_c: float  # inf when off
    kl_beta: float
    entropy_coef: float


    def as_args(self) -> tuple:
        """The scalars in the kernels' argument order (the dataclass is declared in that order)."""
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class KernelPlan:
    """What one call runs: mode, kernel variant, runtime scalars, and what it reads and writes."""

    mode: Mode
    flags: KernelFlags
    scalars: KernelScalars
    reduction: str
    requires: tuple[str, ...]  # inputs the call must provide

    @property
    def logit_passes(self) -> int:
        """Full reads of the logits: the stats pass, plus the gradient pass when there is one."""
        return 2 if self.flags.FUSED_GRAD or self.mode == "deferred" else 1

    def traffic_bytes(self, rows: int, vocab: int, elem_bytes: int, grad_bytes: int, with_grad: bool) -> dict:
        """Bytes moved through device memory by the logits-sized streams of one fwd(+bwd) call
        (the teacher, when there is one, is read in the same passes as the student)."""
        passes = (self.logit_passes if with_grad else 1) + (self.flags.DISTILL_KIND == 2 and self.flags.HAS_TEACHER)
        streams = 2 if self.flags.HAS_TEACHER else 1
        reads = passes * streams * rows * vocab * elem_bytes
        writes = rows * vocab * grad_bytes if with_grad else 0
        return {"logit_reads": reads, "grad_writes": writes, "total": reads + writes}


@functools.lru_cache(maxsize=256)
def compile_plan(
    spec: LossSpec,
    *,
    has_targets: bool = True,
    needs_grad: bool = True,
    has_old_logprobs: bool = False,
    has_importance_weights: bool = False,
) -> KernelPlan:
    """Map a spec to a kernel plan. Cached: the same spec and inputs give the same plan object."""
    ce, z, ent, dist, pol = spec.cross_entropy, spec.z_loss, spec.entropy, spec.distillation, spec.policy
    if spec.needs_targets and not has_targets:
        wanted = [
            name
            for name, on in (
                ("cross_entropy", ce is not None),
                ("token_accuracy", spec.token_accuracy),
                ("outputs: logprobs", "logprobs" in spec.outputs),
                ("policy", pol is not None),
            )
            if on
        ]
        raise ValueError(f"targets: required by {', '.join(wanted)} but not given")

    # a token-level policy objective is row-local: the kernel's epilogue computes it (fused mode).
    # Sequence-level ratios need other rows: the objective runs in torch on the deferred mode's
    # per-token log-probs, whose gradient the backward kernel turns into the logits' gradient
    sequence_policy = pol is not None and pol.importance_sampling == "sequence"
    deferred = spec.reduction == "none" or spec.differentiable_outputs or sequence_policy
    fused_policy = pol is not None and not deferred
    wants_entropy = ent is not None or "entropy" in spec.outputs or pol is not None
    entropy_grad = wants_entropy and (
        (ent is not None and ent.weight != 0.0)
        or (spec.differentiable_outputs and "entropy" in spec.outputs)
        or (pol is not None and pol.entropy_coef != 0.0)
    )
    flags = KernelFlags(
        HAS_TARGETS=has_targets,
        HAS_CE=ce is not None,
        HAS_SMOOTHING=ce is not None and ce.label_smoothing > 0.0,
        HAS_Z=z is not None,
        HAS_ENTROPY=wants_entropy,
        HAS_ENTROPY_GRAD=entropy_grad,
        # with a teacher the argmax feeds the teacher-agreement metric
        HAS_ARGMAX=spec.token_accuracy or "predicted_tokens" in spec.outputs or dist is not None,
        STORE_LOGP=has_targets and (ce is not None or "logprobs" in spec.outputs or pol is not None),
        HAS_SOFTCAP=spec.transform.softcap is not None,
        FUSED_GRAD=needs_grad and not deferred,
        HAS_POLICY=fused_policy,
        HAS_OLD=fused_policy and has_old_logprobs,
        HAS_IW=fused_policy and has_importance_weights,
        KL_EST=("k1", "k2", "k3").index(pol.kl_estimator) + 1 if fused_policy and pol.kl_beta != 0.0 else 0,
        KL_IS_CORR=fused_policy and pol.kl_importance_correction,
        HAS_TEACHER=dist is not None,
        DISTILL_KIND=dist.kind if dist is not None else 0,
        OWN_TEMP=dist is not None and dist.temperature != 1.0,
    )
    t = spec.transform
    scalars = KernelScalars(
        ignore_index=spec.ignore_index,
        w_ce=ce.weight if ce is not None else 0.0,
        smoothing=ce.label_smoothing if ce is not None else 0.0,
        w_z=z.weight if z is not None else 0.0,
        w_entropy=ent.weight if ent is not None else 0.0,
        logit_scale=t.logit_scale,
        softcap=t.softcap if t.softcap is not None else 1.0,
        inv_temperature=1.0 / t.temperature,
        w_distill=(dist.weight * (dist.temperature**2 if dist.scale_by_temperature_squared else 1.0))
        if dist is not None else 0.0,
        inv_distill_temp=1.0 / dist.temperature if dist is not None else 1.0,
        jsd_beta=dist.beta if dist is not None else 0.0,
        eps_low=pol.eps_low if pol is not None else 0.0,
        eps_high=pol.eps_high if pol is not None else 0.0,
        pol_delta=pol.delta if pol is not None and pol.delta is not None else float("inf"),
        dual_c=pol.dual_clip_c if pol is not None and pol.dual_clip_c is not None else float("inf"),
        kl_beta=pol.kl_beta if pol is not None else 0.0,
        entropy_coef=pol.entropy_coef if pol is not None else 0.0,
    )
    requires = ("logits", "targets") if spec.needs_targets else ("logits",)
    if dist is not None:
        requires += ("teacher_logits",)
    if pol is not None:
        requires += ("advantages",) + (("ref_logprobs",) if pol.kl_beta != 0.0 else ())
    return KernelPlan(
        mode="deferred" if deferred else "fused",
        flags=flags,
        scalars=scalars,
        reduction=spec.reduction,
        requires=requires,
    )
