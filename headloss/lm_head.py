"""The lm_head entry point's run: checks -> plan -> route -> chunks (or plain torch) -> output.

:func:`run_linear` is :func:`headloss.linear_head_loss` after the door bundled its keywords: the
vocab-parallel layout, every host-side check (:func:`_check`), the route (headloss.routes) and the
chunk cut it implies (headloss.chunks), then :class:`LinearFunction` over headloss.linear's chunk
loop, or the plain-torch path (:func:`_torch_linear`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from . import ops, routes
from .batch import CallInputs, LinearOptions, PolicyBatch, Teacher
from .chunks import LinearRun, LmHead
from .engine import NO_GRADS, keep
from .env import log_route
from .head import CallTensors, PerSlot, teacher_rows, torch_head
from .inputs import (
    check_linear_inputs,
    check_student_topk,
    check_targets,
    flat_targets,
    pad_shifted,
    resolved_teacher,
    sparse_teacher,
    teacher_source,
)
from .kernels.sparse import SparseRows
from .linear import Saved, linear_backward, linear_forward
from .linear_ops import linear_backward_op, linear_forward_beside_op, linear_forward_op, run_args
from .main_grad import IntoMainGrad, add_into, check_main_grad, handed_over
from .ops import flat_geometry, take_grad
from .output import FunctionOutputs, HeadLossOutput, HeadOutputs, assemble, guard_second_backward
from .packed import packed_call, packed_policy_inputs
from .parallel import (
    TRACED_TORCH,
    every_rank,
    fingerprint,
    first_sight,
    gather_vocab,
    handshake,
    is_dtensor,
    rows_shard,
    traced_refusals,
    traced_shard,
)
from .plan import KernelPlan
from .policy.inputs import policy_inputs
from .policy.tokens import PolicyTokens
from .policy.weights import weigh_tokens
from .routes import facts_of, resolve_backend
from .row_inputs import flat_selected_ids, flat_temperature, flat_token_weights
from .scored import ScoredRows
from .spec import LossSpec
from .validation import Normaliser, normaliser, validation_mode


@dataclass
class LinearCall:
    """A linear_head_loss call after its host-side checks."""

    hidden: torch.Tensor  # [.., H]
    weight: torch.Tensor  # [V(_rank), H]
    bias: torch.Tensor | None
    targets: torch.Tensor | None  # [.., T] row-aligned (shifted: padded by one)
    teacher: Teacher  # detached, rows flat
    token_rows: tuple[int, ...]  # hidden's row shape
    token_shape: tuple[int, ...]  # the caller's targets' shape
    rows_shape: tuple[int, ...]  # the row-aligned targets' shape
    norm: Normaliser
    batch: PolicyBatch  # the policy inputs, row-aligned
    policy: PolicyTokens | None
    backend: str
    sparse: SparseRows | None = None  # a top-k or per-token teacher, per row
    temperature: torch.Tensor | None = None  # [rows] fp32 per-row temperature (spec.LogitTransform), per row
    weights: torch.Tensor | None = None  # [rows] fp32 token weights (spec.TokenWeights), per row
    selected: torch.Tensor | None = None  # [rows, K] int64 selected ids (outputs: selected_logprobs), per row


def run_linear(hidden, weight, targets, plan: KernelPlan, call: CallInputs, options: LinearOptions) -> HeadLossOutput:
    """linear_head_loss of the bundled inputs (headloss.api). Under ``torch.autocast`` the GEMMs run in
    the autocast dtype, as ``F.linear`` would run them (gradients flow back to the original dtypes)."""
    device_type = hidden.device.type if isinstance(hidden, torch.Tensor) else None
    autocast = device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type)
    into = _main_grad(weight, options, torch.compiler.is_compiling())  # (the caller's weight, before a cast)
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        if autocast:
            dtype = torch.get_autocast_dtype(device_type)
            cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            hidden, weight = cast(hidden), cast(weight)
            teacher = call.teacher
            call = replace(call, bias=cast(call.bias), teacher=replace(teacher, hidden=cast(teacher.hidden),
                                                                       weight=cast(teacher.weight),
                                                                       bias=cast(teacher.bias)))
        return _run_linear(hidden, weight, targets, plan, call, options, into)


def _run_linear(hidden, weight, targets, plan: KernelPlan, call: CallInputs, options: LinearOptions,
                into: tuple | None) -> HeadLossOutput:
    traced = torch.compiler.is_compiling()
    call = resolved_teacher(call, plan.spec)
    mode = validation_mode(options.validate)
    # the first call with a DTensor weight of a layout checks, as validate="sync" does, that every rank has
    # the same rows (FSDP2's data-parallel shard of a weight looks like a vocab-parallel one)
    exchange = mode == "sync" or (is_dtensor(weight) and mode != "off" and not traced and first_sight(weight))
    shard = None
    if options.group is not None or is_dtensor(weight):
        hidden, weight, targets, call, shard = _local(hidden, weight, targets, call, options)
    error = checked = None
    try:  # every host-side check; with a group and an exchange, every rank learns of any rank's error
        checked = _check(hidden, weight, targets, plan.spec, call, options, mode,
                         vocab=None if shard is None else shard.vocab_total)
    except (ValueError, TypeError) as exc:
        if shard is None or not exchange:
            raise
        error = exc
    if shard is not None and exchange:
        rows = math.prod(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else -1
        handshake(shard, rows, error, weight.device, hidden=fingerprint(checked.hidden) if checked is not None else 0)
    if checked.backend == "torch":
        facts = routes.Facts("hidden", "torch", tuple(checked.hidden.shape[:-1]),
                             checked.batch.sequence_ids is not None, False, traced, False, False)
        chosen = routes.choose(plan, facts, options.route)
        if into is not None:  # the plain-torch path: the dW autograd computes goes into main_grad
            checked.weight = IntoMainGrad.apply(checked.weight, into)
        out = _torch_linear(checked, plan.spec, shard, options, mode)
        out.route = chosen.name
        log_route("linear_head_loss", checked.hidden, chosen.name)
        return out
    return _chunked(checked, plan, shard, options, mode, traced, into)


def _main_grad(weight, options: LinearOptions, traced: bool) -> tuple | None:
    """``weight_grad="main_grad"``: (the weight, its checked main_grad), or None."""
    if options.weight_grad != "main_grad" or not (isinstance(weight, torch.Tensor) and weight.requires_grad):
        return None
    if traced:
        raise ValueError("weight_grad: 'main_grad' runs eagerly (under torch.compile Megatron's flag on the weight "
                         "cannot be traced): compile with weight_grad='return'")
    return weight, check_main_grad(weight)


class _Local(NamedTuple):
    """A vocab-parallel lm_head call's local tensors (the weight's rows; hidden states and targets whole)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor | None
    call: CallInputs  # its bias and teacher local
    shard: Any  # headloss.parallel.VocabShard


