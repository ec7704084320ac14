"""The head on a block of rows, once for both doors.

The logits door (headloss.engine) runs it on its logits as one block; the fused lm_head
(headloss.linear) on each chunk's logits after the chunk's GEMM, as quack's chunked cross-entropy
runs its logits path on each chunk. A call opens a :class:`HeadCall` -- its verdict slot, its scratch
prepared (or that work left to the head kernel's first program), a sparse teacher's check, a
vocab-parallel call's verdict handshake --, runs :meth:`HeadCall.block` on each block of rows (a
vocab-parallel block's statistics exchanged first: one all_gather), and closes it (the verdict
settled). Chunked calls reduce their rows once, with :meth:`HeadCall.finish`. The plain-torch path's
head is :func:`torch_head` (headloss.reference), for both doors too.

:class:`CallTensors` is a call's tensors besides its rows, in the one order in which they cross the
autograd and torch.library boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .batch import PolicyBatch, Teacher
from .kernels.head import PolicyRows, launch_finish, launch_head, prepare
from .kernels.launch import Geometry
from .kernels.shard import launch_merge, launch_shard_jsd, launch_shard_stats
from .kernels.sparse import SparseRows, block_if, block_of, launch_check_selected, launch_check_teacher
from .layouts import JSD_SHARES, STATS, scratch_size
from .ops import geo_ints, geo_of, kernel_op
from .output import HeadLossOutput, HeadOutputs
from .parallel import all_reduce_sum, gather_merged, handshake_verdict
from .plan import KernelPlan, plan_from_key
from .policy.tokens import PolicyTokens
from .reference import reference_head_loss
from .spec import LossSpec
from .validation import CheckContext, Normaliser, settle, verdict_slot


class PerSlot(NamedTuple):
    """A call's per-row inputs, one per slot, checked and flat: the per-row temperatures ([n_out] fp32), the
    token weights ([n_out] fp32) and the selected ids ([n_out, K] int64), each or None."""

    temperature: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    selected: torch.Tensor | None = None


class CallTensors(NamedTuple):
    """A call's tensors besides its rows (logits, or hidden states, weight and bias), checked and flat, in
    the one order in which they cross the autograd and torch.library boundaries (``*tensors``)."""

    targets: torch.Tensor | None = None  # [N] ids or ignore_index
    teacher_logits: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None  # the lm_head's computed teacher
    teacher_weight: torch.Tensor | None = None
    teacher_bias: torch.Tensor | None = None
    old: torch.Tensor | None = None  # the fused epilogue's policy rows (kernels.head.PolicyRows)
    ref: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    iw: torch.Tensor | None = None
    policy_weight: torch.Tensor | None = None
    num_items: torch.Tensor | None = None  # the normaliser, when a tensor
    sequence_ids: torch.Tensor | None = None  # [N] rows' sequences
    teacher_ids: torch.Tensor | None = None  # a top-k teacher's ids [n_out, K] (kernels.sparse.SparseRows)
    teacher_logprobs: torch.Tensor | None = None  # its log-probs [n_out, K], or a per-token teacher's [n_out]
    temperature: torch.Tensor | None = None  # [n_out] fp32 per-row temperature (spec.LogitTransform)
    teacher_probs: torch.Tensor | None = None  # a top-k teacher given as probabilities (SparseRows.probs)
    weights: torch.Tensor | None = None  # [n_out] fp32 token weights (spec.TokenWeights)
    selected: torch.Tensor | None = None  # [n_out, K] int64 selected ids (outputs: selected_logprobs)

    @classmethod
    def of(cls, targets, teacher: Teacher, epilogue: PolicyTokens | None, num_items, sequence_ids,
           sparse: SparseRows | None = None, per_slot: PerSlot | None = None) -> CallTensors:
        """The tensors of a call; ``epilogue``: the policy inputs the fused epilogue reads (else None);
        ``sparse``: a top-k or per-token teacher, laid out per slot; ``per_slot``: the per-row inputs."""
        temperature, weights, selected = per_slot if per_slot is not None else (None, None, None)
        rows = (None,) * 5 if epilogue is None else (
            epilogue.old_logprobs, epilogue.ref_logprobs, epilogue.advantages, epilogue.importance_weights,
            epilogue.weight)
        old, ref, adv, iw, weight = rows
        ids, logprobs, probs = (None, None, None) if sparse is None else (sparse.ids, sparse.logprobs, sparse.probs)
        return cls(targets, teacher.logits, teacher.hidden, teacher.weight, teacher.bias, old=old, ref=ref, adv=adv,
                   iw=iw, policy_weight=weight, num_items=num_items, sequence_ids=sequence_ids, teacher_ids=ids,
                   teacher_logprobs=logprobs, temperature=temperature, teacher_probs=probs, weights=weights,
                   selected=selected)

    @property
    def sparse(self) -> SparseRows | None:
        """The sparse teacher as the kernels take it, or None."""
        if self.teacher_logprobs is None:
            return None
        return SparseRows(self.teacher_ids, self.teacher_logprobs,
                          1 if self.teacher_ids is None else self.teacher_ids.shape[-1], self.teacher_probs)

    @property
    def teacher(self) -> Teacher:
        return Teacher(self.teacher_logits, self.teacher_hidden, self.teacher_weight, self.teacher_bias)

    def policy_rows(self, adv_span: int = 1, seq_len: int = 0) -> PolicyRows | None:
        if self.adv is None:
            return None
        return PolicyRows(self.old, self.ref, self.adv, self.iw, self.policy_weight, adv_span, seq_len)


def no_rows(plan: KernelPlan, loss: torch.Tensor, means: torch.Tensor) -> None:
    """A call with no logits rows: the kernel never runs, the loss and every metric are 0 (ratios 1)."""
    loss.zero_()
    means.zero_()
    for name, index in plan.metric_index:
        if name.startswith("ratio/"):
            means[index] = 1.0


def optional(t: torch.Tensor | None) -> torch.Tensor | None:
    """An empty tensor stands for an absent one (an op's output cannot be None)."""
    return t if t is None or t.numel() else None


class Block(NamedTuple):
    """A block of rows the head runs on: a logits call's whole logits, or a part of one lm_head chunk."""

    logits: torch.Tensor  # [rows, V(_rank)]
    geo: Geometry
    targets: torch.Tensor | None
    teacher: torch.Tensor | None  # the teacher's logits of these rows
    sparse: SparseRows | None = None  # a top-k or per-token teacher of these rows
    policy: PolicyRows | None = None  # the fused epilogue's policy inputs of these rows
    temperature: torch.Tensor | None = None  # these rows' per-row temperatures, per slot
    row_ids: torch.Tensor | None = None  # each slot's row of the call, where it is not the slot (lm_head chunks)
    weights: torch.Tensor | None = None  # these rows' token weights, per slot
    selected: torch.Tensor | None = None  # these rows' selected ids [slots, K], per slot


INLINE_PREPARE_SLOTS = 1 << 14
"""Up to this many slots, a one-block call leaves prepare's work (count the scored rows, check the
targets and sequence ids, zero the policy term's counters: O(slots), one program, 512 targets a step)
to the head kernel's first program to take the call's ticket instead of a launch of its own: one
launch less, 20-40 us of host time per call (benchmarks/bench_host.py; more on a slower host, where
a vocab-parallel call's host time can exceed its GPU time: benchmarks/profile_parallel.py). Other
programs wait for it only before their policy values, their gradient pass and their completion count,
so with rows of any real vocabulary it is done long before. Above this, prepare_kernel (4096 targets
a step, 8 warps) keeps one program's longer serial pass off the critical path; so it does for a
vocab-parallel call with validate="sync", whose verdict every rank learns before the statistics."""


@dataclass
class HeadCall:
    """One call's head: its verdict slot and scratch, opened once; blocks of rows run on it; closed once."""

    plan: KernelPlan
    tensors: CallTensors
    validate: str  # async, sync, off
    shard: Any  # vocab-parallel: a headloss.parallel.VocabShard (eager), else None
    device: torch.device
    verdict: tuple | None
    scratch: torch.Tensor
    whole: Geometry  # the call's rows, against all of V
    one_block: bool  # the call's rows are one block: the head kernel reduces them and may prepare
    inline: bool = False  # the head kernel's first program prepares (one_block calls)
    n_seq: int = 0  # sequences with per-sequence policy counters in scratch

    @classmethod
    def open(cls, run, tensors: CallTensors, geo: Geometry, device, one_block: bool = False, n_seq: int = 0
             ) -> HeadCall:
        """A call's verdict slot, its scratch (prepared, or for a small one-block call left to the head
        kernel), the sparse teacher's check and a vocab-parallel call's verdict handshake. ``run``: the
        call's plan, validation mode, shard and token shape (engine.HeadRun, chunks.LinearRun); ``geo``:
        its rows (a vocab-parallel call's: V this rank's, V_total all)."""
        validate, shard = run.validate, run.shard
        sharded = geo.V_total > 0
        whole = geo._replace(V=geo.V_total) if sharded else geo  # targets are checked against all of V
        sparse = tensors.sparse
        context = CheckContext.of(run.token_shape, whole.V, geo.ignore_index, sparse)
        if tensors.selected is not None:
            context = context._replace(selected_k=tensors.selected.shape[-1])
        verdict = verdict_slot(validate, device, context)
        # not where validate="sync" exchanges the verdict of a vocab-parallel call before its statistics
        # (prepare_kernel's, read on the host)
        inline = (one_block and (not sharded or validate != "sync") and 0 < geo.n_rows
                  and geo.n_out <= INLINE_PREPARE_SLOTS)
        if inline:
            scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=device)
        else:
            scratch = prepare(tensors.targets, tensors.num_items, tensors.sequence_ids, whole, device, verdict, n_seq,
                              tensors.temperature, tensors.weights)
        if sparse is not None and verdict is not None and validate != "sync":  # ("sync": read on the host, in inputs)
            launch_check_teacher(sparse, whole.V, verdict)
        if tensors.selected is not None and verdict is not None:
            launch_check_selected(tensors.selected, whole.V, verdict)
        if shard is not None and validate == "sync":
            handshake_verdict(shard, verdict, device)
        return cls(run.plan, tensors, validate, shard, device, verdict, scratch, whole, one_block, inline, n_seq)

    def block(self, block: Block, out: HeadOutputs, grad: torch.Tensor | None = None,
              gathered: tuple | None = None) -> torch.Tensor | None:
        """The head kernel on ``block`` into ``out`` (its rows' outputs, the call's means), the gradient into
        ``grad`` (fused mode); a one-block call's reduces the call. A vocab-parallel block's statistics are
        exchanged first, or given (``gathered``: (stats, jsd), exchanged by the traced graph). Returns the
        statistics, which a deferred backward reads."""
        plan, geo = self.plan, block.geo
        stats, jsd = gathered if gathered is not None else (None, None)
        if self.shard is not None and geo.n_rows:
            # the one block's statistics that are the student's alone stay as gathered: the head kernel
            # merges each row's (one launch fewer); a chunk's are merged, as its backward reads them
            stats, jsd = shard_statistics(plan, block, self.shard, merged=not self.one_block)
        if geo.n_rows == 0:
            if self.one_block:
                no_rows(plan, out.loss, out.means)
            return stats
        launch_head(plan, logits=block.logits, targets=block.targets, teacher=block.teacher, grad=grad, rows=out.rows,
                    pred=optional(out.pred), policy=block.policy, num_items=self.tensors.num_items,
                    scratch=self.scratch, loss=out.loss, means=out.means, geo=geo, finish=self.one_block, stats=stats,
                    jsd=jsd, verdict=self.verdict, prepared=not self.inline, sequence_ids=self.tensors.sequence_ids,
                    n_seq=self.n_seq, sparse=block.sparse, temperature=block.temperature, row_ids=block.row_ids,
                    weights=block.weights, selected=block.selected)
        return stats

    def finish(self, out: HeadOutputs) -> None:
        """A chunked call's reduction of its ``out.rows`` (the computed rows): the loss and the means."""
        computed = out.rows.shape[0]
        if computed == 0:
            no_rows(self.plan, out.loss, out.means)
        else:
            launch_finish(self.plan, rows=out.rows, loss=out.loss, means=out.means, scratch=self.scratch,
                          num_items=self.tensors.num_items, geo=self.whole._replace(n_out=computed))

    def close(self) -> None:
        """The verdict settled: on CPU, or with validate="sync", a bad input raises here."""
        settle(self.verdict, self.validate, self.device)


