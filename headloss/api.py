"""Public entry points: inputs -> plan -> engine -> output.

:func:`head_loss` / :class:`HeadLoss` on logits, :func:`linear_head_loss` / :class:`LinearHeadLoss`
on hidden states x lm_head weight (the fused lm_head, no full logits).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .engine import HeadFunction, HeadRun, LinearFunction, LinearRun, objective_metrics, policy_objective_in_kernel
from .inputs import (
    KERNEL_DTYPES,
    Backend,
    SpecLike,
    Validate,
    check_logits,
    check_pending,
    check_targets,
    flat_targets,
    head_call,
    normaliser,
    pad_shifted,
    plan_for,
    resolve_backend,
    validation_mode,
)
from .output import HeadLossOutput, assemble, assemble_deferred, column
from .parallel import dtensor_shard, gather_vocab, handshake, is_dtensor, rows_shard, shard_of
from .plan import KernelPlan, compile_plan
from .policy import cov_base_policy, objective_in_kernel, policy_extremes, policy_inputs, policy_objective
from .reference import reference_head_loss
from .spec import ROW_LOCAL_OBJECTIVES, LossSpec

DEFAULT_CHUNK_BYTES = 256 << 20
"""Logits per chunk of the fused lm_head: 256 MiB = 1024 rows of a 128256-word bf16 vocabulary.