def _local(hidden, weight, targets, call: CallInputs, options: LinearOptions) -> _Local:
    """A vocab-parallel call's local tensors and its VocabShard (the weight's rows)."""
    teacher, bias = call.teacher, call.bias
    if torch.compiler.is_compiling():  # the kernels' path: the layout a constant; each chunk's all_gather in the op
        traced_refusals("weight", (hidden, weight, bias, targets, teacher.logits, teacher.hidden, teacher.weight,
                                   teacher.bias), validation_mode(options.validate) == "sync")
        if resolve_backend(options.backend, weight.device, weight.dtype, name="weight") == "torch":
            raise NotImplementedError(TRACED_TORCH)
        shard = traced_shard(options.group, weight.shape[0], weight.device)
    else:
        weight, shard = rows_shard(weight, options.group, fresh=validation_mode(options.validate) == "sync")
    local = lambda t: t.to_local() if is_dtensor(t) else t  # noqa: E731
    whole = lambda t: t.full_tensor() if is_dtensor(t) else t  # noqa: E731
    teacher = Teacher(local(teacher.logits), whole(teacher.hidden), local(teacher.weight), local(teacher.bias),
                      whole(teacher.ids), whole(teacher.logprobs), whole(teacher.probs))
    return _Local(whole(hidden), weight, whole(targets), replace(call, bias=local(bias), teacher=teacher), shard)