def teacher_rows(teacher_logits: torch.Tensor | None, sparse: SparseRows | None) -> Teacher:
    """:func:`torch_head`'s teacher: its logits (or probabilities), or a sparse teacher's ids and log-probs."""
    return Teacher(teacher_logits, ids=None if sparse is None else sparse.ids,
                   logprobs=None if sparse is None else sparse.logprobs)


def torch_head(logits, targets, spec: LossSpec, teacher: Teacher, norm: Normaliser, mode: str, batch: PolicyBatch,
               per_row: dict[str, torch.Tensor | None] | None = None) -> HeadLossOutput:
    """The plain-torch path's head on a call's whole logits (headloss.reference), as both doors run it:
    the teacher (its logits, or a sparse teacher's ids and log-probs laid out per row), the checked
    normaliser, the validation mode, the policy inputs given, the per-row inputs by name (``temperature``,
    ``token_weights``: one per row of ``logits``, or None)."""
    given = {k: v for k, v in {**batch.by_name(), **(per_row or {})}.items() if v is not None}
    dense = "teacher_probs" if spec.distillation is not None and spec.distillation.teacher == "probs" else \
        "teacher_logits"
    given[dense] = teacher.logits
    return reference_head_loss(logits, targets, spec, teacher_ids=teacher.ids, teacher_logprobs=teacher.logprobs,
                               num_items_in_batch=norm.as_torch(), validate=mode, **given)