Measured on an H200 at N=8192, H=4096, V=128256 (benchmarks/bench_linear.py, "chunks" rows):
32/64/96/128/192/256/512 MiB ran at 2.34/1.45/1.27/1.19/1.13/1.11/1.06 x the 3 bare GEMMs with a
peak of 1.10/1.13/1.16/1.20/1.26/1.32/1.56 GiB (dW, dh and cuBLAS's workspace included). Every
chunk re-reads and re-writes dW, and below ~1024 rows cuBLAS runs the weight-gradient and logits
GEMMs well under their large-K speed (benchmarks/profile_linear.py); 1024 rows is the smallest
chunk within 1.1x. Pass ``chunk_bytes=128 << 20`` where memory matters more than time.
"""

ROW_TILE = 128
"""Chunks of 256 rows or more are cut to a multiple of this: cuBLAS tiles the chunk's rows by 128
(or 256), and a partial last tile costs a whole one. On an H200 (N=8192, H=4096, V=128256) 544-row
chunks ran the step in 49.6 ms against 45.0 ms for 512-row chunks (benchmarks/profile_linear.py)."""


def chunk_rows_for(budget_bytes: int, vocab: int, elem_bytes: int) -> int:
    """Rows per chunk so that one [rows, vocab] logits buffer fits ``budget_bytes`` (at least 1),
    cut to a multiple of ROW_TILE from 2 * ROW_TILE rows up."""
    rows = max(1, budget_bytes // max(1, vocab * elem_bytes))
    return rows - rows % ROW_TILE if rows >= 2 * ROW_TILE else rows


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
    rollout_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_sequences_in_batch: int | float | torch.Tensor | None = None,
    entropy_quantile_group: Any = None,
    shift: bool = False,
    inplace_grad: bool = False,
    validate: Validate = None,
    backend: Backend = "auto",
    group: Any = None,
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
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, rollout_logprobs,
            sequence_ids: the policy term's inputs (see :class:`headloss.spec.Policy`); per-token
            tensors are shaped like the targets, advantages [B] or like the targets, sequence_ids
            [N] for [N, V] logits. Tokens outside ``loss_mask`` are skipped by every term.
            ``rollout_logprobs`` (the rollout engine's log-probs) feed ``Policy.rollout_is`` and
            the off-policy mask.
        num_items_in_batch: with ``reduction="mean"``, divide the summed loss by this instead
            of the number of non-ignored tokens (HF gradient accumulation). Number or tensor.
        num_sequences_in_batch: a policy term whose loss type is a mean over sequences divides by
            this / ``policy.num_processes`` instead of this call's sequence count: verl's agg_loss
            with ``global_batch_size`` and ``dp_size``. Number or one-element tensor.
        entropy_quantile_group: with ``policy.top_entropy_quantile`` < 1, take the quantile over
            the counted tokens of every process of this torch.distributed group (TRL gathers them
            from all processes: ``torch.distributed.group.WORLD``), not this call's alone. The
            processes' token counts are exchanged first: one host wait per call.
        shift: next-token scoring on the full model output, without slicing it. ``logits`` is
            [B, T, V] and row t predicts token t + 1. ``targets`` is either the HF labels [B, T]
            (row t is scored against ``labels[:, t + 1]``) or TRL's completion ids [B, T - 1]
            (from ``logits_to_keep + 1`` positions; row t against ``ids[:, t]``). The last row of
            each sequence is not scored and its gradient row is 0. Per-token outputs and policy
            inputs are shaped like ``targets`` and entry t belongs to logits row t. The kernel
            reads the full tensor and writes a full-size gradient: autograd never slices.
        inplace_grad: write d loss / d logits over ``logits`` (saves N*V memory). The logits
            are then destroyed: nothing else may use them afterwards. (Ignored under
            torch.compile, whose buffers Inductor owns.)
        validate: check targets are in [0, V) or ignore_index, num_items_in_batch is positive
            and sequence_ids in range, on the device, without making the host wait: ``True``
            (default; CUDA errors are raised by the next headloss call or ``metrics_as_floats``,
            CPU errors in the call), ``"sync"`` (wait and raise in the call), ``False`` or
            ``HEADLOSS_VALIDATE=0`` (off). Unchecked out-of-range targets give NaN in their
            rows, never an out-of-bounds read. Under CUDA-graph capture the check is a
            device-side assert.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"``
            (plain torch), or ``"auto"``: triton on CUDA or under the interpreter, else reference.
        group: vocab-parallel logits: ``logits`` is this rank's contiguous slice of the vocabulary
            ``[.., V_rank]`` (ranks in order, shards may be uneven), targets and the other inputs
            are replicated. Every output is the same on every rank and equal to the single-device
            result on the whole vocabulary; the gradient is this rank's slice. One all_gather per
            call (see :mod:`headloss.parallel`). A DTensor sharded on its last dimension needs no
            ``group``. ``teacher_logits`` are sharded like ``logits``; the mixture JSD costs a second
            collective (an all-reduce of 2 fp32 per row). Inputs are expected replicated (targets,
            policy inputs) and shaped alike on every rank: with ``validate="sync"`` one more small
            collective checks that, so that a bad input on one rank raises on every rank. Not yet:
            torch.compile.

    Returns:
        :class:`HeadLossOutput`. NaN or +inf logits give NaN loss and gradient in their rows;
        -inf logits (a masked vocabulary) are fine unless the target itself is -inf (with label
        smoothing any -inf logit gives an infinite loss, as torch's cross_entropy does).
    """
    if not torch.compiler.is_compiling():
        check_pending()
        # a lazily negated view (torch._neg_view): the kernels read the stored values, torch applies
        # the sign (under torch.compile, tensors reach the ops functionalised)
        if isinstance(logits, torch.Tensor) and logits.is_neg():
            logits = logits.resolve_neg()
        if isinstance(teacher_logits, torch.Tensor) and teacher_logits.is_neg():
            teacher_logits = teacher_logits.resolve_neg()
    policy_given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                        loss_mask=loss_mask, importance_weights=importance_weights, rollout_logprobs=rollout_logprobs,
                        sequence_ids=sequence_ids, num_sequences_in_batch=num_sequences_in_batch,
                        entropy_quantile_group=entropy_quantile_group)
    plan = plan_for(spec, has_targets=targets is not None)
    spec = plan.spec
    if (group is None and spec.policy is None and advantages is None and old_logprobs is None and ref_logprobs is None
            and loss_mask is None and importance_weights is None and rollout_logprobs is None and sequence_ids is None
            and num_sequences_in_batch is None and entropy_quantile_group is None
            and not torch.compiler.is_compiling()):
        recipe = _recipe_of(plan, logits, targets, teacher_logits, shift, inplace_grad, validate, backend,
                            policy_given)
        if recipe is not None:
            return _run_recipe(recipe, logits, targets, teacher_logits, num_items_in_batch)
    shard = None
    if group is not None or is_dtensor(logits):
        logits, targets, teacher_logits, shard = _vocab_shard(logits, targets, group, plan, teacher_logits, validate)
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    dtype = logits.dtype if isinstance(logits, torch.Tensor) else torch.float32
    if resolve_backend(backend, device, dtype) == "reference":
        if shard is not None:
            logits = gather_vocab(logits, shard)
            if teacher_logits is not None:
                teacher_logits = gather_vocab(teacher_logits.detach(), shard)
        return _reference_head_loss(logits, targets, spec, teacher_logits, policy_given, num_items_in_batch, shift,
                                    validate)
    try:
        call = head_call(logits, targets, spec, kernel=True, teacher_logits=teacher_logits,
                         policy_given=policy_given, num_items_in_batch=num_items_in_batch, shift=shift,
                         validate=validate, policy_in_kernel=plan.flags.HAS_POLICY,
                         policy_deferred_kernel=plan.mode == "deferred" and spec.reduction != "none")
        error = None
    except (ValueError, TypeError) as exc:
        if shard is None or validation_mode(validate) != "sync":
            raise
        error = exc
    if shard is not None and validation_mode(validate) == "sync":  # every rank learns of any rank's error
        handshake(shard, math.prod(logits.shape[:-1]), error, logits.device)
    pol = call.policy
    rows_per_seq = pol.seq_len if pol is not None and isinstance(pol.seq_len, int) else 0
    geo = call.geo
    if shard is not None:
        geo = geo._replace(vocab_start=shard.vocab_start, V_total=shard.vocab_total)
    # deferred mode's policy term by its kernels, inside the head's autograd node (policy_inputs chose them)
    objective = pol if pol is not None and pol.raw and plan.mode == "deferred" else None
    run = HeadRun(plan, geo, inplace_grad, call.validate, call.token_shape,
                  adv_span=pol.adv_span if pol is not None else 1, seq_len=rows_per_seq, shard=shard,
                  objective=objective)
    loss, rows, pred, means, scratch = HeadFunction.apply(
        logits, call.targets, call.teacher,
        *((pol.old_logprobs, pol.ref_logprobs, pol.advantages, pol.importance_weights, pol.weight)
          if pol is not None and plan.flags.HAS_POLICY else (None,) * 5),
        call.norm.tensor, None if pol is None else pol.sequence_ids, run,
    )
    if objective is not None:  # the loss has the policy term; its metrics follow the means
        extra = objective_metrics(plan, means[plan.means_size:])
        means = means[:plan.means_size]
    else:
        loss, extra = _policy_terms(plan, loss, rows, means, scratch, pol, kernel_sequences=rows_per_seq > 0)
    return assemble(plan, call.token_shape, loss, rows, pred, means, scratch, extra)