def _check(hidden, weight, targets, spec: LossSpec, call: CallInputs, options: LinearOptions, mode: str,
           vocab: int | None = None) -> LinearCall:
    """Every host-side check of a linear_head_loss call, and its inputs made row-aligned (``vocab``: a
    vocab-parallel call's whole vocabulary)."""
    bias, teacher, batch, layout = call.bias, call.teacher, call.batch, call.layout
    num_items_in_batch = call.num_items_in_batch
    shift = layout.shift
    _check_compact(options.compact, layout)
    packed = None
    if layout.packed:
        hidden, targets, (t_hidden, t_logits, t_ids, t_logprobs), packed = packed_call(
            hidden, targets, (teacher.hidden, teacher.logits, teacher.ids, teacher.logprobs), layout.cu_seqlens,
            layout.position_ids, shift, spec.ignore_index, mode)
        teacher = replace(teacher, hidden=t_hidden, logits=t_logits, ids=t_ids, logprobs=t_logprobs)
        shift = False
    check_linear_inputs(hidden, weight, bias)
    check_student_topk(spec, vocab or weight.shape[0])
    chunk_bytes = options.chunk_bytes
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes: expected a positive number of bytes, got {chunk_bytes!r}")
    token_rows = tuple(hidden.shape[:-1])
    check_targets(targets, token_rows, spec, hidden.device, shift, source="hidden")
    if isinstance(options.compact, ScoredRows) and not torch.compiler.is_compiling():  # (compiled: unused)
        options.compact.check(targets, shift, spec.ignore_index, token_rows)
    token_shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else token_rows
    per_sequence = (packed.n_slots, packed.seq) if packed is not None and packed.per_sequence else None
    temperature = flat_temperature(call.temperature, spec, token_shape, hidden.device, per_sequence)
    weights = flat_token_weights(call.token_weights, spec, token_shape, hidden.device, per_sequence)
    selected = flat_selected_ids(call.selected_ids, token_shape, hidden.device)
    if shift:
        targets = pad_shifted(targets, hidden.shape[1], spec.ignore_index)
    completion = shift and targets.shape != token_shape  # rows padded by one: T - 1 scored positions
    if completion and temperature is not None:  # the unscored last row of each sequence: any positive value
        temperature = F.pad(temperature.view(token_shape), (0, 1), value=1.0).reshape(-1)
    if completion and weights is not None:
        weights = F.pad(weights.view(token_shape), (0, 1)).reshape(-1)
    if completion and selected is not None:  # (no id on the unscored row)
        k = selected.shape[-1]
        selected = F.pad(selected.view(*token_shape, k), (0, 0, 0, 1), value=-1).reshape(-1, k)
    backend = resolve_backend(options.backend, hidden.device, hidden.dtype, name="hidden")
    check = "sync" if mode == "sync" or (mode == "async" and backend == "torch") else "off"
    sparse = sparse_teacher(spec, teacher, token_rows, token_shape, hidden.device, vocab or weight.shape[0],
                            "off" if torch.compiler.is_compiling() else check,
                            align="pad_last" if completion else "rows")
    teacher = teacher_source(spec, token_rows, hidden, weight, teacher)
    norm = normaliser(num_items_in_batch, spec, hidden.device)
    if completion:  # completion ids: per-token inputs get the unscored last row
        batch = batch.map_tokens(_pad_last)
    if packed is not None and spec.policy is not None:
        batch = PolicyBatch.of(packed_policy_inputs(batch.by_name(), packed))
    rows_shape = tuple(targets.shape) if targets is not None else token_rows
    policy, targets = policy_inputs(spec.policy, targets, spec.ignore_index, norm.as_torch(), mode,
                                    batch.by_name(), norm_length=token_shape[1] if completion else None)
    weigh_tokens(policy, spec, weights)
    return LinearCall(hidden=hidden, weight=weight, bias=bias, targets=targets, teacher=teacher, token_rows=token_rows,
                 token_shape=token_shape, rows_shape=rows_shape, norm=norm, batch=batch, policy=policy, backend=backend,
                 sparse=sparse, temperature=temperature, weights=weights, selected=selected)