# --- a vocab-parallel block's statistics ----------------------------------------------------------


def shard_statistics(plan: KernelPlan, block: Block, shard, merged: bool = True) -> tuple:
    """Vocab-parallel: (merged statistics, summed mixture-JSD shares or None) of this shard's rows of
    ``block`` -- one all_gather, and for the mixture JSD one all-reduce more. A top-k teacher's K logits
    per row follow the merged statistics (the same all_gather). ``merged=False``: statistics
    that are the student's alone stay as gathered, (world, rows, N), and the head kernels merge each
    row's (kernels.shard.gathered_stats: one launch fewer; the rows are not cut after)."""
    logits, targets, teacher, geo, sparse = block.logits, block.targets, block.teacher, block.geo, block.sparse
    topk = sparse is not None and sparse.ids is not None
    part = launch_shard_stats(plan, logits=logits, targets=targets, geo=geo, teacher=teacher,
                              sparse=sparse if topk else None, temperature=block.temperature, selected=block.selected)
    tail = stats_tail(sparse.ids if topk else None, plan)
    stats = gather_merged(part, shard, plan.flags.OWN_TEMP, tail, merge=merged or bool(tail) or teacher is not None,
                          keys=topk_keys(plan))
    jsd = None
    if plan.flags.DISTILL_KIND == 2:
        jsd = launch_shard_jsd(plan, logits=logits, targets=targets, teacher=teacher, stats=stats, geo=geo,
                               temperature=block.temperature)
        jsd = all_reduce_sum(jsd, shard, "jsd")
    return stats, jsd