class _Recipe(NamedTuple):
    """What a head_loss call without policy inputs or a group runs with, apart from its tensors and its
    num_items_in_batch: found again by the call's signature (the plan, and every input's type, shape,
    strides, dtype and device), so a repeated call skips the input checks, which its signature
    decides, and the geometry (host time, see benchmarks/bench_host.py)."""

    plan: KernelPlan
    run: HeadRun  # the kernel run (its geometry without num_items_in_batch)
    flat_targets: bool  # the targets are the dense int vector the kernels read


_RECIPES: dict[tuple, _Recipe] = {}
_BACKENDS = ("auto", "triton", "reference")


def _signature(t: Any) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _recipe_of(plan: KernelPlan, logits, targets, teacher_logits, shift, inplace_grad, validate, backend,
               policy_given: dict) -> _Recipe | None:
    """The cached recipe of a call's signature (made, after every check, on its first call); None
    where the call is not one (unusual argument types take the checked path, which names them).
    ``policy_given``: head_loss's policy inputs, every one None here."""
    known_validate = validate is None or validate is True or validate is False or \
        (type(validate) is str and validate == "sync")
    if type(logits) is not torch.Tensor or not (targets is None or type(targets) is torch.Tensor) or \
            not (teacher_logits is None or type(teacher_logits) is torch.Tensor) or not known_validate or \
            type(backend) is not str or backend not in _BACKENDS:
        return None
    key = (id(plan), _signature(logits), _signature(targets), _signature(teacher_logits), bool(shift),
           bool(inplace_grad), validate, os.environ.get("HEADLOSS_VALIDATE") if validate is None else None, backend)
    recipe = _RECIPES.get(key)
    if recipe is not None and recipe.plan is plan:
        return recipe
    if resolve_backend(backend, logits.device, logits.dtype) == "reference":
        return None  # (not kept: the plain-torch path has no host cost to save)
    call = head_call(logits, targets, plan.spec, kernel=True, teacher_logits=teacher_logits,
                     policy_given=policy_given, num_items_in_batch=None, shift=shift, validate=validate)
    flat = targets is None or (targets.dim() == 1 and targets.dtype in (torch.int64, torch.int32)
                               and targets.is_contiguous())
    recipe = _Recipe(plan, HeadRun(plan, call.geo, inplace_grad, call.validate, call.token_shape), flat)
    if len(_RECIPES) >= 1024:
        _RECIPES.clear()
    _RECIPES[key] = recipe
    return recipe


def _run_recipe(recipe: _Recipe, logits, targets, teacher_logits, num_items_in_batch) -> HeadLossOutput:
    """head_loss of a call whose recipe is known: only num_items_in_batch is checked per call."""
    plan = recipe.plan
    run = recipe.run
    norm = normaliser(num_items_in_batch, plan.spec, logits.device)
    if norm.value:
        run = replace(run, geo=run.geo._replace(norm=norm.value))
    loss, rows, pred, means, scratch = HeadFunction.apply(
        logits, targets if recipe.flat_targets else flat_targets(targets),
        None if teacher_logits is None else teacher_logits.detach(), None, None, None, None, None, norm.tensor, None,
        run,
    )
    return assemble_deferred(plan, run.token_shape, loss, rows, pred, means, scratch)