def _check_compact(compact, layout) -> None:
    """``compact``: True, False, or ScoredRows (headloss.scored) of unpacked rows."""
    if isinstance(compact, bool):
        return
    if not isinstance(compact, ScoredRows):
        raise TypeError(f"compact: expected True, False or headloss.scored_rows(...)'s ScoredRows, got "
                        f"{type(compact).__name__}")
    if layout.packed:
        raise ValueError("compact: ScoredRows cover unpacked rows; with cu_seqlens or position_ids pass compact=True")


def _chunked(call: LinearCall, plan: KernelPlan, shard, options: LinearOptions, mode: str, traced: bool,
             into: tuple | None = None) -> HeadLossOutput:
    """The kernels' path: the route, its chunk cut, the chunk loop in LinearFunction, the policy term's
    share outside it, the output. ``into``: (weight, main_grad) of weight_grad="main_grad": in deferred
    mode each chunk's dW goes into main_grad; where the gradient is computed in forward, backward adds it
    there times d loss in one pass (kernels.head.add_scaled_)."""
    spec, hidden, weight = plan.spec, call.hidden, call.weight
    width = weight.shape[0] if shard is None else shard.vocab_total  # every rank cuts the chunks of all of V
    elem = hidden.element_size() * (2 if call.teacher.computed else 1)  # a computed teacher shares the budget
    seq_len = call.token_rows[1] if len(call.token_rows) == 2 else 0
    facts = facts_of("hidden", "triton", hidden.device, call.rows_shape, call.batch.by_name(),
                     sharded=shard is not None, sequence_bytes=seq_len * width * elem, chunk_bytes=options.chunk_bytes)
    chosen = routes.choose(plan, facts, options.route)
    loop = chosen.loop  # the route's chunk loop: its cut, its steps between and after the chunks, its metrics
    chunks = loop.cut(options.chunk_bytes, width, hidden.element_size(), call.teacher.computed, seq_len,
                      shard is not None)
    compact = options.compact is not False and not chosen.traced and loop.compacts
    run = LinearRun(plan=chosen.plan, chunk_rows=chunks.rows, fp32_weight_grad=options.fp32_weight_grad,
                    compact=compact, validate=mode,
                    token_shape=call.rows_shape, ignore_index=spec.ignore_index, norm=call.norm.value, loop=loop,
                    traced=chosen.traced, shard=shard,
                    seq_len=chunks.seq_len, policy=call.policy if loop.takes_policy else None,
                    objective=spec.policy if loop.corrects else None,
                    reduce_hidden_grad=options.hidden_grad == "reduced", teacher_rows=chunks.teacher_rows,
                    ahead=options.compact if compact and isinstance(options.compact, ScoredRows) else None)
    if into is not None:
        run = replace(run, main_grad=into)
    policy = call.policy
    tensors = CallTensors.of(flat_targets(call.targets), call.teacher, chosen.epilogue_policy(policy),
                             call.norm.tensor, None if policy is None else policy.sequence_ids, call.sparse,
                             PerSlot(call.temperature, call.weights, call.selected))
    loss, rows_out, pred, means, scratch = LinearFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                                                call.bias, run, *tensors)
    head, extra = chosen.policy_share(run.plan, HeadOutputs(loss, rows_out, pred, means), scratch, policy)
    extra.update(loop.metrics(means, run.plan, run.objective))  # (after the plan's means)
    out = assemble(run.plan, run.token_shape, head, scratch, extra, route=chosen.name)
    out = trim(out, call.token_shape) if call.token_shape != run.token_shape else out
    log_route("linear_head_loss", hidden, chosen.name)
    return out


