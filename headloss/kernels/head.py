"""The head kernels and their launchers (every launch by keyword, options as named tuples).

``prepare_kernel``        one program: counts the rows that are scored, checks the targets' range
                          and num_items_in_batch, zeroes the completion counter. O(rows). Calls
                          on one device leave this to one of head_kernel's programs (``prep``):
                          the first to take the call's ticket.
``head_kernel``           one program per logits row: phase 1 (stats), phase 2 (per-token values,
                          gradient coefficients, term by term), phase 3 (gradient, when ``grad`` is
                          given); the last program to finish reduces the packed per-row buffer to
                          the metrics and the loss. Traffic per row: V reads, plus V reads + V
                          writes with the gradient.
``head_backward_kernel``  deferred mode: phase 2 from the saved per-row values and the upstream
                          gradients, then phase 3. Traffic: V reads + V writes.
``finish_kernel``         the same reduction as a launch of its own (after a chunked lm_head).
``scale_grad_kernel``     multiplies a precomputed gradient by d loss in backward; a no-op (no
                          traffic) when d loss == 1, decided on the device, no host sync.
``add_scaled_kernel``     adds d loss times a precomputed weight gradient into the caller's buffer
                          (Megatron's main_grad), one pass.

Rows are addressed as ``b * stride_b + t * stride_t`` (row = b * T + t), so [B, T, V] views with
any row strides run without a copy. Offsets are int64 (N * V may exceed 2**31); rows live on grid
axis 0 (up to 2**31 - 1). The vocab-parallel statistics are kernels/shard.py's, the policy term's
sequence kernels kernels/policy.py's.
"""

from __future__ import annotations

import functools
import itertools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import bounded
from ..layouts import JSD_AT, SCRATCH_AT, SEQUENCE_AT, STATS_AT, TEACHER_KEYS, TEACHER_MARK, VERDICT_AT, scratch_size
from ..plan import KernelPlan
from ..validation import MASS_TOLERANCE as MASS_TOLERANCE_VALUE
from .blocks import (
    gradient_pass,
    online_stats,
    reduce_rows,
    row_slot,
    row_start,
    row_temperature,
    target_logit,
    token_scale,
    zero_row,
)
from .launch import FIT_SPILLS, SPECIALISED_BY, Geometry, launch, launch_config, spec_key
from .primitives import LN2, LOG2E
from .shard import merged_rest, merged_stats, merged_teacher
from .sparse import (
    SparseRows,
    block_if,
    gathered_row,
    rest_sum,
    selected_grads,
    selected_inputs,
    selected_share,
    selected_values,
    token_values,
    topk_block,
    topk_inputs,
    topk_math,
    topk_scatter,
    topk_values,
    zero_selected,
)
from .terms import distill_values, kl_estimator, policy_values, put, row_coefficients, row_values
from .topk import bound_blocks, collect_words, row_buffers, topk_merged, topk_overlap, topk_store, topk_zero


class PolicyRows(NamedTuple):
    """Per-slot inputs of the token-level policy objective, any float dtype, read only at counted
    slots (old, ref and iw may be None)."""

    old: torch.Tensor | None
    ref: torch.Tensor | None
    adv: torch.Tensor  # per slot, or per sequence: slot s reads adv[s // adv_span]
    iw: torch.Tensor | None
    weight: torch.Tensor  # aggregation weight per slot
    adv_span: int = 1  # slots per advantage: 1, or K for one advantage per sequence of [B, K]
    seq_len: int = 0  # K when sequences are the rows of [B, K] (the last program then reduces the
    # per-sequence clip metrics); 0 for rows with sequence_ids (those metrics are left to torch)


class ShardRows(NamedTuple):
    """The head kernels' vocab-parallel inputs."""

    stats: torch.Tensor | None  # (n_rows, layouts.Stats) fp32 row statistics merged over the shards, or with
    # world > 0 the student's statistics of every shard as gathered, (world, n_rows, STATS.N): merged per row
    jsd: torch.Tensor | None  # (n_rows, layouts.JsdShares) fp32 mixture-JSD shares summed over the shards
    world: int = 0


def shard_rows(stats: torch.Tensor | None, jsd: torch.Tensor | None = None) -> ShardRows:
    """ShardRows of a call's statistics: merged (2-D), or gathered (3-D: the shards first)."""
    if stats is None:
        return _UNSHARDED
    return ShardRows(stats, jsd, stats.shape[0] if stats.dim() == 3 else 0)


class TeacherRows(NamedTuple):
    """The head kernels' teacher: a dense teacher's logits (like the student's), a sparse teacher's
    per-slot rows (kernels.sparse.SparseRows: F.SPARSE), each or None."""

    logits: torch.Tensor | None
    sparse: SparseRows | None


class SlotInputs(NamedTuple):
    """What the head kernels read per slot besides the logits: the target ids ((n_out (+ shift),) int, or
    None), the per-row temperatures ((n_out,) fp32 by slot, spec.LogitTransform.per_row_temperature, or
    None), where a block's slots are not the call's (the lm_head's chunks) each slot's row of the call
    ((n_out,) int64, for the positions a verdict names; None: the slot is the row), and the token weights
    ((n_out,) fp32 by slot, spec.TokenWeights, or None), and the selected ids ((n_out, K) int64 by slot,
    outputs: selected_logprobs, or None)."""

    targets: torch.Tensor | None
    temperature: torch.Tensor | None
    rows: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    selected: torch.Tensor | None = None


class Blocks(NamedTuple):
    """The head kernels' block sizes (constexpr): the vocabulary's, the top-k teacher's K rounded up
    to a power of two (1 without one), the selected ids' (F.SELECTED) likewise, and the student's top-k's."""

    V: int
    K: int
    S: int = 1
    T: int = 0  # the student's top-k (F.STUDENT_TOPK) rounded up to a power of two; 0 without it
    N: int = 0  # the blocks of a row its top-k bound keeps (kernels.topk.bound_blocks); 0 without it