def _vocab_shard(logits, targets, group, plan: KernelPlan, teacher_logits, validate):
    """(local logits, local targets, local teacher logits, VocabShard) of a vocab-parallel call;
    what it cannot do yet is refused here, on every rank alike, before any collective."""
    if is_dtensor(targets):
        targets = targets.full_tensor()
    if is_dtensor(teacher_logits):  # sharded like the student's
        teacher_logits = teacher_logits.to_local()
    if is_dtensor(logits):
        local, shard = dtensor_shard(logits, -1, group)
        return local, targets, teacher_logits, shard
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        check_logits(logits)  # (no shard width to exchange)
    # every rank, before any local error; validate="sync" exchanges the layout even when cached
    shard = shard_of(group, logits.shape[-1], logits.device, fresh=validation_mode(validate) == "sync")
    check_logits(logits)
    return logits, targets, teacher_logits, shard


def _policy_terms(plan: KernelPlan, loss, rows, means, scratch, pol, kernel_sequences: bool = False
                  ) -> tuple[torch.Tensor, dict]:
    """The policy term's share outside the kernel: with token-level ratios the metrics the kernel
    did not reduce (per-sequence clip fractions of rows with sequence_ids, or of the chunked lm_head);
    with sequence-level ratios (GSPO) the whole objective on the deferred mode's differentiable
    log-probs: two launches on [B, T] rows (policy.objective_in_kernel), else in torch."""
    spec = plan.spec
    if spec.policy is None:
        return loss, {}
    if plan.flags.HAS_POLICY:
        if kernel_sequences:  # rows of [B, K]: the kernel's last program computed every metric
            return loss, {}
        # the per-sequence metrics in torch, from the kernel's columns
        token_means = {name: means[index] for name, index in plan.metric_index}
        clip_low, clip_high = column(rows, plan, "clip_low"), column(rows, plan, "clip_high")
        return loss, policy_extremes(token_means, column(rows, plan, "ratio"), clip_low, clip_high, pol.mask,
                                     scratch[0], pol)
    if loss.dim() == 0 and objective_in_kernel(spec.policy, pol, rows):
        return policy_objective_in_kernel(plan, loss, rows, pol)
    if pol.raw:  # (policy_inputs hands inputs as given only to a call the kernels will run)
        raise RuntimeError("headloss: internal error, deferred policy inputs as given reached the torch objective")
    entropy = column(rows, plan, "entropy")
    policy_loss, metrics = policy_objective(column(rows, plan, "logp"), entropy, pol.mask, spec.policy, pol)
    loss = loss + policy_loss
    metrics["loss"] = loss.detach().clone()
    return loss, metrics


def _reference_head_loss(logits, targets, spec: LossSpec, teacher_logits, policy_given, num_items_in_batch,
                         shift: bool, validate) -> HeadLossOutput:
    """The plain-torch path, with the same checks and the same shift conventions."""
    from .inputs import check_logits, check_teacher

    check_logits(logits)
    check_targets(targets, tuple(logits.shape[:-1]), spec, logits.device, shift)
    check_teacher(tuple(logits.shape), logits.device, teacher_logits, spec, kernel=False)
    norm = normaliser(num_items_in_batch, spec, logits.device)
    given = {k: v for k, v in policy_given.items() if v is not None}
    if teacher_logits is not None:
        teacher_logits = teacher_logits.detach()
    if shift:
        rows_per_seq = logits.shape[1]
        keep = targets.shape[1]
        if keep == rows_per_seq:  # HF labels: row t against labels[:, t + 1]
            targets = pad_shifted(targets, rows_per_seq, spec.ignore_index)
        else:  # completion ids: the first T - 1 rows
            logits = logits[:, :keep]
            if teacher_logits is not None:
                teacher_logits = teacher_logits[:, :keep]
    token_shape = tuple(logits.shape[:-1]) if targets is None else tuple(targets.shape)
    policy_inputs(spec.policy, token_shape, targets, spec.ignore_index, norm.as_torch(), validation_mode(validate),
                  policy_given)  # the same input errors as the kernel path
    return reference_head_loss(logits, targets, spec, teacher_logits=teacher_logits,
                               num_items_in_batch=norm.as_torch(), validate=validation_mode(validate), **given)


