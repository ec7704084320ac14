"""Public entry points: :func:`head_loss` and :class:`HeadLoss`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch

from .autograd import DeferredHead, ExecOptions, FusedHead
from .kernels.head import RowStats
from .output import HeadLossOutput
from .plan import compile_plan
from .policy import PolicyInputs, policy_inputs, policy_metrics_of, policy_objective
from .reference import reference_head_loss
from .spec import LossSpec

Backend = Literal["auto", "triton", "reference"]
SpecLike = LossSpec | dict[str, Any] | str | Path

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def validation_default() -> bool:
    """Target validation is on unless HEADLOSS_VALIDATE=0 (e.g. under CUDA graphs)."""
    return os.environ.get("HEADLOSS_VALIDATE", "1") != "0"


def head_loss(
    logits: torch.Tensor,
    targets: torch.Tensor | None = None,
    spec: SpecLike | None = None,
    *,
    teacher_logits: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    inplace_grad: bool = False,
    validate: bool | None = None,
    backend: Backend = "auto",
) -> HeadLossOutput:
    """Every loss, metric and per-token output of ``spec`` from one pass over ``logits``.

    Args:
        logits: [N, V] or [B, T, V], fp32/bf16/fp16; rows may be strided, the vocabulary
            dimension must have stride 1.
        targets: [N] or [B, T] integer ids in [0, V) or ``spec.ignore_index``. Optional when
            no requested value needs them (e.g. entropy only): then every row counts.
        spec: a :class:`LossSpec`, a dict, or a YAML/JSON path (default: mean cross-entropy).
        teacher_logits: same shape as ``logits`` (any float dtype), for the distillation term.
            Read only; no gradient flows into it.
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, sequence_ids:
            the policy term's inputs (see :class:`headloss.spec.Policy`); per-token tensors are
            shaped like the targets, advantages [B] or like the targets, sequence_ids [N] for
            [N, V] logits. Tokens outside ``loss_mask`` are skipped by every term.
        num_items_in_batch: with ``reduction="mean"``, divide the summed loss by this instead
            of the number of non-ignored tokens (HF gradient accumulation). Tensor or number.
        inplace_grad: write d loss / d logits over ``logits`` (saves N*V memory). The logits
            are then destroyed: nothing else may use them afterwards.
        validate: check targets are in range: one host wait, for a check launched before the
            kernel, while the kernel runs; default on, off with ``validate=False`` or the environment variable
            ``HEADLOSS_VALIDATE=0`` (CUDA graphs, overlap). Unchecked out-of-range targets give
            NaN in their rows, never an out-of-bounds read. With ``inplace_grad`` the logits
            are already overwritten when the error is raised.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"``
            (plain torch), or ``"auto"``: triton on CUDA or under the interpreter, else reference.

    Returns:
        :class:`HeadLossOutput`. NaN or +inf logits give NaN loss and gradient in their rows;
        -inf logits (a masked vocabulary) are fine unless the target itself is -inf.
    """
    spec = LossSpec() if spec is None else LossSpec.coerce(spec)
    check_inputs(logits, targets, spec, num_items_in_batch)
    check_teacher(logits, teacher_logits, spec)
    if teacher_logits is not None:
        teacher_logits = teacher_logits.detach()
    if targets is not None and targets.dtype not in (torch.int64, torch.int32):
        targets = targets.long()  # narrow ints cannot hold ignore_index=-100 (uint8 wraps it to 156)
    validate = validation_default() if validate is None else validate
    given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask,
                 importance_weights=importance_weights, sequence_ids=sequence_ids)
    policy, policy_targets = policy_inputs(
        spec.policy, logits.shape[:-1], targets, spec.ignore_index, num_items_in_batch, validate, given
    )
    vocab = logits.shape[-1]
    if resolve_backend(backend, logits) == "reference":
        if validate and targets is not None and bool(targets_out_of_range(targets, vocab, spec.ignore_index)):
            raise target_range_error(targets, vocab, spec.ignore_index)
        return reference_head_loss(
            logits, targets, spec, teacher_logits=teacher_logits, num_items_in_batch=num_items_in_batch,
            **{k: v for k, v in given.items() if v is not None},
        )
    check = RangeCheck(targets, vocab, spec.ignore_index) if validate and targets is not None else None
    out = _triton_head_loss(
        logits, policy_targets, teacher_logits, policy, spec, num_items_in_batch, ExecOptions(inplace_grad)
    )
    if check is not None:
        check.raise_if_bad()
    return out


class RangeCheck:
    """Target validation that costs one wait but no idle GPU.

    The check's verdict is copied to pinned host memory and an event is recorded right after
    it, *before* the head kernel is launched; :meth:`raise_if_bad`, called once everything is
    launched, waits for that event only, so the GPU runs the head kernel while the host waits.
    The kernel never reads out of bounds meanwhile (such rows come out NaN).
    """

    def __init__(self, targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
        self.args = (targets, vocab, ignore_index)
        bad = targets_out_of_range(targets, vocab, ignore_index)
        if targets.is_cuda:
            self.verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.verdict.copy_(bad, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.verdict, self.ready = bad, None

    def raise_if_bad(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
        if bool(self.verdict):
            raise target_range_error(*self.args)


class HeadLoss(torch.nn.Module):
    """Module form of :func:`head_loss`: ``HeadLoss(spec)(logits, targets)``."""

    def __init__(
        self,
        spec: SpecLike | None = None,
        *,
        inplace_grad: bool = False,
        validate: bool | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        self.spec = LossSpec() if spec is None else LossSpec.coerce(spec)
        self.inplace_grad = inplace_grad
        self.validate = validate
        self.backend = backend

    def forward(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor | None = None,
        **inputs: Any,
    ) -> HeadLossOutput:
        """``inputs``: the per-call inputs of :func:`head_loss` (teacher_logits, num_items_in_batch, ...)."""
        return head_loss(
            logits, targets, self.spec,
            **inputs,
            inplace_grad=self.inplace_grad,
            validate=self.validate,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"


# --- checks -----------------------------------------------------------------------------------


def check_inputs(
    logits: Any,
    targets: Any,
    spec: LossSpec,
    num_items_in_batch: Any = None,
) -> None:
    """Shape, dtype and device checks; no device data is read."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype (float32, bfloat16, float16), got {logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: the vocabulary dimension V is 0")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits: the vocabulary dimension must have stride 1, got strides {logits.stride()}; "
            "pass logits.contiguous()"
        )
    if targets is None:
        if spec.needs_targets:
            compile_plan(spec, has_targets=False)  # raises, naming what needs them
    else:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets: expected a torch.Tensor, got {type(targets).__name__}")
        if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"targets: shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)} "
                f"(expected {tuple(logits.shape[:-1])})"
            )
        if targets.device != logits.device:
            raise ValueError(f"targets: on {targets.device}, logits on {logits.device}")
    if num_items_in_batch is not None:
        if spec.reduction != "mean":
            raise ValueError(
                f"num_items_in_batch: only valid with reduction='mean', spec has reduction={spec.reduction!r}"
            )
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch: expected one element, got shape {tuple(num_items_in_batch.shape)}"
                )
        elif not isinstance(num_items_in_batch, (int, float)) or not num_items_in_batch > 0:
            raise ValueError(f"num_items_in_batch: expected a positive number or tensor, got {num_items_in_batch!r}")


