"""The fused lm_head as torch.library ops: the torch.compile path (whole chunks, no compaction).

:func:`linear_forward_op` / :func:`linear_backward_op` run headloss.linear's chunk loop inside one op
each; a vocab-parallel call's collectives (each chunk's all_gather, the hidden gradient's all-reduce)
run inside them on the group named in their arguments. A :class:`~headloss.linear.LinearRun` crosses
the op boundary as :func:`run_args` (names, ints, floats and the shard's layout), the call's tensors as
one list (:class:`~headloss.engine.CallTensors`, then the policy inputs' tensors).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .chunks import ChunkLoop, LinearRun, LmHead
from .head import CallTensors, stats_width
from .layouts import SCRATCH
from .linear import Saved, linear_backward, linear_forward
from .linear_policy import LOOPS
from .ops import BESIDE_GRAPH, flat_geometry, hand_off, kernel_op, token_fake
from .output import HeadOutputs
from .parallel import VocabShard
from .plan import KernelPlan, plan_from_key
from .policy.tokens import policy_as_lists, policy_from_lists
from .validation import VALIDATE_MODES

_N_CALL = len(CallTensors._fields)
_TOKEN_SHAPE_AT = 8  # run_args' ints: the token shape after eight scalars, the chunk loop's index the sixth
_LOOPS = tuple(LOOPS)


class OpArgs(NamedTuple):
    """A LinearRun as the ops take it (:func:`run_args`), in their argument order after the tensors."""

    policy_tensors: list[torch.Tensor | None]  # its policy inputs' tensors (after CallTensors in the tensor list)
    key: str  # the plan's
    group: str  # the process group's name ("" on one device)
    ints: list[int]
    floats: list[float]
    layout: list[int]  # the shard's


def run_args(run: LinearRun) -> OpArgs:
    """``run`` as the ops take it: its policy inputs' tensors, the plan's key, the group's name (""
    on one device), ints, floats, the shard's layout.
    Not carried: ``compact`` (off under compile) and ``objective`` (the corrected routes are not traced)."""
    policy_tensors, policy_values = policy_as_lists(run.policy)
    shard = run.shard
    group = "" if shard is None else shard.group.group_name
    layout = [] if shard is None else [shard.vocab_start, shard.vocab_total, shard.world, int(shard.comm_cpu)]
    ints = [run.chunk_rows, run.teacher_rows, run.seq_len, int(run.fp32_weight_grad), run.ignore_index,
            int(run.reduce_hidden_grad), _LOOPS.index(run.loop.name), VALIDATE_MODES.index(run.validate),
            *run.token_shape]
    return OpArgs(policy_tensors, run.plan.key, group, ints, [run.norm, *policy_values], layout)


def run_of_args(policy_tensors, key: str, group: str, ints: list[int], floats: list[float], layout: list[int]
                ) -> LinearRun:
    """The LinearRun of :func:`run_args`' values (traced)."""
    shard = None
    if group:
        from torch.distributed.distributed_c10d import _resolve_process_group

        start, total, world, comm_cpu = layout
        shard = VocabShard(_resolve_process_group(group), start, total, world, bool(comm_cpu))
    chunk_rows, teacher_rows, seq_len, fp32_weight_grad, ignore_index, reduce, loop, validate, *token_shape = ints
    return LinearRun(plan=plan_from_key(key), chunk_rows=chunk_rows, fp32_weight_grad=bool(fp32_weight_grad),
                     compact=False, validate=VALIDATE_MODES[validate], token_shape=tuple(token_shape),
                     ignore_index=ignore_index, norm=floats[0], loop=LOOPS[_LOOPS[loop]], traced=True, shard=shard,
                     seq_len=seq_len, policy=policy_from_lists(policy_tensors, floats[1:]),
                     reduce_hidden_grad=bool(reduce), teacher_rows=teacher_rows)


def stats_shape(plan: KernelPlan, loop: ChunkLoop, sharded: bool, wants, call: CallTensors, rows: int
                ) -> tuple[int, ...]:
    """The shape of linear_forward_op's last output: [rows, width] where linear_forward keeps each
    row's merged statistics for the backward (deferred mode, vocab-parallel), else empty."""
    kept = sharded and not (loop.grads_in_forward(plan) and any(wants))
    return (rows, stats_width(call.teacher.present, call.teacher_ids, plan)) if kept else (0,)