class HeadLoss(torch.nn.Module):
    """Module form of :func:`head_loss`: ``HeadLoss(spec)(logits, targets)``."""

    def __init__(
        self,
        spec: SpecLike | None = None,
        *,
        inplace_grad: bool = False,
        validate: Validate = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        self.spec = LossSpec() if spec is None else LossSpec.coerce(spec)
        self.inplace_grad = inplace_grad
        self.validate = validate
        self.backend = backend

    def forward(self, logits: torch.Tensor, targets: torch.Tensor | None = None, **inputs: Any) -> HeadLossOutput:
        """``inputs``: the per-call inputs of :func:`head_loss` (teacher_logits, num_items_in_batch, shift, ...)."""
        return head_loss(logits, targets, self.spec, **inputs, inplace_grad=self.inplace_grad,
                         validate=self.validate, backend=self.backend)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"


# --- the fused lm_head -------------------------------------------------------------------------------


def linear_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None = None,
    spec: SpecLike | None = None,
    *,
    bias: torch.Tensor | None = None,
    shift: bool = False,
    teacher_logits: torch.Tensor | None = None,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    num_sequences_in_batch: int | float | torch.Tensor | None = None,
    entropy_quantile_group: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    fp32_weight_grad: bool = False,
    compact: bool = True,
    validate: Validate = None,
    backend: Backend = "auto",
    group: Any = None,
) -> HeadLossOutput:
    """:func:`head_loss` of ``hidden @ weight.T + bias`` without materialising the logits.

    Rows are processed in chunks whose logits fit ``chunk_bytes``. Per chunk (fused mode): one
    cuBLAS GEMM for the logits, the spec's kernel in place on them (per-row outputs and the
    logits' gradient), then ``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c``: the 3 GEMMs of a plain
    lm_head forward + backward plus ~3 chunk-sized passes of the kernel. Backward only scales dh,
    dW, db by d loss. In deferred mode (``reduction="none"``, differentiable outputs) backward
    recomputes the logits per chunk: 4 GEMMs.

    Args:
        hidden: [N, H] or [B, T, H] (fp32/bf16/fp16).
        weight: [V, H], same dtype and device (may be tied to the input embedding).
        targets: [N] or [B, T] ids, or None when the spec needs none.
        bias: optional [V].
        shift: next-token scoring as :func:`head_loss` has it: ``targets`` are the HF labels
            [B, T] (row t against ``labels[:, t + 1]``) or completion ids [B, T - 1] (row t
            against ``ids[:, t]``); the last row of each sequence is not scored.
        chunk_bytes: budget for one chunk of logits (default 256 MiB, see DEFAULT_CHUNK_BYTES;
            128 MiB where memory is tight); rows per chunk are cut to a multiple of 128 from 256
            up. Peak extra memory is about this plus the gradients dW (V x H), dh (N x H) and
            O(N) per-row buffers.
        fp32_weight_grad: accumulate dW over chunks in fp32 and round once at the end (costs a
            V x H fp32 buffer); default bf16/fp16 accumulation in the weight's dtype.
        compact: skip ignored rows entirely (gather the others chunk by chunk); costs one host
            sync for their count (which also reads the validation verdict). Off under CUDA-graph
            capture and torch.compile; ``compact=False`` makes the call sync-free, except for
            the policy statistics that read a count on the host (clip_cov, kl_cov, and the
            top-entropy mask: the rows their correction recomputes).
        teacher_logits: [N, V] / [B, T, V] teacher logits for the distillation term, or instead
            teacher_hidden [.., Ht] with teacher_weight [V, Ht] (and teacher_bias): the teacher's
            logits are then computed chunk by chunk too (and recomputed in a deferred backward).
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, rollout_logprobs,
            sequence_ids: the policy term's inputs, as in :func:`head_loss`.
        validate, backend, num_items_in_batch, num_sequences_in_batch, entropy_quantile_group: as in
            :func:`head_loss`.
        group: a vocab-parallel (column-parallel) lm_head: ``weight`` (and ``bias``) are this rank's
            contiguous rows of the vocabulary, ``hidden`` and the targets are replicated. Outputs
            are replicated, dW / db are this rank's rows, dh is summed over the group once (the
            column-parallel layer's all-reduce); one all_gather of statistics per chunk. A DTensor
            weight sharded on dim 0 needs no ``group``. A teacher is sharded the same way (its
            logits' columns, or its weight's rows).

    Under ``torch.autocast`` the GEMMs run in the autocast dtype, as ``F.linear`` would: hidden
    states and weights (student and teacher) are cast to it, and their gradients flow back to
    the original dtypes.
    """
    kwargs = dict(bias=bias, shift=shift, teacher_logits=teacher_logits, teacher_hidden=teacher_hidden,
                  teacher_weight=teacher_weight, teacher_bias=teacher_bias, advantages=advantages,
                  old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask,
                  importance_weights=importance_weights, rollout_logprobs=rollout_logprobs,
                  sequence_ids=sequence_ids, num_items_in_batch=num_items_in_batch,
                  num_sequences_in_batch=num_sequences_in_batch, entropy_quantile_group=entropy_quantile_group,
                  chunk_bytes=chunk_bytes,
                  fp32_weight_grad=fp32_weight_grad, compact=compact, validate=validate, backend=backend, group=group)
    device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else None
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        for name in ("bias", "teacher_hidden", "teacher_weight", "teacher_bias"):
            kwargs[name] = cast(kwargs[name])
        with torch.autocast(device_type, enabled=False):
            return _linear_head_loss(cast(hidden), cast(weight), targets, spec, **kwargs)
    return _linear_head_loss(hidden, weight, targets, spec, **kwargs)


