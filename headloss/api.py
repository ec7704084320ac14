"""Public entry points: inputs -> plan -> route -> engine -> output.

:func:`head_loss` / :class:`HeadLoss` on logits, :func:`linear_head_loss` / :class:`LinearHeadLoss`
on hidden states x lm_head weight (the fused lm_head, no full logits). Each call checks its inputs
(headloss.inputs), takes the spec's plan (headloss.plan), the route the plan and the call's facts
give (headloss.routes), and runs it (headloss.engine, headloss.linear, headloss.reference).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

from . import env, routes
from .bounded import BoundedDict
from .engine import HeadFunction, HeadRun, objective_metrics, policy_terms
from .inputs import (
    check_head,
    check_linear_inputs,
    check_logits,
    check_targets,
    check_teacher,
    flat_targets,
    head_call,
    pad_shifted,
    teacher_source,
)
from .linear import LinearFunction, LinearRun
from .output import HeadLossOutput, assemble, assemble_deferred
from .packed import packed_call, packed_policy_inputs
from .parallel import dtensor_shard, gather_vocab, handshake, is_dtensor, rows_shard, shard_of, traced_shard
from .plan import KernelPlan, SpecLike, plan_for
from .policy.inputs import policy_inputs
from .reference import reference_head_loss
from .routes import Route, facts_of, resolve_backend
from .spec import LossSpec
from .validation import Validate, check_pending, normaliser, validation_mode

Backend = Literal["auto", "triton", "reference"]

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


TEACHER_SHARE = 0.25
"""With teacher hidden states (the teacher's logits computed chunk by chunk too), the share of
``chunk_bytes`` its logits buffer takes: the student's chunk (the rows of the gradient GEMMs) gets
the rest and the teacher's logits are computed in parts of the chunk, one buffer of this share (the
same memory as chunks split evenly between the two, larger gradient GEMMs; see
benchmarks/bench_compile.py --profile-distill)."""


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
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    inplace_grad: bool = False,
    validate: Validate = None,
    backend: Backend = "auto",
    group: Any = None,
    route: str | None = None,
) -> HeadLossOutput:
    """Every loss, metric and per-token output of ``spec`` from one pass over ``logits``.

    Args:
        logits: [N, V] or [B, T, V], fp32/bf16/fp16; rows may be strided, the vocabulary
            dimension must have stride 1.
        targets: [N] or [B, T] integer ids in [0, V) or ``spec.ignore_index``. Optional when
            no requested value needs them (e.g. entropy only): then every row counts.
        spec: a :class:`LossSpec`, a dict, or a YAML/JSON path (default: mean cross-entropy).
        teacher_logits: same shape as ``logits`` (float32, bfloat16, float16; float64 is read as a
            float32 copy unless the student's logits are float64 too), for the distillation term.
            Read only; no gradient flows into it.
        advantages, old_logprobs, ref_logprobs, loss_mask, importance_weights, rollout_logprobs,
            sequence_ids: the policy term's inputs (see :class:`headloss.spec.Policy`); per-token
            tensors are shaped like the targets, advantages [B] or like the targets, sequence_ids
            [N] for [N, V] logits. Tokens outside ``loss_mask`` (0 and 1 only) are skipped by every term.
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
        cu_seqlens, position_ids: packed sequences (:mod:`headloss.packed`): ``logits`` [N, V] (or
            [1, N, V]) hold several sequences back to back, sequence s in rows ``cu_seqlens[s]:
            cu_seqlens[s + 1]`` (int32/int64 [S + 1]), or starting where ``position_ids`` ([N] or
            [1, N]) is 0. ``targets`` [N]: with ``shift`` row i is scored against the next token of
            its own sequence, without against ``targets[i]``; a sequence's last row is never
            scored. The policy term's sequences are these (``sequence_ids`` is not given), its
            per-token inputs [N], advantages [N] or (with cu_seqlens) [S]: every value equals the
            padded [S, T] call's on the same tokens. Per-token outputs are [N].
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
            collective checks that, so that a bad input on one rank raises on every rank. Under
            torch.compile the all_gather is a functional collective of the graph (not with
            ``validate="sync"`` or a DTensor).
        route: run the call on this route (:data:`headloss.routes.ROUTES`) instead of its default,
            e.g. ``"deferred+torch"`` against ``"deferred+kernels"``; an error names the routes the
            call can take. ``out.route`` says which one ran.

    Returns:
        :class:`HeadLossOutput`. NaN or +inf logits give NaN loss and gradient in their rows;
        -inf logits (a masked vocabulary) are fine unless the target itself is -inf (with label
        smoothing any -inf logit gives an infinite loss, as torch's cross_entropy does).
    """
    traced = torch.compiler.is_compiling()
    if not traced:
        check_pending()
        # a lazily negated view (torch._neg_view): the kernels read the stored values, torch applies
        # the sign (under torch.compile, tensors reach the ops functionalised)
        if isinstance(logits, torch.Tensor) and logits.is_neg():
            logits = logits.resolve_neg()
        if isinstance(teacher_logits, torch.Tensor) and teacher_logits.is_neg():
            teacher_logits = teacher_logits.resolve_neg()
    teacher_logits = _teacher_precision(teacher_logits, logits)
    policy_given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                        loss_mask=loss_mask, importance_weights=importance_weights, rollout_logprobs=rollout_logprobs,
                        sequence_ids=sequence_ids, num_sequences_in_batch=num_sequences_in_batch,
                        entropy_quantile_group=entropy_quantile_group)
    plan = plan_for(spec, has_targets=targets is not None)
    spec = plan.spec
    if cu_seqlens is not None or position_ids is not None:
        logits, targets, (teacher_logits,), packed = packed_call(
            logits, targets, (teacher_logits,), cu_seqlens, position_ids, shift, spec.ignore_index,
            validation_mode(validate))
        shift = False
        if spec.policy is not None:
            policy_given = packed_policy_inputs(policy_given, packed)
    if (route is None and group is None and spec.policy is None and not traced
            and all(value is None for value in policy_given.values())):
        recipe = _recipe_of(plan, logits, targets, teacher_logits, shift, inplace_grad, validate, backend)
        if recipe is not None:
            return _run_recipe(recipe, logits, targets, teacher_logits, num_items_in_batch)
    shard = None
    if group is not None or is_dtensor(logits):
        logits, targets, teacher_logits, shard = _vocab_shard(logits, targets, group, teacher_logits, validate)
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    dtype = logits.dtype if isinstance(logits, torch.Tensor) else torch.float32
    if resolve_backend(backend, device, dtype) == "reference":
        if shard is not None and traced:
            raise NotImplementedError(_TRACED_REFERENCE)
        if shard is not None:
            if validation_mode(validate) == "sync":  # whole rows on every rank before gathering them
                error = None
                try:
                    check_logits(logits)
                except (ValueError, TypeError) as exc:
                    error = exc
                handshake(shard, math.prod(logits.shape[:-1]) if isinstance(logits, torch.Tensor) else -1, error,
                          device)
            logits = gather_vocab(logits, shard)
            if teacher_logits is not None:
                teacher_logits = gather_vocab(teacher_logits.detach(), shard)
        chosen = routes.choose(plan, _reference_facts("logits", logits, policy_given, traced), route)
        out = _every_rank(shard, validation_mode(validate), logits,
                          lambda: _reference_head_loss(logits, targets, spec, teacher_logits, policy_given,
                                                       num_items_in_batch, shift, validate))
        return _taken(out, chosen, "logits", logits)
    try:
        token_shape = check_head(logits, targets, spec, teacher_logits, shift, kernel=True)
        chosen = routes.choose(plan, facts_of("logits", "triton", device, token_shape, policy_given,
                                              sharded=shard is not None), route)
        call = head_call(logits, targets, spec, token_shape, teacher_logits=teacher_logits,
                         policy_given=policy_given, num_items_in_batch=num_items_in_batch, shift=shift,
                         validate=validate, raw_policy=chosen.raw_inputs)
        error = None
    except (ValueError, TypeError) as exc:
        if shard is None or validation_mode(validate) != "sync":
            raise
        error = exc
    if shard is not None and validation_mode(validate) == "sync":  # every rank learns of any rank's error
        handshake(shard, math.prod(logits.shape[:-1]) if isinstance(logits, torch.Tensor) else -1, error,
                  logits.device)
    pol = call.policy
    rows_per_seq = pol.seq_len if pol is not None and isinstance(pol.seq_len, int) else 0
    geo = call.geo
    if shard is not None:
        geo = geo._replace(vocab_start=shard.vocab_start, V_total=shard.vocab_total)
    inside = chosen.policy == "kernels"  # deferred+kernels: the policy term inside the head's autograd node
    run = HeadRun(plan, geo, inplace_grad, call.validate, call.token_shape, traced=chosen.traced,
                  adv_span=pol.adv_span if pol is not None else 1, seq_len=rows_per_seq, shard=shard,
                  objective=pol if inside else None)
    epilogue = chosen.policy == "epilogue"
    loss, rows, pred, means, scratch = HeadFunction.apply(
        logits, call.targets, call.teacher,
        *((pol.old_logprobs, pol.ref_logprobs, pol.advantages, pol.importance_weights, pol.weight)
          if epilogue else (None,) * 5),
        call.norm.tensor, None if pol is None else pol.sequence_ids, run,
    )
    if inside:  # the loss has the policy term; its metrics follow the means
        extra = objective_metrics(plan, means[plan.means_size:])
        means = means[:plan.means_size]
    else:
        loss, extra = policy_terms(chosen, plan, loss, rows, means, scratch, pol, kernel_sequences=rows_per_seq > 0)
    out = assemble(plan, call.token_shape, loss, rows, pred, means, scratch, extra)
    return _taken(out, chosen, "logits", logits)


def _every_rank(shard, mode: str, source, run):
    """``run()`` (a reference-path call); vocab-parallel with validate="sync", its errors (of the inputs'
    shapes or of their values) are exchanged so that every rank raises, naming the ranks that failed."""
    if shard is None or mode != "sync":
        return run()
    error = out = None
    try:
        out = run()
    except (ValueError, TypeError) as exc:
        error = exc
    handshake(shard, math.prod(source.shape[:-1]) if isinstance(source, torch.Tensor) else -1, error, source.device)
    return out


def _teacher_precision(teacher_logits, student):
    """float64 teacher logits with a lower-precision student, as float32: the precision the kernels
    (and the reference, for such a student) compute the divergence in."""
    if isinstance(teacher_logits, torch.Tensor) and teacher_logits.dtype == torch.float64 and \
            isinstance(student, torch.Tensor) and student.dtype != torch.float64:
        return teacher_logits.float()
    return teacher_logits


def _taken(out: HeadLossOutput, route: Route, entry: str, source: torch.Tensor) -> HeadLossOutput:
    """``out`` with the route it took (and logged, under HEADLOSS_LOG_ROUTES=1)."""
    out.route = route.name
    if env.LOG_ROUTES:
        routes.log(route, entry, tuple(source.shape), source.dtype)
    return out


def _reference_facts(entry: str, source: Any, given: dict, traced: bool) -> routes.Facts:
    shape = tuple(source.shape[:-1]) if isinstance(source, torch.Tensor) else ()
    return routes.Facts(entry, "reference", shape, given.get("sequence_ids") is not None, False, traced, False, False)


class _Recipe(NamedTuple):
    """What a head_loss call without policy inputs or a group runs with, apart from its tensors and its
    num_items_in_batch: found again by the call's signature (the plan, and every input's type, shape,
    strides, dtype and device), so a repeated call skips the input checks, which its signature
    decides, and the geometry (host time, see benchmarks/bench_host.py)."""

    plan: KernelPlan
    run: HeadRun  # the kernel run (its geometry without num_items_in_batch)
    flat_targets: bool  # the targets are the dense int vector the kernels read
    route: Route


_RECIPES: BoundedDict[tuple, _Recipe] = BoundedDict(1024)
_BACKENDS = ("auto", "triton", "reference")


def _signature(t: Any) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _recipe_of(plan: KernelPlan, logits, targets, teacher_logits, shift, inplace_grad, validate, backend
               ) -> _Recipe | None:
    """The cached recipe of a call's signature (made, after every check, on its first call); None
    where the call is not one (unusual argument types take the checked path, which names them)."""
    known_validate = validate is None or validate is True or validate is False or \
        (type(validate) is str and validate == "sync")
    if type(logits) is not torch.Tensor or not (targets is None or type(targets) is torch.Tensor) or \
            not (teacher_logits is None or type(teacher_logits) is torch.Tensor) or not known_validate or \
            type(backend) is not str or backend not in _BACKENDS:
        return None
    key = (id(plan), _signature(logits), _signature(targets), _signature(teacher_logits), bool(shift),
           bool(inplace_grad), validate, env.validate_default() if validate is None else None, backend,
           env.INTERPRETER)
    recipe = _RECIPES.get(key)
    if recipe is not None and recipe.plan is plan:
        return recipe
    if resolve_backend(backend, logits.device, logits.dtype) == "reference":
        return None  # (not kept: the plain-torch path has no host cost to save)
    token_shape = check_head(logits, targets, plan.spec, teacher_logits, shift, kernel=True)
    route = routes.choose(plan, facts_of("logits", "triton", logits.device, token_shape, {}, sharded=False))
    call = head_call(logits, targets, plan.spec, token_shape, teacher_logits=teacher_logits, policy_given={},
                     num_items_in_batch=None, shift=shift, validate=validate)
    flat = targets is None or (targets.dim() == 1 and targets.dtype in (torch.int64, torch.int32)
                               and targets.is_contiguous())
    recipe = _Recipe(plan, HeadRun(plan, call.geo, inplace_grad, call.validate, call.token_shape), flat, route)
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
    out = assemble_deferred(plan, run.token_shape, loss, rows, pred, means, scratch)
    return _taken(out, recipe.route, "logits", logits)


_TRACED_REFERENCE = ("group: the plain-torch path of a vocab-parallel call (CPU tensors without TRITON_INTERPRET=1) "
                     "is not traceable by torch.compile; the kernels' path is")


def _traced_refusals(name: str, tensors: tuple, validate) -> None:
    """What a vocab-parallel call cannot do under torch.compile, refused on every rank alike before any
    collective: DTensors (``name``: the sharded input) and validate="sync"."""
    if any(is_dtensor(t) for t in tensors):
        raise NotImplementedError(f"{name}: a DTensor is not traceable by torch.compile here; pass its local "
                                  "tensor (to_local()) with group=")
    if validation_mode(validate) == "sync":
        raise ValueError("validate: 'sync' waits on the host for every rank's verdict: not under torch.compile "
                         "(use True: the device's verdict is raised by a later call)")


def _vocab_shard(logits, targets, group, teacher_logits, validate):
    """(local logits, local targets, local teacher logits, VocabShard) of a vocab-parallel call;
    what it cannot do yet is refused here, on every rank alike, before any collective."""
    if torch.compiler.is_compiling():  # the kernels' path: the layout a constant, the statistics' all_gather traced
        _traced_refusals("logits", (logits, targets, teacher_logits), validate)
        check_logits(logits)
        return logits, targets, teacher_logits, traced_shard(group, logits.shape[-1], logits.device)
    if is_dtensor(targets):
        targets = targets.full_tensor()
    if is_dtensor(teacher_logits):  # sharded like the student's
        teacher_logits = teacher_logits.to_local()
    if is_dtensor(logits):
        local, shard = dtensor_shard(logits, -1, group)
        return local, targets, teacher_logits, shard
    # every rank, before any local error; validate="sync" exchanges the layout even when cached. Logits
    # without a vocabulary dimension take part with width 0: every rank refuses the layout, this one
    # with its own error
    sync = validation_mode(validate) == "sync"
    well_formed = isinstance(logits, torch.Tensor) and logits.dim() in (2, 3)
    try:
        shard = shard_of(group, logits.shape[-1] if well_formed else 0,
                         logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu"), fresh=sync)
    except ValueError:
        if not well_formed:
            check_logits(logits)
        raise
    if not sync:  # (validate="sync" checks the logits where every rank learns of any rank's error)
        check_logits(logits)
    return logits, targets, teacher_logits, shard


def _reference_head_loss(logits, targets, spec: LossSpec, teacher_logits, policy_given, num_items_in_batch,
                         shift: bool, validate) -> HeadLossOutput:
    """The plain-torch path, with the same checks and the same shift conventions."""
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
        self.spec = LossSpec.coerce(spec)
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
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
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
    hidden_grad: str = "reduced",
    route: str | None = None,
) -> HeadLossOutput:
    """:func:`head_loss` of ``hidden @ weight.T + bias`` without materialising the logits.

    Rows are processed in chunks whose logits fit ``chunk_bytes``. Per chunk (fused mode): one
    cuBLAS GEMM for the logits, the spec's kernel in place on them (per-row outputs and the
    logits' gradient), then ``dh_c = g_c @ W`` and ``dW += g_c.T @ h_c``: the 3 GEMMs of a plain
    lm_head forward + backward plus ~3 chunk-sized passes of the kernel. Backward only scales dh,
    dW, db by d loss. In deferred mode (``reduction="none"``, differentiable outputs) backward
    recomputes the logits per chunk: 4 GEMMs. The call's route (``out.route``; headloss.routes)
    says which.

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
        validate, backend, num_items_in_batch, num_sequences_in_batch, entropy_quantile_group, route,
            cu_seqlens, position_ids: as in :func:`head_loss` (packed ``hidden`` [N, H] or [1, N, H]).
        group: a vocab-parallel (column-parallel) lm_head: ``weight`` (and ``bias``) are this rank's
            contiguous rows of the vocabulary, ``hidden`` and the targets are replicated. Outputs
            are replicated, dW / db are this rank's rows, dh is summed over the group once (the
            column-parallel layer's all-reduce); one all_gather of statistics per chunk. A DTensor
            weight sharded on dim 0 needs no ``group``. A teacher is sharded the same way (its
            logits' columns, or its weight's rows).
        hidden_grad: with ``group``, ``"reduced"`` (default) sums dh over the group; ``"partial"``
            leaves each rank its own columns' share, for a caller whose layer reduces it (Megatron's
            sequence-parallel gather, verl's ``linear_cross_entropy`` contract).

    Under ``torch.autocast`` the GEMMs run in the autocast dtype, as ``F.linear`` would: hidden
    states and weights (student and teacher) are cast to it, and their gradients flow back to
    the original dtypes.
    """
    kwargs = dict(bias=bias, shift=shift, cu_seqlens=cu_seqlens, position_ids=position_ids,
                  teacher_logits=teacher_logits, teacher_hidden=teacher_hidden,
                  teacher_weight=teacher_weight, teacher_bias=teacher_bias, advantages=advantages,
                  old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask,
                  importance_weights=importance_weights, rollout_logprobs=rollout_logprobs,
                  sequence_ids=sequence_ids, num_items_in_batch=num_items_in_batch,
                  num_sequences_in_batch=num_sequences_in_batch, entropy_quantile_group=entropy_quantile_group,
                  chunk_bytes=chunk_bytes, fp32_weight_grad=fp32_weight_grad, compact=compact, validate=validate,
                  backend=backend, group=group, hidden_grad=hidden_grad, route=route)
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


def _linear_head_loss(hidden, weight, targets, spec, *, bias, shift, cu_seqlens, position_ids, teacher_logits,
                      teacher_hidden, teacher_weight, teacher_bias, advantages, old_logprobs, ref_logprobs, loss_mask,
                      importance_weights,
                      rollout_logprobs, sequence_ids, num_items_in_batch, num_sequences_in_batch,
                      entropy_quantile_group, chunk_bytes, fp32_weight_grad, compact, validate, backend, group,
                      hidden_grad, route) -> HeadLossOutput:
    traced = torch.compiler.is_compiling()
    if not traced:
        check_pending()
    if hidden_grad not in ("reduced", "partial"):
        raise ValueError(f"hidden_grad: expected 'reduced' or 'partial', got {hidden_grad!r}")
    teacher_logits = _teacher_precision(teacher_logits, hidden)
    plan = plan_for(spec, has_targets=targets is not None)
    spec = plan.spec
    shard = None
    if group is not None or is_dtensor(weight):
        if traced:  # the kernels' path: the layout a constant; each chunk's all_gather runs inside the op
            _traced_refusals("weight", (hidden, weight, bias, targets, teacher_logits, teacher_hidden, teacher_weight,
                                        teacher_bias), validate)
            if resolve_backend(backend, hidden.device, hidden.dtype, name="hidden") == "reference":
                raise NotImplementedError(_TRACED_REFERENCE)
            shard = traced_shard(group, weight.shape[0], weight.device)
        else:
            weight, shard = rows_shard(weight, group, fresh=validation_mode(validate) == "sync")
        bias, teacher_weight, teacher_bias, teacher_logits = (
            t.to_local() if is_dtensor(t) else t for t in (bias, teacher_weight, teacher_bias, teacher_logits))
        if is_dtensor(teacher_hidden):
            teacher_hidden = teacher_hidden.full_tensor()
        if is_dtensor(hidden):
            hidden = hidden.full_tensor()
        if is_dtensor(targets):
            targets = targets.full_tensor()
    mode = validation_mode(validate)
    error = None
    try:  # every host-side check; with a group and validate="sync", every rank learns of any rank's error
        packed = None
        if cu_seqlens is not None or position_ids is not None:
            hidden, targets, (teacher_hidden, teacher_logits), packed = packed_call(
                hidden, targets, (teacher_hidden, teacher_logits), cu_seqlens, position_ids, shift, spec.ignore_index,
                mode)
            shift = False
        check_linear_inputs(hidden, weight, bias)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: expected a positive number of bytes, got {chunk_bytes!r}")
        token_rows = tuple(hidden.shape[:-1])
        check_targets(targets, token_rows, spec, hidden.device, shift, source="hidden")
        token_shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else token_rows
        if shift:
            targets = pad_shifted(targets if targets.dtype in (torch.int64, torch.int32) else targets.long(),
                                  hidden.shape[1], spec.ignore_index)
        teacher = teacher_source(spec, token_rows, hidden, weight, teacher_logits, teacher_hidden, teacher_weight,
                                 teacher_bias)
        norm = normaliser(num_items_in_batch, spec, hidden.device)
        given = dict(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                     loss_mask=loss_mask, importance_weights=importance_weights, rollout_logprobs=rollout_logprobs,
                     sequence_ids=sequence_ids)
        if shift and targets.shape != token_shape:  # completion ids: per-token inputs get the unscored last row
            given = {k: _pad_last(v, k) for k, v in given.items()}
        if packed is not None and spec.policy is not None:
            given = packed_policy_inputs(given, packed)
        given["num_sequences_in_batch"] = num_sequences_in_batch
        given["entropy_quantile_group"] = entropy_quantile_group
        backend = resolve_backend(backend, hidden.device, hidden.dtype, name="hidden")
        completion = shift and targets.shape != token_shape  # rows padded by one: T - 1 scored positions
        rows_shape = tuple(targets.shape) if targets is not None else token_rows
        policy, targets = policy_inputs(spec.policy, rows_shape, targets, spec.ignore_index, norm.as_torch(), mode,
                                        given, norm_length=token_shape[1] if completion else None)
    except (ValueError, TypeError) as exc:
        if shard is None or mode != "sync":
            raise
        error = exc
    if shard is not None and mode == "sync":
        handshake(shard, math.prod(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else -1, error,
                  weight.device)
    if backend == "reference":
        chosen = routes.choose(plan, _reference_facts("hidden", hidden, given, traced), route)
        local_rows = weight.shape[0]
        if shard is not None:  # the whole weight (and teacher) on every rank; each keeps its rows' gradient
            weight = gather_vocab(weight.t(), shard).t()
            bias = None if bias is None else gather_vocab(bias[None], shard)[0]
            t_logits, t_hidden, t_weight, t_bias = teacher
            teacher = (None if t_logits is None else gather_vocab(t_logits.detach(), shard), t_hidden,
                       None if t_weight is None else gather_vocab(t_weight.detach().t(), shard).t(),
                       None if t_bias is None else gather_vocab(t_bias.detach()[None], shard)[0])
        own = None if shard is None or hidden_grad == "reduced" else (shard.vocab_start, local_rows)
        out = _every_rank(shard, mode, hidden,
                          lambda: _reference_linear(hidden, weight, bias, targets, spec, teacher, given, norm, mode,
                                                    token_shape, own))
        return _taken(out, chosen, "hidden", hidden)
    rows = math.prod(token_rows)
    computed_teacher = teacher[1] is not None
    elem = hidden.element_size() * (2 if computed_teacher else 1)  # a computed teacher shares the budget
    # sharded: every rank must cut the same chunks (one collective each): rows by the whole vocabulary,
    # so a chunk has the single-device row count (the same GEMM shapes, 1 / world of its memory)
    width = weight.shape[0] if shard is None else shard.vocab_total
    chunk_rows = chunk_rows_for(chunk_bytes, width, elem)
    seq_len = token_rows[1] if len(token_rows) == 2 else 0
    facts = facts_of("hidden", "triton", hidden.device, rows_shape, given, sharded=shard is not None,
                     sequence_bytes=seq_len * width * elem, chunk_bytes=chunk_bytes)
    chosen = routes.choose(plan, facts, route)
    teacher_rows = 0
    if chosen.lm_head == "sequences":  # chunks of whole sequences, every row computed (sequences stay contiguous)
        chunk_rows, compact = max(seq_len, chunk_rows // seq_len * seq_len), False
    elif computed_teacher and chosen.lm_head == "rows" and shard is None:  # the teacher's share in parts of a chunk
        chunk_rows = chunk_rows_for(int(chunk_bytes * (1.0 - TEACHER_SHARE)), width, hidden.element_size())
        teacher_rows = chunk_rows_for(int(chunk_bytes * TEACHER_SHARE), width, hidden.element_size())
    corrected = chosen.lm_head in ("covariance", "entropy-guess")
    run = LinearRun(chosen.plan, chunk_rows, fp32_weight_grad, compact and not chosen.traced, mode, rows_shape,
                    spec.ignore_index, norm.value, chunks=chosen.lm_head, traced=chosen.traced, shard=shard,
                    seq_len=seq_len if chosen.lm_head == "sequences" else 0,
                    policy=policy if corrected or chosen.lm_head == "sequences" else None,
                    objective=spec.policy if corrected else None,
                    d_rows_by_kernel=chosen.name == "lm_head:sequences+kernels",
                    reduce_hidden_grad=hidden_grad == "reduced", teacher_rows=teacher_rows)
    epilogue = chosen.policy == "epilogue"
    loss, rows_out, pred, means, scratch = LinearFunction.apply(
        hidden.reshape(rows, hidden.shape[-1]), weight, bias, flat_targets(targets), *teacher,
        *((policy.old_logprobs, policy.ref_logprobs, policy.advantages, policy.importance_weights, policy.weight)
          if epilogue else (None,) * 5),
        norm.tensor, None if policy is None else policy.sequence_ids, run,
    )
    loss, extra = policy_terms(chosen, run.plan, loss, rows_out, means, scratch, policy)
    extra.update(getattr(policy, "correction_metrics", None) or {})
    out = assemble(run.plan, run.token_shape, loss, rows_out, pred, means, scratch, extra)
    out = _trim(out, token_shape) if token_shape != run.token_shape else out
    return _taken(out, chosen, "hidden", hidden)


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


def _reference_linear(hidden, weight, bias, targets, spec, teacher, given, norm, mode, token_shape,
                      own=None) -> HeadLossOutput:
    """``own`` (vocab start, width): hidden_grad="partial", dh through this rank's columns only."""
    if targets is not None:  # as the kernel path skips them: an ignored row's hidden state reaches nothing
        hidden = torch.where((targets != spec.ignore_index)[..., None], hidden, 0.0)
    if own is None:
        logits = F.linear(hidden, weight, bias)
    else:  # the same values; d hidden from this rank's columns, d weight from every row
        start, width = own
        logits = F.linear(hidden.detach(), weight, bias)
        mine = F.linear(hidden, weight[start:start + width].detach())
        logits = logits + F.pad(mine - mine.detach(), (start, weight.shape[0] - start - width))
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
        self.spec = LossSpec.coerce(spec)
        self.options = options

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor | None = None,
                **inputs: Any) -> HeadLossOutput:
        """``inputs``: the per-call inputs of :func:`linear_head_loss` (bias, num_items_in_batch, ...)."""
        return linear_head_loss(hidden, weight, targets, self.spec, **self.options, **inputs)