def traced_shard_statistics(plan: KernelPlan, block: Block, shard) -> tuple:
    """:func:`shard_statistics` under torch.compile: the kernels as ops, the all_gather (and the mixture
    JSD's all-reduce) as functional collectives the graph holds."""
    import torch.distributed._functional_collectives as funcol

    logits, targets, teacher, geo, sparse = block.logits, block.targets, block.teacher, block.geo, block.sparse
    ids, logprobs = (sparse.ids, sparse.logprobs) if sparse is not None and sparse.ids is not None else (None, None)
    part = shard_stats_op(logits, targets, teacher, ids, logprobs, block.temperature, block.selected, plan.key,
                          geo_ints(geo), geo.norm)
    width = part.shape[1]
    mine = part.cpu() if shard.comm_cpu else part
    gathered = funcol.all_gather_tensor(mine, 0, shard.group).to(part.device)
    stats = merge_stats_op(gathered.view(shard.world, -1, width), plan.flags.OWN_TEMP, stats_tail(ids, plan),
                           topk_keys(plan))
    jsd = None
    if plan.flags.DISTILL_KIND == 2:
        jsd = shard_jsd_op(logits, targets, teacher, stats, block.temperature, plan.key, geo_ints(geo), geo.norm)
        jsd = funcol.all_reduce(jsd.cpu() if shard.comm_cpu else jsd, "sum", shard.group).to(part.device)
    return stats, jsd