def _linear_head_loss(hidden, weight, targets, spec, *, bias, shift, teacher_logits, teacher_hidden, teacher_weight,
                      teacher_bias, advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights,
                      rollout_logprobs, sequence_ids, num_items_in_batch, num_sequences_in_batch,
                      entropy_quantile_group, chunk_bytes,
                      fp32_weight_grad, compact, validate, backend, group) -> HeadLossOutput:
    if not torch.compiler.is_compiling():
        check_pending()
    plan = plan_for(spec, has_targets=targets is not None)
    spec = plan.spec
    shard = None
    if group is not None or is_dtensor(weight):
        weight, shard = rows_shard(weight, group, fresh=validation_mode(validate) == "sync")
        if validation_mode(validate) == "sync":  # every rank learns of any rank's bad inputs
            error = None
            try:
                _check_linear_inputs(hidden, weight, bias)
                check_targets(targets, tuple(hidden.shape[:-1]), spec, hidden.device, shift, source="hidden")
            except (ValueError, TypeError) as exc:
                error = exc
            rows = math.prod(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else -1
            handshake(shard, rows, error, weight.device)
        bias, teacher_weight, teacher_bias, teacher_logits = (
            t.to_local() if is_dtensor(t) else t for t in (bias, teacher_weight, teacher_bias, teacher_logits))
        if is_dtensor(teacher_hidden):
            teacher_hidden = teacher_hidden.full_tensor()
        if is_dtensor(hidden):
            hidden = hidden.full_tensor()
        if is_dtensor(targets):
            targets = targets.full_tensor()
    _check_linear_inputs(hidden, weight, bias)
    token_rows = tuple(hidden.shape[:-1])
    check_targets(targets, token_rows, spec, hidden.device, shift, source="hidden")
    token_shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else token_rows
    if shift:
        targets = pad_shifted(targets if targets.dtype in (torch.int64, torch.int32) else targets.long(),
                              hidden.shape[1], spec.ignore_index)
    teacher = _teacher_source(spec, token_rows, hidden, weight, teacher_logits, teacher_hidden, teacher_weight,
                              teacher_bias)
    norm = normaliser(num_items_in_batch, spec, hidden.device)
    mode = validation_mode(validate)
    given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask,
                 importance_weights=importance_weights, rollout_logprobs=rollout_logprobs, sequence_ids=sequence_ids)
    if shift and targets.shape != token_shape:  # completion ids: per-token inputs get the unscored last row
        given = {k: _pad_last(v, k) for k, v in given.items()}
    given["num_sequences_in_batch"] = num_sequences_in_batch
    given["entropy_quantile_group"] = entropy_quantile_group
    backend = resolve_backend(backend, hidden.device, hidden.dtype, name="hidden")
    completion = shift and targets.shape != token_shape  # rows padded by one: T - 1 scored positions
    policy, targets = policy_inputs(spec.policy, tuple(targets.shape) if targets is not None else token_rows, targets,
                                    spec.ignore_index, norm.as_torch(), mode, given,
                                    norm_length=token_shape[1] if completion else None)
    if backend == "reference":
        if shard is not None:  # the whole weight (and teacher) on every rank; each keeps its rows' gradient
            weight = gather_vocab(weight.t(), shard).t()
            bias = None if bias is None else gather_vocab(bias[None], shard)[0]
            t_logits, t_hidden, t_weight, t_bias = teacher
            teacher = (None if t_logits is None else gather_vocab(t_logits.detach(), shard), t_hidden,
                       None if t_weight is None else gather_vocab(t_weight.detach().t(), shard).t(),
                       None if t_bias is None else gather_vocab(t_bias.detach()[None], shard)[0])
        return _reference_linear(hidden, weight, bias, targets, spec, teacher, given, norm, mode, token_shape)
    rows = math.prod(token_rows)
    elem = hidden.element_size() * (2 if teacher[1] is not None else 1)  # a computed teacher shares the budget
    # sharded: every rank must cut the same chunks (one collective each): rows by the whole vocabulary,
    # so a chunk has the single-device row count (the same GEMM shapes, 1 / world of its memory)
    width = weight.shape[0] if shard is None else shard.vocab_total
    chunk_rows = chunk_rows_for(chunk_bytes, width, elem)
    seq_len = _sequence_chunks(plan, policy, token_rows, chunk_rows, chunk_bytes, width * elem, shard)
    if seq_len:  # chunks of whole sequences, every row computed (sequences stay contiguous)
        chunk_rows, compact = max(seq_len, chunk_rows // seq_len * seq_len), False
    # clip_cov / kl_cov, a top-entropy mask: the base fused, the rows the batch statistic changes corrected
    base = _base_plan(plan, policy, shard)
    run = LinearRun(plan if base is None else base, chunk_rows, fp32_weight_grad, compact, mode,
                    tuple(targets.shape) if targets is not None else token_rows, spec.ignore_index, norm.value,
                    shard=shard, seq_len=seq_len, seq_policy=policy if seq_len else None,
                    corrected=policy if base is not None else None,
                    corrected_objective=spec.policy if base is not None else None)
    has_policy = policy is not None and run.plan.flags.HAS_POLICY
    loss, rows_out, pred, means, scratch = LinearFunction.apply(
        hidden.reshape(rows, hidden.shape[-1]), weight, bias, flat_targets(targets), *teacher,
        *((policy.old_logprobs, policy.ref_logprobs, policy.advantages, policy.importance_weights, policy.weight)
          if has_policy else (None,) * 5),
        norm.tensor, None if policy is None else policy.sequence_ids, run,
    )
    loss, extra = _policy_terms(run.plan, loss, rows_out, means, scratch, policy)
    extra.update(getattr(policy, "correction_metrics", None) or {})
    out = assemble(run.plan, run.token_shape, loss, rows_out, pred, means, scratch, extra)
    return _trim(out, token_shape) if token_shape != run.token_shape else out


SEQUENCE_CHUNK_SLACK = 4
"""Sequence-chunked mode takes chunks of whole sequences up to this many times chunk_bytes."""


def _policy_grad_in_forward(plan: KernelPlan, policy, shard, entropy_mask: bool = False) -> bool:
    """What the lm_head routes that compute a deferred policy term's gradient in forward need: a
    policy term (and its inputs), no other reason for deferred mode (reduction 'none', per-token
    outputs with gradient), one device, eager; no top-entropy mask (a statistic of most tokens)
    unless ``entropy_mask`` (the route that guesses it and corrects the rows it got wrong)."""
    spec = plan.spec
    pol = spec.policy
    return (pol is not None and policy is not None and spec.reduction != "none" and not spec.differentiable_outputs
            and (entropy_mask or pol.top_entropy_quantile == 1.0) and shard is None
            and not torch.compiler.is_compiling())


def _sequence_chunks(plan: KernelPlan, policy, token_rows: tuple[int, ...], chunk_rows: int, chunk_bytes: int,
                     row_bytes: int, shard) -> int:
    """Rows per sequence when the lm_head can run sequence-chunked (0: it cannot): the plan is
    deferred only for a sequence statistic of the policy term (GSPO, GMPO, VESPO, the off-policy
    mask, ...), rows are [B, T] sequences, and a sequence's logits fit the chunk budget (times
    SEQUENCE_CHUNK_SLACK). Batch statistics (clip_cov, kl_cov, the entropy quantile, TRL's
    token-mean entropy bonus) and everything else keep deferred mode."""
    pol = plan.spec.policy
    if (not _policy_grad_in_forward(plan, policy, shard) or plan.mode != "deferred"
            or pol.objective in ("clip_cov", "kl_cov")
            or (pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean")
            or len(token_rows) != 2 or policy.sequence_ids is not None):
        return 0
    seq_len = token_rows[1]
    return seq_len if seq_len * row_bytes <= SEQUENCE_CHUNK_SLACK * chunk_bytes else 0


def _base_plan(plan: KernelPlan, policy, shard) -> KernelPlan | None:
    """The lm_head plan of a row-local base objective (fused) whose rows a batch statistic then
    changes, when nothing else needs deferred mode: three GEMMs and a small one (over the changed
    rows) instead of deferred mode's four.

    * clip_cov / kl_cov: their base objective; the selected tokens are corrected after the chunks
      (engine._cov_correction).
    * a row-local objective under the top-entropy mask (no TRL token-mean entropy bonus, whose
      weights depend on the mask): the objective under a mask guessed chunk by chunk, the rows
      guessed wrong corrected once the batch quantile is known (engine._guess_mask and
      _entropy_mask_correction).

    Under CUDA-graph capture both keep deferred mode: the correction reads a count on the host."""
    spec = plan.spec
    pol = spec.policy
    if pol is None or policy is None or pol.importance_sampling != "token" or pol.off_policy_mask is not None:
        return None
    covariance = pol.objective in ("clip_cov", "kl_cov")
    if covariance:
        if not _policy_grad_in_forward(plan, policy, shard):
            return None
    elif pol.top_entropy_quantile < 1.0 and pol.objective in ROW_LOCAL_OBJECTIVES:
        if (not _policy_grad_in_forward(plan, policy, shard, entropy_mask=True)
                or (pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean")):
            return None
    else:
        return None
    # (eager here: _policy_grad_in_forward refuses torch.compile) the correction reads a count on the host
    if policy.mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if plan.key not in _BASES:
        base_policy = cov_base_policy(pol) if covariance else pol.model_copy(update={"top_entropy_quantile": 1.0})
        base = compile_plan(spec.model_copy(update={"policy": base_policy}), has_targets=True)
        _BASES[plan.key] = base if base.mode == "fused" else None
    return _BASES[plan.key]


_BASES: dict[str, KernelPlan | None] = {}
"""_base_plan's plans by the spec's plan key: made once, not on every call."""


def _pad_last(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """A per-token input of completion ids [B, T - 1] padded to the rows [B, T] (advantages [B] stay)."""
    if t is None or name == "sequence_ids" or t.dim() != 2:
        return t
    return F.pad(t, (0, 1))


def _trim(out: HeadLossOutput, token_shape: tuple[int, ...]) -> HeadLossOutput:
    """Per-token outputs over the rows [B, T] -> over the completion ids [B, T - 1]."""
    keep = token_shape[1]
    for name in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"):
        value = getattr(out, name)
        if value is not None:
            setattr(out, name, value[:, :keep])
    if out.loss.dim() == 2:
        out.loss = out.loss[:, :keep].clone()
    return out


def _reference_linear(hidden, weight, bias, targets, spec, teacher, given, norm, mode, token_shape) -> HeadLossOutput:
    if targets is not None:  # as the kernel path skips them: an ignored row's hidden state reaches nothing
        hidden = torch.where((targets != spec.ignore_index)[..., None], hidden, 0.0)
    logits = F.linear(hidden, weight, bias)
    t_logits, t_hidden, t_weight, t_bias = teacher
    if t_hidden is not None:
        t_logits = F.linear(t_hidden, t_weight, t_bias)
    if t_logits is not None:
        t_logits = t_logits.reshape(logits.shape)
    given = {k: v for k, v in given.items() if v is not None}
    out = reference_head_loss(logits, targets, spec, teacher_logits=t_logits, num_items_in_batch=norm.as_torch(),
                              validate=mode, **given)
    return _trim(out, token_shape) if targets is not None and tuple(targets.shape) != token_shape else out


class LinearHeadLoss(torch.nn.Module):
    """Module form: ``LinearHeadLoss(spec)(hidden, lm_head.weight, labels)``."""

    def __init__(self, spec: SpecLike | None = None, **options: Any) -> None:
        super().__init__()
        self.spec = LossSpec() if spec is None else LossSpec.coerce(spec)
        self.options = options

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None = None,
                **inputs: Any) -> HeadLossOutput:
        """``inputs``: the per-call inputs of :func:`linear_head_loss` (bias, num_items_in_batch, ...)."""
        return linear_head_loss(hidden, weight, targets, self.spec, **self.options, **inputs)


def _check_linear_inputs(hidden, weight, bias) -> None:
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating dtype, got {t.dtype}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected [V, H] with H = {hidden.shape[-1]} (hidden's last dim), got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary dimension V is 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias: expected {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")


def _teacher_source(spec, token_rows, hidden, weight, logits, t_hidden, t_weight, t_bias) -> tuple:
    """Check the teacher inputs; returns (teacher_logits [N, V], teacher_hidden [N, Ht], teacher_weight,
    teacher_bias), detached, None where absent. Errors name the argument."""
    from .inputs import check_teacher

    if t_hidden is None and (t_weight is not None or t_bias is not None):
        raise ValueError("teacher_hidden: required with teacher_weight / teacher_bias")
    if t_hidden is not None:
        if logits is not None:
            raise ValueError("teacher_logits: give either teacher_logits or teacher_hidden + teacher_weight, not both")
        if t_weight is None:
            raise ValueError("teacher_weight: required with teacher_hidden")
        if spec.distillation is None:
            raise ValueError("teacher_hidden: given, but the spec has no distillation term")
        if tuple(t_hidden.shape[:-1]) != tuple(token_rows) or t_hidden.device != hidden.device:
            raise ValueError(f"teacher_hidden: expected {tuple(token_rows)} + (Ht,) on {hidden.device}, "
                             f"got {tuple(t_hidden.shape)} on {t_hidden.device}")
        if t_weight.dim() != 2 or tuple(t_weight.shape) != (weight.shape[0], t_hidden.shape[-1]):
            raise ValueError(f"teacher_weight: expected [V, Ht] = {(weight.shape[0], t_hidden.shape[-1])}, "
                             f"got {tuple(t_weight.shape)}")
        if t_weight.dtype != t_hidden.dtype or (t_bias is not None and tuple(t_bias.shape) != (t_weight.shape[0],)):
            raise ValueError("teacher_weight: dtype must match teacher_hidden, teacher_bias shape must be [V]")
        rows = math.prod(token_rows)
        return (None, t_hidden.detach().reshape(rows, -1), t_weight.detach(),
                None if t_bias is None else t_bias.detach())
    check_teacher(tuple(token_rows) + (weight.shape[0],), hidden.device, logits, spec,
                  kernel=hidden.dtype in KERNEL_DTYPES)
    if logits is None:
        return (None, None, None, None)
    return (logits.detach().reshape(-1, logits.shape[-1]), None, None, None)
