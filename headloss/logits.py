"""The logits entry point's run: checks -> route -> kernels (or plain torch) -> output.

:func:`run_head` is :func:`headloss.head_loss` after the door bundled its keywords and made the plan:
the vocab-parallel layout, then the plain-torch path or the kernels' path. On the kernels' path the
host-side checks (headloss.inputs) and the route (headloss.routes) come first, then
:class:`~headloss.engine.HeadFunction`; a repeated call without policy inputs finds its checks'
outcome and its route in its recipe (made on its first call, found by its signature and, with a
group, its cached vocabulary layout).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from . import env, routes
from .batch import CallInputs, Layout, Options, PolicyBatch, Teacher
from .bounded import BoundedDict, cache
from .engine import HeadFunction, HeadRun
from .env import log_route
from .head import CallTensors, PerSlot, teacher_rows, torch_head
from .inputs import (
    check_head,
    check_logits,
    check_student_topk,
    check_targets,
    check_teacher,
    flat_targets,
    head_call,
    pad_shifted,
    resolved_teacher,
    sparse_teacher,
    teacher_precision,
)
from .output import HeadLossOutput, HeadOutputs, assemble
from .packed import packed_call, packed_policy_inputs
from .parallel import (
    TRACED_TORCH,
    dtensor_shard,
    every_rank,
    gather_vocab,
    handshake,
    is_dtensor,
    shard_of,
    traced_refusals,
    traced_shard,
)
from .plan import KernelPlan
from .policy.inputs import policy_inputs
from .routes import Route, facts_of, resolve_backend
from .row_inputs import flat_selected_ids, flat_temperature, flat_token_weights
from .validation import normaliser, validation_mode


class _Laid(NamedTuple):
    """A head_loss call after its layouts (packed rows unpacked, a vocab-parallel call's local slice): what
    each path takes."""

    logits: Any
    targets: Any
    plan: KernelPlan
    teacher: Teacher
    batch: PolicyBatch
    shift: bool
    num_items_in_batch: Any
    options: Options
    shard: Any  # vocab-parallel: a headloss.parallel.VocabShard, else None
    temperature: Any = None  # per row or per sequence (spec.LogitTransform.per_row_temperature), as given
    weights: Any = None  # the token weights per row or per sequence (spec.TokenWeights), as given
    selected: Any = None  # the selected ids [.., K] (outputs: selected_logprobs), as given


def run_head(logits, targets, plan: KernelPlan, call: CallInputs, options: Options) -> HeadLossOutput:
    """head_loss of the bundled inputs (headloss.api)."""
    traced = torch.compiler.is_compiling()
    spec = plan.spec
    call = resolved_teacher(call, spec)
    teacher, batch, layout = call.teacher, call.batch, call.layout
    shift = layout.shift
    temperature, weights = call.temperature, call.token_weights
    teacher_logits = teacher.logits
    if not traced:  # a lazily negated view (torch._neg_view): the kernels read the stored values, torch the sign
        logits, teacher_logits = _resolved(logits), _resolved(teacher_logits)
    teacher_logits = teacher_precision(teacher_logits, logits)
    if layout.packed:
        logits, targets, (teacher_logits, ids, logprobs), packed = packed_call(
            logits, targets, (teacher_logits, teacher.ids, teacher.logprobs), layout.cu_seqlens, layout.position_ids,
            shift, spec.ignore_index, validation_mode(options.validate))
        teacher = replace(teacher, ids=ids, logprobs=logprobs)
        shift = False
        rows, per_sequence = (packed.seq.numel(),), (packed.n_slots, packed.seq) if packed.per_sequence else None
        if temperature is not None:  # one per row, from one per sequence where given so
            temperature = flat_temperature(temperature, spec, rows, packed.seq.device, per_sequence)
        if weights is not None:
            weights = flat_token_weights(weights, spec, rows, packed.seq.device, per_sequence)
        if spec.policy is not None:
            batch = PolicyBatch.of(packed_policy_inputs(batch.by_name(), packed))
    shard = None
    reusable = True  # a recipe may hold the call's layout: a group's cached one, not a DTensor's or a "sync" call's
    if options.group is not None or is_dtensor(logits):
        sync = validation_mode(options.validate) == "sync"
        reusable = not sync and not is_dtensor(logits)
        logits, targets, teacher_logits, shard = _vocab_shard(logits, targets, teacher_logits, options, sync)
    recipe_key = None
    plain = (options.route is None and spec.policy is None and batch.empty and reusable and temperature is None
             and weights is None and call.selected_ids is None)
    if plain and not traced and not teacher.sparse:
        recipe_key = _recipe_key(plan, logits, targets, teacher_logits, shift, options, shard)
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    dtype = logits.dtype if isinstance(logits, torch.Tensor) else torch.float32
    if teacher_logits is not teacher.logits:
        teacher = replace(teacher, logits=teacher_logits)
    laid = _Laid(logits, targets, plan, teacher, batch, shift, call.num_items_in_batch, options, shard, temperature,
                 weights, call.selected_ids)
    if resolve_backend(options.backend, device, dtype) == "torch":
        return _torch_head(laid)
    return _on_kernels(laid, recipe_key)


def _resolved(t):
    return t.resolve_neg() if isinstance(t, torch.Tensor) and t.is_neg() else t


def _on_kernels(laid: _Laid, recipe_key: tuple | None) -> HeadLossOutput:
    """The kernels' path: checks and the route (a repeated plain call finds both in its recipe), HeadFunction,
    the policy term's share outside it, the output."""
    logits, targets, plan, teacher = laid.logits, laid.targets, laid.plan, laid.teacher
    recipe = None if recipe_key is None else _RECIPES.get(recipe_key)
    if recipe is None or recipe.plan is not plan or recipe.run.shard is not laid.shard:
        run, tensors, chosen, pol = _checked(laid)
        if recipe_key is not None:
            flat = targets is None or (targets.dim() == 1 and targets.dtype in (torch.int64, torch.int32)
                                       and targets.is_contiguous())
            _RECIPES[recipe_key] = _Recipe(plan, replace(run, geo=run.geo._replace(norm=0.0)), flat, chosen)
    else:  # a repeated call without policy inputs: only num_items_in_batch is checked
        norm = normaliser(laid.num_items_in_batch, recipe.plan.spec, logits.device)
        run = recipe.run if not norm.value else replace(recipe.run, geo=recipe.run.geo._replace(norm=norm.value))
        tensors = CallTensors(targets if recipe.flat_targets else flat_targets(targets),
                              None if teacher.logits is None else teacher.logits.detach(), num_items=norm.tensor)
        chosen, pol = recipe.route, None
    loss, rows, pred, means, scratch = HeadFunction.apply(logits, run, *tensors)
    head, extra = chosen.policy_share(plan, HeadOutputs(loss, rows, pred, means), scratch, pol,
                                      reduced=run.seq_len > 0)
    # a plain call's output is made when first read (a step that reads only the loss skips its host time)
    out = assemble(plan, run.token_shape, head, scratch, extra, route=chosen.name,
                   lazy=recipe_key is not None)
    log_route("head_loss", logits, chosen.name)
    return out


def _checked(laid: _Laid) -> tuple:
    """(HeadRun, CallTensors, Route, PolicyTokens or None) of a call after every host-side check; with a
    group and validate="sync", every rank learns of any rank's error."""
    logits, targets, plan, teacher, batch, shift, num_items_in_batch, options, shard, temperature, weights, \
        selected = laid
    spec = plan.spec
    sync = validation_mode(options.validate) == "sync"
    error = call = chosen = None
    given = batch.by_name()
    try:
        token_shape = check_head(logits, targets, spec, teacher.logits, shift, kernel=True)
        check_student_topk(spec, logits.shape[-1] if shard is None else shard.vocab_total)
        temperature = flat_temperature(temperature, spec, token_shape, logits.device)
        weights = flat_token_weights(weights, spec, token_shape, logits.device)
        selected = flat_selected_ids(selected, token_shape, logits.device)
        chosen = routes.choose(plan, facts_of("logits", "triton", logits.device, token_shape, given,
                                              sharded=shard is not None), options.route)
        unpacked = CallInputs(teacher, batch, Layout(shift), num_items_in_batch, token_weights=weights)
        call = head_call(logits, targets, spec, token_shape, unpacked, validate=options.validate,
                         raw_policy=chosen.raw_inputs, vocab_total=None if shard is None else shard.vocab_total)
    except (ValueError, TypeError) as exc:
        if shard is None or not sync:
            raise
        error = exc
    if shard is not None and sync:  # every rank learns of any rank's error
        handshake(shard, logits.shape[:-1].numel() if isinstance(logits, torch.Tensor) else -1, error,
                  logits.device)
    pol = call.policy
    rows_per_seq = pol.seq_len if pol is not None and isinstance(pol.seq_len, int) else 0
    geo = call.geo
    if shard is not None:
        geo = geo._replace(vocab_start=shard.vocab_start, V_total=shard.vocab_total)
    inside = chosen.term.in_head_node  # deferred+kernels: the policy term inside the head's autograd node
    run = HeadRun(plan, geo, options.inplace_grad, call.validate, call.token_shape, traced=chosen.traced,
                  adv_span=pol.adv_span if pol is not None else 1, seq_len=rows_per_seq, shard=shard,
                  objective=pol if inside else None)
    tensors = CallTensors.of(call.targets, Teacher(logits=call.teacher), chosen.epilogue_policy(pol), call.norm.tensor,
                             None if pol is None else pol.sequence_ids, call.sparse,
                             PerSlot(temperature, weights, selected))
    return run, tensors, chosen, pol


def _torch_head(laid: _Laid) -> HeadLossOutput:
    """The plain-torch path: vocab-parallel logits gathered whole on every rank first."""
    logits, teacher, options, shard = laid.logits, laid.teacher, laid.options, laid.shard
    teacher_logits = teacher.logits
    traced = torch.compiler.is_compiling()
    mode = validation_mode(options.validate)
    if shard is not None and traced:
        raise NotImplementedError(TRACED_TORCH)
    if shard is not None:
        if mode == "sync":  # whole rows on every rank before gathering them
            error = None
            try:
                check_logits(logits)
            except (ValueError, TypeError) as exc:
                error = exc
            handshake(shard, logits.shape[:-1].numel() if isinstance(logits, torch.Tensor) else -1, error,
                      logits.device)
        logits = gather_vocab(logits, shard)
        if teacher_logits is not None:
            teacher_logits = gather_vocab(teacher_logits.detach(), shard)
    return every_rank(shard, mode, logits,
                      lambda: _torch_loss(laid._replace(logits=logits, teacher=replace(teacher, logits=teacher_logits),
                                                        shard=None)))


def _torch_loss(laid: _Laid) -> HeadLossOutput:
    """The plain-torch path (the logits whole), with the same checks and the same shift conventions; the
    route (torch) is chosen after them, as on the kernels' path."""
    logits, targets, plan, teacher, batch, shift, num_items_in_batch, options, _, temperature, weights, selected = laid
    spec = plan.spec
    validate = options.validate
    traced = torch.compiler.is_compiling()
    teacher_logits = teacher.logits
    check_logits(logits)
    check_student_topk(spec, logits.shape[-1])
    rows_shape = tuple(logits.shape[:-1])
    check_targets(targets, rows_shape, spec, logits.device, shift)
    check_teacher(tuple(logits.shape), logits.device, teacher_logits, spec, kernel=False)
    token_shape = tuple(targets.shape) if targets is not None else rows_shape
    temperature = flat_temperature(temperature, spec, token_shape, logits.device)
    weights = flat_token_weights(weights, spec, token_shape, logits.device)
    selected = flat_selected_ids(selected, token_shape, logits.device)
    mode = validation_mode(validate)
    sparse = sparse_teacher(spec, teacher, rows_shape, tuple(targets.shape) if shift else rows_shape, logits.device,
                            logits.shape[-1], "off" if mode == "off" or traced else "sync",
                            align="shift" if shift else "rows")
    norm = normaliser(num_items_in_batch, spec, logits.device)
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
    policy_inputs(spec.policy, targets, spec.ignore_index, norm.as_torch(), mode,
                  batch.by_name())  # the same input errors as the kernel path
    facts = routes.Facts("logits", "torch", rows_shape, batch.sequence_ids is not None, False, traced, False, False)
    chosen = routes.choose(plan, facts, options.route)
    out = torch_head(logits, targets, spec, teacher_rows(teacher_logits, sparse), norm, mode, batch,
                     {"temperature": temperature, "token_weights": weights, "selected_ids": selected})
    out.route = chosen.name
    log_route("head_loss", logits, chosen.name)
    return out


def _vocab_shard(logits, targets, teacher_logits, options: Options, sync: bool):
    """(local logits, local targets, local teacher logits, VocabShard) of a vocab-parallel call
    (``sync``: validate="sync"); what it cannot do yet is refused here, on every rank alike, before any
    collective."""
    group = options.group
    if torch.compiler.is_compiling():  # the kernels' path: the layout a constant, the statistics' all_gather traced
        traced_refusals("logits", (logits, targets, teacher_logits), sync)
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


# --- the recipe: a repeated call's checks skipped ----------------------------------------------------


class _Recipe(NamedTuple):
    """What a head_loss call without policy inputs runs with, apart from its tensors and its
    num_items_in_batch: found again by the call's signature (the plan, every input's type, shape,
    strides, dtype and device, and a group's cached vocabulary layout), so a repeated call skips the
    input checks, which its signature decides, and the geometry (host time, see benchmarks/bench_host.py).
    A group's call with validate="sync" (which exchanges every rank's verdict) and a DTensor's take the
    checked path each time."""

    plan: KernelPlan
    run: HeadRun  # the kernel run (its geometry without num_items_in_batch)
    flat_targets: bool  # the targets are the dense int vector the kernels read
    route: Route


_RECIPES: BoundedDict[tuple, _Recipe] = cache("logits.recipes", 1024,
                                               "head_loss's checked geometry and route by call signature")
_KNOWN_BACKENDS = ("auto", "triton", "torch")


def _signature(t: Any) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _recipe_key(plan: KernelPlan, logits, targets, teacher_logits, shift, options: Options, shard) -> tuple | None:
    """The key of a call's recipe: its signature, and a group's cached vocabulary layout (the recipe's run
    holds it: its id is not reused while the recipe lives; clear_layouts makes a new one); None where the
    call is not one (unusual argument types take the checked path, which names them)."""
    validate, backend = options.validate, options.backend
    known_validate = validate is None or validate is True or validate is False or \
        (type(validate) is str and validate == "sync")
    if type(logits) is not torch.Tensor or not (targets is None or type(targets) is torch.Tensor) or \
            not (teacher_logits is None or type(teacher_logits) is torch.Tensor) or not known_validate or \
            type(backend) is not str or backend not in _KNOWN_BACKENDS:
        return None
    return (id(plan), _signature(logits), _signature(targets), _signature(teacher_logits), bool(shift),
            bool(options.inplace_grad), validate, env.validate_default() if validate is None else None, backend,
            env.INTERPRETER, None if shard is None else id(shard))