class RowPicks(NamedTuple):
    """What head_kernel picks out of a row besides its values: the argmax ((n_out,) int64, -1 where not
    scored, or None) and the buffer the student's top-k is chosen in ((rows, topk.collect_words(BLOCKS.T,
    BLOCKS.V, BLOCKS.N)) int64 scratch, kernels.topk.topk_reread; or None)."""

    pred: torch.Tensor | None
    topk: torch.Tensor | None = None


class Prepare(NamedTuple):
    """One of head_kernel's programs does prepare_kernel's work (see launch_head(prepared=False))."""

    verdict: torch.Tensor | None  # prepare_kernel's verdict slot and dirty word, or None: no validation
    dirty: torch.Tensor | None
    nonce: int | None  # this call's tag (next_nonce); None: prepare_kernel ran
    sequence_ids: torch.Tensor | None = None  # prepare_kernel's: checked in range
    n_seq: int = 0  # sequences whose policy counters the preparing program zeroes (scratch_size)


SPECIALISED_BY[Prepare] = lambda arg: (Prepare, spec_key((arg.verdict, arg.dirty)), arg.nonce is None,
                                       spec_key((arg.sequence_ids,)), arg.n_seq)
"""Its nonce changes every call (next_nonce fixes how Triton specialises it): by everything else."""

_PREPARED = Prepare(None, None, None)
NO_BAD_ENTRY = tl.constexpr(TEACHER_MARK)
MASS_TOLERANCE = tl.constexpr(MASS_TOLERANCE_VALUE)
"""How far from 1 a row of a teacher given as probabilities may sum (validation.MASS_TOLERANCE)."""
_UNSHARDED = ShardRows(None, None, 0)
_NONCES = itertools.count(int.from_bytes(os.urandom(3), "little"))
SCALE_PROGRAMS = 2048
"""scale_grad_kernel's programs loop over the rows: fewer early exits when d loss == 1."""


def next_nonce() -> int:
    """A tag unique to one in-kernel prepare (``launch_head(prepared=False)``): a multiple of 2**32
    (so no count of finished programs reaches the next tag) above 2**32 (one int64 specialisation),
    from a random start (another process's stale buffer holds another tag)."""
    return (next(_NONCES) % (1 << 30) + 1) << 32


class Tiles(NamedTuple):
    """Tiles of the last program's reduction (constexpr): [BLOCK_R, COLS_P2] over the packed rows' reduced
    columns (all but the selected ids' log-probs),
    SEQ_BLOCK sequences at a time for the per-sequence policy metrics."""

    COLS_P2: int
    BLOCK_R: int
    SEQ_BLOCK: int
    PREP_BLOCK: int  # targets per step of the head kernel's in-kernel prepare (one program): small, as the
    # registers of a wide step are reserved for the whole kernel (docs/performance.md, "Launch settings")