def check_teacher(logits: torch.Tensor, teacher_logits: Any, spec: LossSpec) -> None:
    """teacher_logits must come with a distillation term, and look like the student's logits."""
    if spec.distillation is None:
        if teacher_logits is not None:
            raise ValueError("teacher_logits: given, but the spec has no distillation term")
        return
    if teacher_logits is None:
        raise ValueError("teacher_logits: required by distillation but not given")
    if not isinstance(teacher_logits, torch.Tensor) or not teacher_logits.is_floating_point():
        got = getattr(teacher_logits, "dtype", type(teacher_logits).__name__)
        raise TypeError(f"teacher_logits: expected a floating-point tensor, got {got}")
    if teacher_logits.shape != logits.shape:
        raise ValueError(
            f"teacher_logits: shape {tuple(teacher_logits.shape)} does not match logits {tuple(logits.shape)}"
        )
    if teacher_logits.device != logits.device:
        raise ValueError(f"teacher_logits: on {teacher_logits.device}, logits on {logits.device}")
    if teacher_logits.stride(-1) != 1 and teacher_logits.shape[-1] > 1:
        raise ValueError("teacher_logits: the vocabulary dimension must have stride 1; pass .contiguous()")
    if logits.is_cuda and teacher_logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"teacher_logits: the kernel takes float32, bfloat16 or float16, got {teacher_logits.dtype}")