class LinearFunction(torch.autograd.Function):
    """apply(hidden [N, H], weight [V, H], bias, run, *tensors) -> (loss, rows, pred, means, scratch);
    ``tensors``: CallTensors. Backward returns (dh, dw, db) and None for the rest."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, run: LinearRun, *tensors):
        call = CallTensors(*tensors)
        wants = tuple(ctx.needs_input_grad[:3])
        handoff = False
        if run.traced:  # no compaction (the route's): the op
            nbytes = sum(t.numel() * t.element_size() for t, want in zip((hidden, weight, bias), wants) if want)
            handoff = run.grads_in_forward and any(wants) and ops.hands_off(nbytes)
            op = linear_forward_beside_op if handoff else linear_forward_op
            policy_tensors, *args = run_args(run)
            loss, rows, pred, means, scratch, dh, dw, db, token, stats = op(
                hidden, weight, bias, [*call, *policy_tensors], *args, wants=list(wants), handoff=handoff)
            rows_c, index = rows, None
            stats = stats if run.shard is not None and not run.grads_in_forward else None
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), wants))
            if handoff:
                ctx.grad_like = [(list(t.shape), t.dtype) if t is not None else None for t in (hidden, weight, bias)]
                dh, dw, db = token, None, None  # the token holds them (see ops.hand_off)
        else:
            out = linear_forward(run, hidden, weight, bias, call, wants)
            loss, rows, rows_c, pred, means, scratch = out.loss, out.rows, out.rows_computed, out.pred, out.means, \
                out.scratch
            index, dh, dw, db, stats = out.index, out.dh, out.dw, out.db, out.stats
        ctx.wants, ctx.handoff, ctx.weight_dtype = wants, handoff, weight.dtype
        if run.grads_in_forward:
            keep(ctx, run, (dh, dw, db), (rows, pred, means, scratch))
        else:
            keep(ctx, run, (hidden, weight, bias, *call, index, rows_c, scratch, stats), (pred, means, scratch))
        return FunctionOutputs(loss, rows, pred, means, scratch)

    @staticmethod
    def backward(ctx, d_loss, d_rows, *_):
        run: LinearRun = ctx.run
        nones = NO_GRADS
        if d_loss is None and d_rows is None:
            return None, None, None, *nones
        if run.grads_in_forward:
            d_loss = d_loss.float()
            if ctx.handoff:
                token = ctx.saved_tensors[0]
                return (*(take_grad(token, d_loss.reshape(1), i, *like) if want else None
                          for i, (want, like) in enumerate(zip(ctx.wants, ctx.grad_like))), *nones)
            guard_second_backward(ctx)
            dh, dw, db = ctx.saved_tensors
            if run.main_grad is not None and dw is not None:  # dW into the weight's main_grad, times d loss
                add_into(run.main_grad[1], dw, d_loss)  # (dw fp32 under fp32_weight_grad)
                dw = handed_over(run.main_grad[0], ctx.weight_dtype)
            elif dw is not None:
                dw = ops.scale(dw, d_loss, flat_geometry(dw))
            dh, db = (None if g is None else ops.scale(g, d_loss, flat_geometry(g)) for g in (dh, db))
            return dh, dw, db, *nones
        hidden, weight, bias, *saved = ctx.saved_tensors
        call = CallTensors(*saved[:len(CallTensors._fields)])
        kept = Saved(*saved[len(CallTensors._fields):])
        if run.traced:
            _, *args = run_args(replace(run, policy=None))
            dh, dw, db = linear_backward_op(hidden, weight, bias, [*call, kept.rows, kept.scratch, d_loss, d_rows,
                                                                   kept.stats], *args, list(ctx.wants))
            dh, dw, db = (g if want else None for g, want in zip((dh, dw, db), ctx.wants))
        else:
            dh, dw, db = linear_backward(run, ctx.wants, LmHead(hidden, weight, bias, None), tensors=call, saved=kept,
                                         d_loss=d_loss, d_rows=d_rows)
            if run.main_grad is not None and ctx.wants[1]:  # dW went into the weight's main_grad
                dw = handed_over(run.main_grad[0], hidden.dtype)
        return dh, dw, db, *nones


def _pad_last(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """A per-token input of completion ids [B, T - 1] padded to the rows [B, T] (advantages [B] stay)."""
    if t is None or name == "sequence_ids" or t.dim() != 2:
        return t
    return F.pad(t, (0, 1))


def trim(out: HeadLossOutput, token_shape: tuple[int, ...]) -> HeadLossOutput:
    """Per-token outputs over the rows [B, T] -> over the completion ids [B, T - 1]."""
    keep = token_shape[1]
    for name in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy", "selected_logprobs"):
        value = getattr(out, name)
        if value is not None:
            setattr(out, name, value[:, :keep])
    if out.loss.dim() == 2:
        out.loss = out.loss[:, :keep].clone()
    return out


def _torch_linear(call: LinearCall, spec: LossSpec, shard, options: LinearOptions, mode: str) -> HeadLossOutput:
    """The plain-torch path: the whole weight (and teacher) on every rank, each keeping its rows' gradient;
    with hidden_grad="partial" dh through this rank's columns only."""
    weight, bias, teacher = call.weight, call.bias, call.teacher
    local_rows = weight.shape[0]
    if shard is not None:
        weight = gather_vocab(weight.t(), shard).t()
        bias = None if bias is None else gather_vocab(bias[None], shard)[0]
        teacher = Teacher(None if teacher.logits is None else gather_vocab(teacher.logits.detach(), shard),
                          teacher.hidden,
                          None if teacher.weight is None else gather_vocab(teacher.weight.detach().t(), shard).t(),
                          None if teacher.bias is None else gather_vocab(teacher.bias.detach()[None], shard)[0])
    own = None if shard is None or options.hidden_grad == "reduced" else (shard.vocab_start, local_rows)
    return every_rank(shard, mode, call.hidden,
                      lambda: _torch_linear_loss(replace(call, weight=weight, bias=bias, teacher=teacher), spec, mode,
                                                 own))