@bounded.memoize("head.tiles", 256, "the last program's reduction tiles by packed row width")
def _tiles(cols: int) -> Tiles:
    """Small tiles: this code runs once per call, but the registers it takes are reserved for the
    whole kernel (docs/performance.md, "Launch settings")."""
    cols_p2 = 1 << (max(cols, 1) - 1).bit_length()
    return Tiles(COLS_P2=cols_p2, BLOCK_R=max(16, 2048 // cols_p2), SEQ_BLOCK=256, PREP_BLOCK=512)


@triton.jit
def prepare_kernel(
    targets,  # (n_out + shift,) int, or None
    num_items,  # (1,) any dtype, or None
    sequence_ids,  # (n_out,) int, or None
    temperature,  # (n_out,) fp32 per-row temperature, or None: checked positive and finite
    weights,  # (n_out,) fp32 token weights, or None: summed over the counted rows, checked >= 0 and finite
    scratch,  # (scratch_size(n_seq),) int64 out (layouts.Scratch)
    verdict,  # (VERDICT.N,) int64 slot in pinned host memory, or None: no validation
    dirty,  # (1,) int64 in pinned host memory, set to 1 when any verdict is written
    geo,
    n_seq,  # sequences with per-sequence policy counters in scratch (layouts.SequenceCounters), or 0
    BLOCK: tl.constexpr,
):
    prepare_call(targets, num_items, sequence_ids, temperature, weights, scratch, verdict, dirty, geo, n_seq, BLOCK)
    tl.store(scratch + SCRATCH_AT.done, 0)
    tl.store(scratch + SCRATCH_AT.ticket, 0)  # (unused here: written, so a call's scratch is the same each time)


@triton.jit
def prepare_call(targets, num_items, sequence_ids, temperature, weights, scratch, verdict, dirty, geo, n_seq,
                 BLOCK: tl.constexpr):
    """prepare_kernel's work but the completion counter and the ticket (scratch's ``done``, ``ticket``): by one
    program. With token weights, their sum over the counted rows (scratch's ``weight_sum``, fp32 bits: a
    weighted mean's divisor) and the first slot whose weight is not a finite number >= 0 (the verdict's)."""
    offs = tl.arange(0, BLOCK)
    counted = tl.zeros([BLOCK], tl.int32)
    bad_ids = tl.zeros([BLOCK], tl.int32)
    big = 2**62
    first_bad = tl.full([BLOCK], big, tl.int64)
    first_hot = tl.full([BLOCK], big, tl.int64)  # the first slot of a temperature that is not positive, finite
    first_heavy = tl.full([BLOCK], big, tl.int64)  # the first slot of a token weight that is not finite, >= 0
    weight_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, geo.n_out, BLOCK):
        slot = start + offs  # the index type of n_out: int32 below 2**31 slots
        inside = slot < geo.n_out
        if targets is None:
            valid = inside
        else:
            scored = inside
            if geo.shift != 0:
                scored = inside & (slot % geo.K + geo.shift < geo.K)
            y = tl.load(targets + slot + geo.shift, mask=scored, other=geo.ignore_index).to(tl.int64)
            valid = scored & (y != geo.ignore_index)
            if verdict is not None:  # (against the whole vocabulary: a vocab-parallel call's V_total)
                bad = valid & ((y < 0) | (y >= tl.maximum(geo.V, geo.V_total)))
                first_bad = tl.minimum(first_bad, tl.where(bad, slot + geo.shift, big))
        counted += valid.to(tl.int32)
        if weights is not None:
            w = tl.load(weights + slot, mask=valid, other=0.0)
            weight_sum += w
            if verdict is not None:  # (every slot's, counted or not)
                w = tl.load(weights + slot, mask=inside, other=0.0)
                first_heavy = tl.minimum(first_heavy, tl.where(inside & ~((w >= 0.0) & (w < float("inf"))), slot,
                                                               big))
        if verdict is not None and temperature is not None:
            t = tl.load(temperature + slot, mask=inside, other=1.0)
            first_hot = tl.minimum(first_hot, tl.where(inside & ~((t > 0.0) & (t < float("inf"))), slot, big))
        if verdict is not None and sequence_ids is not None:
            ids = tl.load(sequence_ids + slot, mask=inside, other=0)
            bad_ids |= (inside & ((ids < 0) | (ids >= geo.n_out))).to(tl.int32)
    tl.store(scratch + SCRATCH_AT.counted, tl.sum(counted.to(tl.int64), axis=0))
    if weights is not None:
        tl.store(scratch + SCRATCH_AT.weight_sum, tl.sum(weight_sum, axis=0).to(tl.int32, bitcast=True).to(tl.int64))
    else:  # (written: a call's scratch is the same each time)
        tl.store(scratch + SCRATCH_AT.weight_sum, 0)
    if n_seq > 0:
        tl.store(scratch + SCRATCH_AT.ratio_min, 0x7FFFFFFF)  # above every finite fp32 bit pattern
        tl.store(scratch + SCRATCH_AT.ratio_max, -1)  # below every one
        for start in range(0, n_seq * SEQUENCE_AT.N, BLOCK):
            i = start + offs
            tl.store(scratch + SCRATCH_AT.sequences + i, tl.zeros([BLOCK], tl.int64), mask=i < n_seq * SEQUENCE_AT.N)
    if verdict is not None:
        where = tl.min(first_bad, axis=0)
        bad_items = tl.zeros([], tl.int64)
        items_bits = tl.zeros([], tl.int64)
        if num_items is not None:
            n = tl.load(num_items).to(tl.float32)
            bad_items = ((n > 0.0) & (n < float("inf"))).to(tl.int64) ^ 1
            items_bits = n.to(tl.int32, bitcast=True).to(tl.int64)
        any_ids = tl.max(bad_ids, axis=0).to(tl.int64)
        bad_call = (where < big) | (bad_items != 0) | (any_ids != 0)
        hot = big
        if temperature is not None:
            hot = tl.min(first_hot, axis=0)
            bad_call = bad_call | (hot < big)
        heavy = big
        if weights is not None:
            heavy = tl.min(first_heavy, axis=0)
            bad_call = bad_call | (heavy < big)
        if bad_call:
            value = tl.zeros([], tl.int64)
            if targets is not None:
                value = tl.load(targets + where, mask=where < big, other=0).to(tl.int64)
            tl.store(verdict + VERDICT_AT.where, tl.where(where < big, where, -1))
            tl.store(verdict + VERDICT_AT.value, value)
            tl.store(verdict + VERDICT_AT.bad_items, bad_items)
            tl.store(verdict + VERDICT_AT.bad_ids, any_ids)
            tl.store(verdict + VERDICT_AT.items, items_bits)
            if temperature is not None:
                tl.store(verdict + VERDICT_AT.temperature, tl.where(hot < big, hot + 1, 0))
            if weights is not None:
                tl.store(verdict + VERDICT_AT.weights, tl.where(heavy < big, heavy + 1, 0))
            tl.atomic_xchg(verdict + VERDICT_AT.flag, 1, sem="release", scope="sys")
            tl.atomic_xchg(dirty, 1, sem="release", scope="sys")


@triton.jit
def head_kernel(
    # pointers
    logits,  # (rows, V) addressed through geo.stride_b / stride_t, any float dtype
    slots,  # SlotInputs: the targets and the per-row temperatures, by slot
    teacher,  # TeacherRows: the dense teacher's logits (like logits, geo.t_stride_*) and a sparse teacher, each or None
    grad,  # like logits (geo.g_stride_*), may alias logits; None: no gradient pass
    rows,  # (n_out, C.N) fp32 packed per-row values
    picks,  # RowPicks: the argmax out and the student's top-k's buffer, each or None
    policy,  # PolicyRows of (n_out,) fp32, or None
    num_items,  # (1,) num_items_in_batch on the device, or None
    scratch,  # int64 layouts.Scratch: counted rows (prepare), programs done, policy counters
    loss,  # () fp32 reduced loss, or (n_out,) for reduction 'none'
    means,  # (C.N + 1,) fp32 column means and the loss, written with FINISH
    shard,  # ShardRows: vocab-parallel merged row statistics and summed mixture-JSD shares (None: not sharded)
    prep,  # Prepare: with a nonce, one program does prepare_kernel's work first (see launch_head)
    # sizes, strides, runtime scalars
    geo,
    S,
    # meta
    F: tl.constexpr,
    C: tl.constexpr,
    BLOCKS: tl.constexpr,  # Blocks: the vocabulary block and the top-k teacher's
    R: tl.constexpr,  # Tiles of the last program's reduction
    FINISH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    targets = slots.targets
    temperature = slots.temperature
    BLOCK_V: tl.constexpr = BLOCKS.V
    BLOCK_K: tl.constexpr = BLOCKS.K
    t_logits = teacher.logits
    sparse = teacher.sparse
    # In-kernel prepare: the first program to swap the call's nonce into scratch's ticket prepares, and the
    # others wait for it (await_prepared) only where they read what it writes. It is a program that runs
    # (it took the ticket), so none waits on a program that may not have started: nothing relies on the
    # order programs start in (MPS, green contexts, another stream's kernels holding the SMs). The last
    # program clears the ticket, so a CUDA graph's next replay (the same nonce) elects afresh.
    PREPARE: tl.constexpr = prep.nonce is not None  # (a tuple holding None cannot be compared with None)
    # a counted row waits once, before its first read of scratch; other rows before the completion count
    WAIT_IN_ROW: tl.constexpr = PREPARE and (F.HAS_POLICY or grad is not None)
    if PREPARE:
        if tl.atomic_xchg(scratch + SCRATCH_AT.ticket, prep.nonce, sem="acq_rel") != prep.nonce:
            prepare_call(targets, num_items, prep.sequence_ids, temperature, slots.weights, scratch, prep.verdict,
                         prep.dirty, geo, prep.n_seq, R.PREP_BLOCK)
            # the counted rows (and the verdicts) are published
            tl.atomic_xchg(scratch + SCRATCH_AT.done, prep.nonce, sem="release")
    stats = shard.stats
    jsd = shard.jsd
    SHARDED: tl.constexpr = stats is not None
    # merged statistics per row: layouts.Stats, a top-k teacher's K logits, the selected ids', the student's top-k keys
    NCOL: tl.constexpr = (STATS_AT.N_TEACHER if t_logits is not None else STATS_AT.N) + \
        (BLOCK_K if F.SPARSE == 1 else 0) + (BLOCKS.S if F.SELECTED > 0 else 0) + 2 * BLOCKS.T
    V_math = geo.V_total if SHARDED else geo.V  # the vocabulary of the math (label smoothing's eps / V)
    row_ptr = row_start(logits, row, geo.T, geo.stride_b, geo.stride_t)
    t_row = row_start(t_logits, row, geo.T, geo.t_stride_b, geo.t_stride_t)
    grad_row = row_start(grad, row, geo.T, geo.g_stride_b, geo.g_stride_t)
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    S = row_temperature(S, temperature, slot, has_slot)
    row_out = rows + slot * C.N
    # an entropy without gradient is summed in the gradient pass when there is one
    # (sharded: from the merged sums, a gradient pass over one shard sums only its share)
    ENTROPY_IN_PASS_1: tl.constexpr = F.HAS_ENTROPY and (F.ENTROPY_GRAD or grad is None or SHARDED)
    ENTROPY_IN_PASS_3: tl.constexpr = F.HAS_ENTROPY and not ENTROPY_IN_PASS_1
    y_here = y  # the target's column in this row's logits (global id minus the shard's start)
    if SHARDED:
        y_here = y - geo.vocab_start
    if counted:
        token_weight = 1.0
        if slots.weights is not None:
            token_weight = tl.load(slots.weights + slot)
        # --- 1. stats pass (sharded: this shard's pass ran in shard_stats_kernel; merged stats)
        if SHARDED:
            m2, d, sum_x2, sum_ex2, arg, x2_y, slope_y = merged_stats(stats, row, row_ptr, y_here, geo.V, S, F,
                                                                     NCOL, shard.world, geo.n_rows)
            tstats = 0
            if t_logits is not None:
                tstats = merged_teacher(stats, row, NCOL)
            top = 0
            if F.STUDENT_TOPK > 0:  # every shard's top-k merged: the statistics' last columns
                top = topk_merged(stats + row * NCOL + NCOL - 2 * BLOCKS.T, BLOCKS.T)
        else:
            m2, d, sum_x2, sum_ex2, arg, tstats, off, top = online_stats(
                row_ptr, t_row, geo.V, S, F, BLOCK_V, ENTROPY_IN_PASS_1, BLOCKS.T, 0, BLOCKS.N,
                None if picks.topk is None else picks.topk + row * collect_words(BLOCKS.T, BLOCK_V, BLOCKS.N))
            x2_y = tl.zeros([], tl.float32)
            slope_y = tl.zeros([], tl.float32)
            if targets is not None:
                # out-of-range targets (validation off) give NaN, never an out-of-bounds read
                x2_y, slope_y = target_logit(row_ptr, y, geo.V, S, F.HAS_SOFTCAP)
        # --- 2. per-token values, term by term (natural units from here on)
        zero = tl.zeros([], tl.float32)
        lse2 = m2 + tl.log2(d)
        lse = lse2 * LN2
        logp = (x2_y - lse2) * LN2
        entropy = tl.zeros([], tl.float32)
        if ENTROPY_IN_PASS_1:
            entropy = lse - sum_ex2 * LN2 / d
            put(row_out, C.entropy, entropy)
        token_loss = row_values(row_out, lse, logp, sum_x2, entropy, V_math, S, F, C)
        dstate = (zero, zero, zero, zero)
        if t_logits is not None:
            jsd_row = jsd
            if jsd is not None:
                jsd_row = jsd + row * JSD_AT.N
            weighted, dstate = distill_values(row_out, row_ptr, t_row, m2, d, arg, tstats, geo.V, S, F, C, BLOCK_V,
                                              jsd_row)
            token_loss += weighted
            if F.TEACHER_PROBS and prep.verdict is not None:  # the row's probabilities sum to 1
                where = slot if slots.rows is None else tl.load(slots.rows + slot)
                check_teacher_mass(dstate[1], where, prep.verdict, prep.dirty)
        if F.SPARSE == 1:
            sp_ids, sp_local, sp_given, sp_mine, sp_x2, sp_slope, sp_lq = topk_inputs(
                sparse, slot, row_ptr, gathered_row(stats, row, NCOL, F.SPARSE), geo.vocab_start, geo.V, V_math, S,
                F, BLOCK_K)
            p_rest = zero
            if F.TOPK_FORM == 2:  # the student's probability off the ids
                if SHARDED:
                    p_rest = merged_rest(stats, row, NCOL) / d
                else:
                    p_rest = rest_sum(sp_x2, sp_given, m2, off) / d
            weighted, sp_a, sp_h = topk_values(row_out, sp_x2, sp_lq, sp_ids, sp_given, lse2, p_rest, arg, S, F, C,
                                               BLOCK_K)
            token_loss += weighted
            if C.overlap >= 0:  # verl's overlap with the student's top-k, stored first
                topk_store(row_out, top, lse2, C, F, BLOCKS.T)
                tl.debug_barrier()
                topk_overlap(row_out, sp_ids, sp_given, sp_x2, sp_lq, lse2, S, F, C)
        if F.SPARSE == 2:
            weighted, d_token = token_values(row_out, sparse, slot, logp, S, F, C)
            token_loss += weighted
        if F.STUDENT_TOPK > 0 and C.overlap < 0:  # the student's top-k (with a top-k teacher: stored above)
            topk_store(row_out, top, lse2, C, F, BLOCKS.T)
        if F.SELECTED > 0:  # the selected ids' log-probs (a vocab-parallel row's logits: the last columns)
            sel_gathered = None
            if SHARDED:
                sel_gathered = stats + row * NCOL + NCOL - 2 * BLOCKS.T - BLOCKS.S
            s_ids, s_local, s_given, s_valid, s_mine, s_x2, s_slope = selected_inputs(
                slots.selected, slot, row_ptr, sel_gathered, geo.vocab_start, geo.V, V_math, S, F, BLOCKS.S)
            selected_values(row_out, s_x2, s_given, lse2, C, F, BLOCKS.S)
        d_logp = zero
        d_entropy = zero
        if WAIT_IN_ROW:  # the policy counters and extremes in scratch, the token count: the preparer's
            await_prepared(scratch, prep.nonce, geo.n_rows)
        if F.HAS_POLICY:
            d_logp, d_entropy = policy_values(row_out, scratch, logp, entropy, policy, slot, token_weight, S, F,
                                              C)
        if F.HAS_ARGMAX:
            put(row_out, C.accuracy, (arg == y).to(tl.float32))
            if picks.pred is not None:
                tl.store(picks.pred + slot, arg.to(tl.int64))
        if slots.weights is not None:  # the token's weight: on its loss here, on its gradient through u
            token_loss *= token_weight
        put(row_out, C.token_loss, token_loss)
        put(row_out, C.lse, lse)
        put(row_out, C.logp, logp)
        if F.REDUCTION == 2:
            tl.store(loss + slot, token_loss)
        # --- 3. gradient pass
        if grad is not None:
            u = token_scale(scratch, num_items, geo, F)
            if slots.weights is not None:
                u *= token_weight
            if F.SPARSE == 2:
                d_logp += u * S.w_distill * d_token
            A, B, Cc, D = row_coefficients(u, d_logp, d_entropy, zero, lse, logp, entropy, V_math, S, F)
            A_ids = A  # the other terms' share at the teacher's ids (topk_scatter adds the teacher's whole)
            if F.SPARSE == 1:
                A += u * S.w_distill * sp_a
            sum_px2 = gradient_pass(
                row_ptr, t_row, grad_row, geo.V, y_here, x2_y, slope_y, lse, A, B, Cc, D, dstate,
                u * S.w_distill * S.inv_distill_temp, S, F, BLOCK_V, ENTROPY_IN_PASS_3,
            )
            if F.SPARSE == 1:  # the teacher's ids, rewritten whole after every lane has stored
                tl.debug_barrier()
                topk_scatter(grad_row, sp_local, sp_mine, sp_x2, sp_slope, lse, A_ids, B, Cc, D, y_here,
                             u * S.w_distill * sp_h, S, F)
            if ENTROPY_IN_PASS_3:
                put(row_out, C.entropy, sum_px2 * LN2)
    else:
        if has_slot:
            COLS_P2: tl.constexpr = R.COLS_P2
            col = tl.arange(0, COLS_P2)
            tl.store(row_out + col, tl.zeros([COLS_P2], tl.float32), mask=col < C.N_REDUCED)
            if F.SELECTED > 0:  # (the last columns, beyond the reduction's tile)
                zero_selected(row_out, C, F, BLOCKS.S)
            if F.STUDENT_TOPK > 0:
                topk_zero(row_out, C, F, BLOCKS.T)
            if picks.pred is not None:
                tl.store(picks.pred + slot, -1)
            if F.REDUCTION == 2:
                tl.store(loss + slot, 0.0)
        if grad is not None:
            zero_row(grad_row, geo.V, BLOCK_V)
    if FINISH:
        # the last program to get here reduces every row: one launch for the whole call
        tl.debug_barrier()
        if PREPARE:
            if WAIT_IN_ROW:
                if not counted:
                    await_prepared(scratch, prep.nonce, geo.n_rows)
            else:
                await_prepared(scratch, prep.nonce, geo.n_rows)
        done = tl.atomic_add(scratch + SCRATCH_AT.done, 1, sem="acq_rel")
        if PREPARE:
            done -= prep.nonce
        if done == geo.n_rows - 1:
            reduce_rows(rows, loss, means, scratch, num_items, policy, geo, F, C, R)
            if PREPARE:  # what a prepared call leaves: no trace of the nonce
                tl.store(scratch + SCRATCH_AT.done, geo.n_rows)
                tl.store(scratch + SCRATCH_AT.ticket, 0)


@triton.jit
def check_teacher_mass(lse_t2, row, verdict, dirty):
    """A teacher given as probabilities: the sum 2^lse_t2 of the call's ``row`` within MASS_TOLERANCE of 1
    (NaN where one is negative or NaN), else its key (layouts.TeacherKeys: mass) reaches the verdict as
    the sparse teacher's check writes its keys, the least key by a maximum of TEACHER_MARK - key."""
    mass = tl.exp2(lse_t2)
    if not ((mass >= 1.0 - MASS_TOLERANCE) & (mass <= 1.0 + MASS_TOLERANCE)):
        key = TEACHER_KEYS.N * row + TEACHER_KEYS.mass
        tl.atomic_max(verdict + VERDICT_AT.teacher, NO_BAD_ENTRY - key, sem="relaxed", scope="sys")
        tl.atomic_xchg(verdict + VERDICT_AT.flag, 1, sem="release", scope="sys")
        tl.atomic_xchg(dirty, 1, sem="release", scope="sys")


@triton.jit
def await_prepared(scratch, nonce, n_rows):
    """Wait until the preparing program has published this call's counted rows: scratch's ``done`` then counts finished
    programs up from ``nonce``. A value outside [nonce, nonce + n_rows) is another call's (a stale
    buffer; a finished call, the last replay of a CUDA graph included, leaves n_rows < 2**32)."""
    seen = tl.atomic_add(scratch + SCRATCH_AT.done, 0, sem="acquire")
    while (seen < nonce) | (seen >= nonce + n_rows):
        seen = tl.atomic_add(scratch + SCRATCH_AT.done, 0, sem="acquire")


@triton.jit
def head_backward_kernel(
    # pointers
    logits,  # (rows, V) addressed through geo.stride_*
    slots,  # SlotInputs, as head_kernel's
    teacher,  # TeacherRows, as head_kernel's
    grad,  # like logits (geo.g_stride_*), may alias logits
    rows,  # (n_out, C.N) fp32 saved by the forward
    d_loss,  # (1,) fp32 upstream gradient of the reduced loss, (n_out,) for reduction 'none', or None
    d_rows,  # (n_out, C.N) fp32 upstream gradients of the per-row outputs, or None
    num_items,  # (1,) or None
    scratch,  # int64 layouts.Scratch from the forward
    shard,  # ShardRows: vocab-parallel, the forward's merged (or gathered) statistics (stats None: not sharded)
    work,  # (n_rows, 2 BLOCKS.S) int32: a row's list of its selected ids' gradients (selected_grads), or None
    # sizes, strides, runtime scalars
    geo,
    S,
    # meta
    F: tl.constexpr,
    C: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    targets = slots.targets
    temperature = slots.temperature
    stats = shard.stats
    SHARDED: tl.constexpr = stats is not None
    BLOCK_V: tl.constexpr = BLOCKS.V
    t_logits = teacher.logits  # (the sparse teacher: teacher.sparse, BLOCKS.K wide)
    V_math = geo.V_total if SHARDED else geo.V
    row_ptr = row_start(logits, row, geo.T, geo.stride_b, geo.stride_t)
    t_row = row_start(t_logits, row, geo.T, geo.t_stride_b, geo.t_stride_t)
    grad_row = row_start(grad, row, geo.T, geo.g_stride_b, geo.g_stride_t)
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    S = row_temperature(S, temperature, slot, has_slot)
    if counted:
        zero = tl.zeros([], tl.float32)
        row_in = rows + slot * C.N
        lse = tl.load(row_in + C.lse)
        entropy = zero
        if F.ENTROPY_GRAD:
            entropy = tl.load(row_in + C.entropy)
        u = zero
        if d_loss is not None:
            if F.REDUCTION == 2:
                u = tl.load(d_loss + slot)
            else:
                u = tl.load(d_loss) * token_scale(scratch, num_items, geo, F)
        d_logp = zero
        d_entropy = zero
        d_lse = zero
        if d_rows is not None:
            d_in = d_rows + slot * C.N
            u += tl.load(d_in + C.token_loss)
            d_lse = tl.load(d_in + C.lse)
            if C.logp >= 0:
                d_logp = tl.load(d_in + C.logp)
            if F.ENTROPY_GRAD:
                d_entropy = tl.load(d_in + C.entropy)
        if slots.weights is not None:  # the token loss is its terms' times its weight
            u *= tl.load(slots.weights + slot)
        x2_y = zero
        slope_y = zero
        y_here = y
        NCOL: tl.constexpr = (STATS_AT.N_TEACHER if t_logits is not None else STATS_AT.N) + \
            (BLOCKS.K if F.SPARSE == 1 else 0) + (BLOCKS.S if F.SELECTED > 0 else 0) + 2 * BLOCKS.T
        if targets is not None:
            if SHARDED:
                y_here = y - geo.vocab_start
                m2_unused, d_unused, sx_unused, sex_unused, arg_unused, x2_y, slope_y = merged_stats(
                    stats, row, row_ptr, y_here, geo.V, S, F, NCOL, shard.world, geo.n_rows)
            else:
                x2_y, slope_y = target_logit(row_ptr, y, geo.V, S, F.HAS_SOFTCAP)
        logp = x2_y * LN2 - lse
        if F.SPARSE == 2:
            lq = tl.load(teacher.sparse.logprobs + slot).to(tl.float32)
            kl_unused, d_token = kl_estimator(logp, lq, F.TOKEN_EST, F.TOKEN_CLAMP, F.TOKEN_K2_GRAD)
            d_logp += u * S.w_distill * d_token
        A, B, Cc, D = row_coefficients(u, d_logp, d_entropy, d_lse, lse, logp, entropy, V_math, S, F)
        SELECTED_GRAD: tl.constexpr = work is not None
        sel = None
        D_pass = D
        if SELECTED_GRAD:  # d log p(id_k): -G p everywhere (A), each id's h at its column in the pass
            s_work = work + row * 2 * BLOCKS.S
            s_total, s_hy, s_n = selected_grads(d_rows + slot * C.N, slots.selected + slot * F.SELECTED, y_here,
                                                geo.vocab_start, V_math, s_work, C, F, BLOCKS.S)
            A -= s_total
            D_pass += s_hy  # (the target's column is rewritten whole after the pass)
            sel = (s_work, s_n)
            tl.debug_barrier()  # (the list is read by every thread)
        A_ids = A
        if F.SPARSE == 1:
            sp_ids, sp_local, sp_given, sp_mine, sp_x2, sp_slope, sp_lq = topk_inputs(
                teacher.sparse, slot, row_ptr, gathered_row(stats, row, NCOL, F.SPARSE), geo.vocab_start, geo.V,
                V_math, S, F, BLOCKS.K)
            p_rest = zero
            if F.TOPK_FORM == 2:
                p_rest = tl.load(row_in + C.rest_mass)
            div_unused, ms_unused, mt_unused, ag_unused, sp_a, sp_h = topk_math(
                sp_x2, sp_lq, sp_ids, sp_given, lse * LOG2E, p_rest, 0, S, F, BLOCKS.K)
            A += u * S.w_distill * sp_a
        dstate = (zero, zero, zero, zero)
        if t_logits is not None:
            dstate = (tl.load(row_in + C.lse_s2), tl.load(row_in + C.lse_t2), tl.load(row_in + C.divergence),
                      tl.load(row_in + C.jsd_s))
        gradient_pass(
            row_ptr, t_row, grad_row, geo.V, y_here, x2_y, slope_y, lse, A, B, Cc, D_pass, dstate,
            u * S.w_distill * S.inv_distill_temp, S, F, BLOCK_V, False, sel,
        )
        if F.SPARSE == 1:
            sp_h = u * S.w_distill * sp_h
            if SELECTED_GRAD:  # (the teacher's ids are rewritten whole: their selected h with them)
                sp_h += selected_share(sel, sp_local, BLOCKS.S)
            tl.debug_barrier()
            topk_scatter(grad_row, sp_local, sp_mine, sp_x2, sp_slope, lse, A_ids, B, Cc, D, y_here, sp_h, S, F)
    else:
        zero_row(grad_row, geo.V, BLOCK_V)


@triton.jit
def finish_kernel(rows, loss, means, scratch, num_items, policy, geo, F: tl.constexpr, C: tl.constexpr,
                  R: tl.constexpr):
    reduce_rows(rows, loss, means, scratch, num_items, policy, geo, F, C, R)

@triton.jit
def scale_grad_kernel(
    grad,  # (rows, V) addressed through geo.g_stride_*
    scale,  # () or (1,) fp32: the upstream d loss
    geo,
    BLOCK_V: tl.constexpr,
):
    factor = tl.load(scale).to(tl.float32)
    if factor != 1.0:
        offs = tl.arange(0, BLOCK_V)
        for row in range(tl.program_id(0).to(tl.int64), geo.n_rows, tl.num_programs(0)):
            row_ptr = row_start(grad, row, geo.T, geo.g_stride_b, geo.g_stride_t)
            for start in range(0, geo.V, BLOCK_V):
                cols = start + offs
                mask = cols < geo.V
                g = tl.load(row_ptr + cols, mask=mask).to(tl.float32)
                tl.store(row_ptr + cols, (g * factor).to(grad.dtype.element_ty), mask=mask)


@triton.jit
def add_scaled_kernel(
    into,  # (n,) contiguous: fp32, bf16 or fp16 (a weight's main_grad)
    grad,  # (n,) contiguous: the gradient computed in forward (the weight's dtype, or fp32)
    scale,  # (1,) fp32: the upstream d loss
    n,
    BLOCK: tl.constexpr,
):
    """into[i] += scale * grad[i] (fp32 math, stored in into's dtype): one program per BLOCK elements, reads
    grad and into once and writes into once (an fp32 main_grad and a bf16 dW: 10 bytes an element)."""
    factor = tl.load(scale).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad + offs, mask=mask).to(tl.float32)
    acc = tl.load(into + offs, mask=mask).to(tl.float32)
    tl.store(into + offs, (acc + g * factor).to(into.dtype.element_ty), mask=mask)


# --- launchers -------------------------------------------------------------------------------

def prepare(targets: torch.Tensor | None, num_items: torch.Tensor | None, sequence_ids: torch.Tensor | None,
            geo: Geometry, device: torch.device, verdict: tuple | None, n_seq: int = 0,
            temperature: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Launch prepare_kernel; returns the call's scratch (counted rows first). ``verdict`` is a
    (slot, dirty) pair of host tensors the device writes when a value is bad, or None (no checks)."""
    scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=device)
    slot, dirty = verdict if verdict is not None else (None, None)
    launch(prepare_kernel, 1, 8, targets=targets, num_items=num_items, sequence_ids=sequence_ids,
           temperature=temperature, weights=weights, scratch=scratch, verdict=slot, dirty=dirty, geo=geo, n_seq=n_seq,
           BLOCK=4096)
    return scratch


def launch_head(plan: KernelPlan, *, logits, targets, teacher, grad, rows, pred, policy, num_items, scratch, loss,
                means, geo: Geometry, finish: bool = True, stats: torch.Tensor | None = None,
                jsd: torch.Tensor | None = None, verdict: tuple | None = None, prepared: bool = True,
                sequence_ids: torch.Tensor | None = None, n_seq: int = 0, sparse: SparseRows | None = None,
                temperature: torch.Tensor | None = None, row_ids: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, selected: torch.Tensor | None = None) -> None:
    """One program per logits row; with ``finish`` the last one writes ``means`` and the reduced loss.
    ``prepared=False``: ``scratch`` (scratch_size(n_seq) words, any content) was not filled by
    :func:`prepare`; the first program to take the call's ticket does that work first (``verdict``,
    ``sequence_ids`` and ``n_seq`` as prepare takes them), and the other programs wait for it only where
    they read what it writes -- one launch fewer per call (with ``finish``: its last program clears the
    ticket)."""
    if geo.n_rows == 0:
        return
    if not prepared and not finish:
        raise ValueError("launch_head: an in-kernel prepare (prepared=False) needs finish=True")
    cfg = launch_config(geo.V, plan.has_teacher, geo.n_rows)
    prep = _PREPARED
    if not prepared:
        prep = Prepare(*(verdict if verdict is not None else (None, None)), next_nonce(), sequence_ids, n_seq)
    elif verdict is not None and plan.flags.TEACHER_PROBS:  # the rows' mass check writes the call's verdict
        prep = Prepare(*verdict, None)
    blocks = _blocks(cfg.block_v, sparse, plan, geo.V if stats is None else 0)
    picks = RowPicks(pred, row_buffers(geo.n_rows, blocks.T, blocks.V, blocks.N, logits.device))
    args = dict(
        logits=logits, slots=SlotInputs(targets, temperature, row_ids, weights, selected),
        teacher=TeacherRows(teacher, sparse),
        grad=grad, rows=rows, picks=picks, policy=policy, num_items=num_items, scratch=scratch, loss=loss,
        means=means, shard=shard_rows(stats, jsd), prep=prep, geo=geo,
        S=plan.scalars, F=plan.flags, C=plan.cols, BLOCKS=blocks, FINISH=finish,
        R=_tiles(plan.cols.N_REDUCED),
    )
    topk = plan.flags.STUDENT_TOPK > 0
    launch(head_kernel, geo.n_rows, cfg.num_warps, registers_of=functools.partial(_sibling, args, topk),
           fit_spills=FIT_SPILLS * topk, **args)



def _blocks(block_v: int, sparse: SparseRows | None, plan: KernelPlan, vocab: int = 0) -> Blocks:
    """A launch's Blocks: the vocabulary's, a top-k teacher's, the selected ids' and the student's top-k's (its
    bound's blocks over rows of ``vocab``; 0: a launch that finds no top-k)."""
    flags = plan.flags
    k = flags.STUDENT_TOPK
    return Blocks(block_v, max(topk_block(sparse), 1), max(block_if(flags.SELECTED), 1), block_if(k),
                  bound_blocks(vocab, block_v) if k and vocab else 0)


def _sibling(args: dict, topk: bool = False) -> dict | None:
    """A launch with a per-row temperature (or, ``topk``, the student's top-k): the same launch without them,
    whose registers per thread the variant keeps to (launch's ``registers_of``); None without either."""
    slots, flags = args["slots"], args["F"]
    if slots.temperature is None and not topk:
        return None
    sibling = dict(args, slots=slots._replace(temperature=None))
    if topk:
        sibling.update(F=flags._replace(STUDENT_TOPK=0), C=args["C"]._replace(overlap=-1, overlap_advantage=-1),
                       BLOCKS=args["BLOCKS"]._replace(T=0, N=0), picks=args["picks"]._replace(topk=None))
    return sibling


def launch_finish(plan: KernelPlan, *, rows, loss, means, scratch, num_items, geo: Geometry) -> None:
    """The reduction of launch_head's last program, as a launch of its own (chunked callers; their
    per-sequence policy metrics are left to torch)."""
    policy = PolicyRows(None, None, None, None, None, 1, 0) if plan.flags.HAS_POLICY else None
    launch(finish_kernel, 1, 4, rows=rows, loss=loss, means=means, scratch=scratch, num_items=num_items,
           policy=policy, geo=geo, F=plan.flags, C=plan.cols, R=_tiles(plan.cols.N_REDUCED))


def launch_backward(plan: KernelPlan, *, logits, targets, teacher, grad, rows, d_loss, d_rows, num_items, scratch,
                    geo: Geometry, stats: torch.Tensor | None = None, sparse: SparseRows | None = None,
                    temperature: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                    selected: torch.Tensor | None = None) -> None:
    """Deferred mode: d loss / d logits into ``grad`` from the saved rows and the upstream gradients."""
    if geo.n_rows == 0:
        return
    cfg = launch_config(geo.V, plan.has_teacher, geo.n_rows)
    blocks = _blocks(cfg.block_v, sparse, plan)
    work = None
    if plan.flags.SELECTED and d_rows is not None:  # the selected ids' gradients: each row's list
        work = torch.empty(geo.n_rows, 2 * blocks.S, dtype=torch.int32, device=grad.device)
    args = dict(
        logits=logits, slots=SlotInputs(targets, temperature, None, weights, selected),
        teacher=TeacherRows(teacher, sparse), grad=grad,
        rows=rows, d_loss=d_loss, d_rows=d_rows, num_items=num_items, scratch=scratch, shard=shard_rows(stats),
        work=work, geo=geo, S=plan.scalars, F=plan.flags, C=plan.cols, BLOCKS=blocks,
    )
    launch(head_backward_kernel, geo.n_rows, cfg.num_warps, registers_of=functools.partial(_sibling, args), **args)



ADD_SCALED_BLOCK = 4096


def add_scaled_(into: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor) -> None:
    """into += scale * grad in place, in one pass (both contiguous, of one shape; ``scale`` (1,) fp32 on the
    device): a gradient computed in forward added into the caller's buffer (headloss.main_grad) with the
    upstream d loss applied on the way, no host sync."""
    n = into.numel()
    if n:
        launch(add_scaled_kernel, triton.cdiv(n, ADD_SCALED_BLOCK), 8, into=into, grad=grad, scale=scale, n=n,
               BLOCK=ADD_SCALED_BLOCK)


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """grad *= scale in place (grad addressed through geo's gradient strides), skipped on the
    device when scale == 1 (no host sync)."""
    if geo.n_rows > 0:
        cfg = launch_config(geo.V)
        launch(scale_grad_kernel, min(geo.n_rows, SCALE_PROGRAMS), cfg.num_warps, grad=grad, scale=scale, geo=geo,
               BLOCK_V=cfg.block_v)
    return grad