def targets_out_of_range(targets: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """Device bool: some target is outside [0, V) and is not ignore_index (no sync)."""
    return ((targets != ignore_index) & ((targets < 0) | (targets >= vocab))).any()


def target_range_error(targets: torch.Tensor, vocab: int, ignore_index: int) -> ValueError:
    """The error for out-of-range targets, naming the first offender (reads device data)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    where = tuple(bad.nonzero()[0].tolist())
    return ValueError(
        f"targets: value {int(targets[where])} at position {where} is outside [0, {vocab}) "
        f"and is not ignore_index={ignore_index} (pass validate=False to skip this check)"
    )


def resolve_backend(backend: str, logits: torch.Tensor) -> str:
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend: expected 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "reference":
        return backend
    on_kernel_device = logits.is_cuda or _INTERPRETER
    if backend == "triton" and not on_kernel_device:
        raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if not on_kernel_device:
        return "reference"
    if logits.dtype not in KERNEL_DTYPES:
        if backend == "triton":
            raise TypeError(f"logits: the Triton kernel takes float32, bfloat16 or float16, got {logits.dtype}")
        return "reference"
    return "triton"


# --- the kernel path ----------------------------------------------------------------------------


def denominator(
    spec: LossSpec,
    valid: torch.Tensor | None,
    rows: int,
    num_items_in_batch: int | float | torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_tokens, grad_scale): non-ignored count and d loss / d token_loss, both on the device."""
    n_tokens = valid.sum() if valid is not None else torch.full((), rows, dtype=torch.int64, device=device)
    if spec.reduction != "mean":
        return n_tokens, torch.ones(1, dtype=torch.float32, device=device)
    if num_items_in_batch is None:
        denom = n_tokens.clamp(min=1).float()
    elif isinstance(num_items_in_batch, torch.Tensor):
        denom = num_items_in_batch.to(device=device, dtype=torch.float32)
    else:
        denom = torch.full((), float(num_items_in_batch), dtype=torch.float32, device=device)
    return n_tokens, torch.reciprocal(denom).reshape(1)


def _triton_head_loss(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    teacher_logits: torch.Tensor | None,
    policy: PolicyInputs | None,
    spec: LossSpec,
    num_items_in_batch: int | float | torch.Tensor | None,
    options: ExecOptions,
) -> HeadLossOutput:
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    plan = compile_plan(
        spec, has_targets=targets is not None, needs_grad=needs_grad,
        has_old_logprobs=policy is not None and policy.old_logprobs is not None,
        has_importance_weights=policy is not None and policy.importance_weights is not None,
    )
    token_shape = logits.shape[:-1]
    # the kernel reads targets as a dense int vector (a strided view such as labels[::2] is not)
    flat_targets = targets.reshape(-1).contiguous() if targets is not None else None
    valid = flat_targets != spec.ignore_index if flat_targets is not None else None
    n_tokens, grad_scale = denominator(spec, valid, token_shape.numel(), num_items_in_batch, logits.device)

    fn = DeferredHead if plan.mode == "deferred" else FusedHead
    outs = fn.apply(logits, flat_targets, teacher_logits, policy, plan, options, grad_scale)
    return assemble_output(spec, token_shape, outs, n_tokens, valid, flat_targets, policy)


def assemble_output(
    spec: LossSpec,
    token_shape: torch.Size,
    outs: tuple,
    n_tokens: torch.Tensor,
    valid: torch.Tensor | None,
    flat_targets: torch.Tensor | None,
    policy: PolicyInputs | None = None,
) -> HeadLossOutput:
    """HeadLossOutput from an autograd Function's ``(loss, *RowStats.fields())``; with a policy
    term, its objective runs here on the differentiable per-token log-probs and entropy."""
    loss, *fields = outs
    stats = RowStats(*fields)
    policy_metrics: dict[str, torch.Tensor] = {}
    if policy is not None and stats.policy_loss is not None:  # token level: computed by the kernel
        policy_metrics = policy_metrics_of(
            stats.logp, stats.entropy, stats.ratio, policy.advantages, stats.kl, policy.mask, spec.policy, policy
        )
    elif policy is not None:  # sequence level: on the deferred mode's differentiable log-probs
        policy_loss, policy_metrics = policy_objective(stats.logp, stats.entropy, policy.mask, spec.policy, policy)
        loss = loss + policy_loss
    metrics = _metrics(spec, loss, n_tokens, valid, flat_targets, stats)
    metrics.update(policy_metrics)

    def per_token(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
        if name not in spec.outputs or value is None:
            return None
        value = value.reshape(token_shape)
        return value if spec.differentiable_outputs else value.detach()

    if spec.reduction == "none":
        loss = loss.reshape(token_shape)
    return HeadLossOutput(
        loss=loss,
        metrics=metrics,
        predicted_tokens=per_token("predicted_tokens", stats.pred),
        logprobs=per_token("logprobs", stats.logp),
        lse=per_token("lse", stats.lse),
        token_loss=per_token("token_loss", stats.token_loss),
        entropy=per_token("entropy", stats.entropy),
    )


def _metrics(
    spec: LossSpec,
    loss: torch.Tensor,
    n_tokens: torch.Tensor,
    valid: torch.Tensor | None,
    targets: torch.Tensor | None,
    stats: RowStats,
) -> dict[str, torch.Tensor]:
    """Means over non-ignored tokens, from the per-row buffers (ignored rows hold 0)."""
    rows: dict[str, torch.Tensor] = {}
    if stats.ce is not None:
        rows["ce"] = stats.ce
        if spec.cross_entropy.label_smoothing > 0:
            rows["nll"] = -stats.logp
    if spec.z_loss is not None:
        rows["z_loss"] = stats.lse * stats.lse
    if spec.entropy is not None:
        rows["entropy"] = stats.entropy
    if spec.token_accuracy:
        rows["token_accuracy"] = ((stats.pred == targets) & valid).float()
    if spec.distillation is not None:
        rows["distill/divergence"] = stats.dstats[:, 2]
        rows["distill/teacher_entropy"] = stats.t_entropy
        agree = stats.pred == stats.t_pred
        rows["distill/top1_agreement"] = (agree & valid if valid is not None else agree).float()
    metrics = {"loss": (loss.sum() if spec.reduction == "none" else loss).detach()}
    if rows:
        with torch.no_grad():
            means = torch.stack(list(rows.values())).sum(dim=1) / n_tokens.clamp(min=1)
        metrics.update(zip(rows, means.unbind()))
    metrics["n_tokens"] = n_tokens
    return metrics