def _torch_linear_loss(call: LinearCall, spec: LossSpec, mode: str, own) -> HeadLossOutput:
    """``own`` (vocab start, width): hidden_grad="partial", dh through this rank's columns only."""
    hidden, weight, bias, targets = call.hidden, call.weight, call.bias, call.targets
    if targets is not None:  # as the kernel path skips them: an ignored row's hidden state reaches nothing
        hidden = torch.where((targets != spec.ignore_index)[..., None], hidden, 0.0)
    if own is None:
        logits = F.linear(hidden, weight, bias)
    else:  # the same values; d hidden from this rank's columns, d weight from every row
        start, width = own
        logits = F.linear(hidden.detach(), weight, bias)
        mine = F.linear(hidden, weight[start:start + width].detach())
        logits = logits + F.pad(mine - mine.detach(), (start, weight.shape[0] - start - width))
    teacher = call.teacher
    t_logits = F.linear(teacher.hidden, teacher.weight, teacher.bias) if teacher.computed else teacher.logits
    if t_logits is not None:
        t_logits = t_logits.reshape(logits.shape)
    out = torch_head(logits, targets, spec, teacher_rows(t_logits, call.sparse), call.norm, mode, call.batch,
                     {"temperature": call.temperature, "token_weights": call.weights, "selected_ids": call.selected})
    return trim(out, call.token_shape) if targets is not None and tuple(targets.shape) != call.token_shape else out