def _fake_linear_forward(hidden, weight, bias, tensors, key, group, ints, floats, layout, wants, handoff):
    """linear_forward_op's outputs, unfilled."""
    plan, loop = plan_from_key(key), LOOPS[_LOOPS[ints[_TOKEN_SHAPE_AT - 2]]]
    loss, rows, pred, means = HeadOutputs.empty(plan, hidden.shape[0], hidden.device, tuple(ints[_TOKEN_SHAPE_AT:]))
    scratch = torch.empty(SCRATCH.N, dtype=torch.int64, device=hidden.device)
    fused = loop.grads_in_forward(plan) and not handoff
    dh, dw, db = (
        torch.empty(like.shape if fused and want else (0,), dtype=like.dtype, device=hidden.device)
        for like, want in zip((hidden, weight, bias if bias is not None else hidden.new_empty(0)), wants)
    )
    token = token_fake() if handoff else hidden.new_empty(0, dtype=torch.int64)
    call = CallTensors(*tensors[:_N_CALL])
    stats = torch.empty(stats_shape(plan, loop, bool(group), wants, call, hidden.shape[0]),
                        dtype=torch.float32, device=hidden.device)
    return loss, rows, pred, means, scratch, dh, dw, db, token, stats


def _forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tensors: list[torch.Tensor | None],
    key: str, group: str, ints: list[int], floats: list[float], layout: list[int], wants: list[bool], handoff: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_forward as an op (``tensors``: CallTensors, then the run's policy tensors; ``key`` ..
    ``layout``: :func:`run_args`): fused mode's (or sequence chunks') (dh, dw, db), or with ``handoff``
    (only through ``linear_forward_beside``, the op tagged to run beside mode="reduce-overhead"'s
    graphs) empty ones and a token holding them (see ops.hand_off; otherwise the token is an empty
    tensor); last, deferred mode's merged statistics of a vocab-parallel call (else empty)."""
    run = run_of_args(tensors[_N_CALL:], key, group, ints, floats, layout)
    call = CallTensors(*tensors[:_N_CALL])
    out = linear_forward(run, hidden, weight, bias, call, tuple(wants))
    dh, dw, db, stats = out.dh, out.dw, out.db, out.stats
    token = hidden.new_empty(0, dtype=torch.int64)
    if handoff:
        token = hand_off([None if g is None else (g, flat_geometry(g)) for g in (dh, dw, db)])
        dh = dw = db = None
    if stats is None:  # kept, with no row to compute; or not kept
        stats = torch.empty(stats_shape(run.plan, run.loop, run.shard is not None, wants, call,
                                        hidden.shape[0]), dtype=torch.float32, device=hidden.device)
    return (out.loss, out.rows, out.pred, out.means, out.scratch,
            *(g if g is not None else hidden.new_empty(0) for g in (dh, dw, db)), token, stats)


linear_forward_op = kernel_op("headloss::linear_forward", fake=_fake_linear_forward)(_forward_op)
linear_forward_beside_op = kernel_op("headloss::linear_forward_beside", fake=_fake_linear_forward,
                                     tags=BESIDE_GRAPH)(_forward_op)


def _fake_linear_backward(hidden, weight, bias, *rest):
    """linear_backward_op's outputs, unfilled (``wants`` is the last argument)."""
    wants = rest[-1]
    likes = (hidden, weight, bias if bias is not None else hidden.new_empty(0))
    return tuple(torch.empty(like.shape if want else (0,), dtype=like.dtype, device=hidden.device)
                 for like, want in zip(likes, wants))


@kernel_op("headloss::linear_backward", fake=_fake_linear_backward)
def linear_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tensors: list[torch.Tensor | None],
    key: str, group: str, ints: list[int], floats: list[float], layout: list[int], wants: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deferred mode's (dh, dw, db) over whole chunks, empty where not wanted (``tensors``: CallTensors, then
    the forward's rows, scratch, d_loss, d_rows and (vocab-parallel) merged statistics; the rest as
    linear_forward_op's, without policy inputs)."""
    run = run_of_args([], key, group, ints, floats, layout)
    call = CallTensors(*tensors[:_N_CALL])
    rows, scratch, d_loss, d_rows, stats = tensors[_N_CALL:]
    saved = Saved(None, rows, scratch, stats if run.shard is not None else None)
    grads = linear_backward(run, tuple(wants), LmHead(hidden, weight, bias, None), tensors=call, saved=saved,
                            d_loss=d_loss, d_rows=d_rows)
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)