def topk_keys(plan: KernelPlan) -> int:
    """The student's top-k keys a row's vocab-parallel statistics end with (its k rounded up to a power of
    two; 2 fp32 columns each), 0 without it."""
    return block_if(plan.flags.STUDENT_TOPK)


def stats_tail(teacher_ids: torch.Tensor | None, plan: KernelPlan) -> int:
    """The columns after a row's vocab-parallel statistics (layouts.Stats): a top-k teacher's K logits and the
    selected ids' (each K rounded up to a power of two), which merge by their max, then the student's top-k
    keys (:func:`topk_keys`)."""
    topk = 0 if teacher_ids is None else block_of(teacher_ids.shape[-1])
    return topk + block_if(plan.flags.SELECTED) + 2 * topk_keys(plan)


def stats_width(has_teacher: bool, teacher_ids: torch.Tensor | None, plan: KernelPlan) -> int:
    """Columns of a row's vocab-parallel statistics (layouts.Stats), then their max-merged tail."""
    return (STATS.N_TEACHER if has_teacher else STATS.N) + stats_tail(teacher_ids, plan)


@kernel_op("headloss::shard_stats",
           fake=lambda logits, targets, teacher, ids, logprobs, temperature, selected, key, geo, norm:
           torch.empty(geo_of(geo, norm).n_rows, stats_width(teacher is not None, ids, plan_from_key(key)),
                       dtype=torch.float32, device=logits.device))
def shard_stats_op(logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor | None,
                   ids: torch.Tensor | None, logprobs: torch.Tensor | None, temperature: torch.Tensor | None,
                   selected: torch.Tensor | None, key: str, geo: list[int], norm: float) -> torch.Tensor:
    """kernels.shard.launch_shard_stats as an op (a vocab-parallel call under torch.compile)."""
    sparse = None if ids is None else SparseRows(ids, logprobs, ids.shape[-1])
    return launch_shard_stats(plan_from_key(key), logits=logits, targets=targets, geo=geo_of(geo, norm),
                              teacher=teacher, sparse=sparse, temperature=temperature, selected=selected)


@kernel_op("headloss::merge_stats", fake=lambda parts, own_temp, tail, keys: parts.new_empty(parts.shape[1:]))
def merge_stats_op(parts: torch.Tensor, own_temp: bool, tail: int, keys: int) -> torch.Tensor:
    """kernels.shard.launch_merge as an op."""
    return launch_merge(parts, own_temp, tail, keys)


@kernel_op("headloss::shard_jsd", fake=lambda logits, targets, teacher, stats, temperature, key, geo, norm:
           torch.empty(geo_of(geo, norm).n_rows, JSD_SHARES.N, dtype=torch.float32, device=logits.device))
def shard_jsd_op(logits: torch.Tensor, targets: torch.Tensor | None, teacher: torch.Tensor, stats: torch.Tensor,
                 temperature: torch.Tensor | None, key: str, geo: list[int], norm: float) -> torch.Tensor:
    """kernels.shard.launch_shard_jsd as an op."""
    return launch_shard_jsd(plan_from_key(key), logits=logits, targets=targets, teacher=teacher, stats=stats,
                            geo=geo_of(geo, norm), temperature=temperature)
