"""The head kernels and their launchers (every launch by keyword, options as named tuples).

``prepare_kernel``        one program: counts the rows that are scored, checks the targets' range
                          and num_items_in_batch, zeroes the completion counter. O(rows). Calls
                          on one device leave this to head_kernel's program 0 (``prep``).
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

Rows are addressed as ``b * stride_b + t * stride_t`` (row = b * T + t), so [B, T, V] views with
any row strides run without a copy. Offsets are int64 (N * V may exceed 2**31); rows live on grid
axis 0 (up to 2**31 - 1).
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl

from ..plan import KernelPlan, Scalars
from .blocks import (
    gradient_pass,
    online_stats,
    reduce_rows,
    row_slot,
    target_logit,
    token_scale,
    zero_row,
)
from .primitives import LN2
from .terms import (
    _kl_penalty,
    _objective,
    distill_lse,
    distill_values,
    jsd_sums,
    policy_values,
    put,
    row_coefficients,
    row_values,
)

SCRATCH = 2
"""int64 scratch per call: [0] counted rows, [1] programs done (the last one reduces); with a
token-level policy term over [B, K] sequences, :data:`SEQ_SCRATCH` more (see scratch_size)."""

SEQ_SCRATCH = 2
"""[2], [3]: the smallest and largest ratio over counted tokens, as fp32 bit patterns (a ratio is
>= 0, so its bits order like the float); then 3 counters per sequence from [4]: counted tokens,
tokens clipped low, tokens clipped high. Row programs add to them with integer atomics (exact, in
any order: deterministic), so the last program reads B x 3 values instead of the B x K rows."""


def scratch_size(n_seq: int) -> int:
    """Scratch entries of a call with ``n_seq`` sequences of per-sequence policy metrics (0: none)."""
    return SCRATCH + (SEQ_SCRATCH + 3 * n_seq if n_seq else 0)

VERDICT = 5
"""A verdict slot (int64, host memory the device writes through UVA, only when something is bad):
[0] set to 1 last, [1] first bad target index (-1: none), [2] its value, [3] 1 when num_items_in_batch
is not a positive finite number, [4] 1 when a sequence id is outside [0, n_out)."""


class Geometry(NamedTuple):
    """Sizes and strides of one launch (runtime ints; Triton specializes 1 and multiples of 16)."""

    n_rows: int  # logits rows = programs (B * T)
    n_out: int  # slots: per-token outputs and inputs (B * K)
    V: int
    T: int  # logits rows per sequence
    K: int  # slots per sequence (K <= T; rows t >= K are not scored)
    shift: int  # the target of row t is targets[b, t + shift]
    stride_b: int
    stride_t: int
    g_stride_b: int  # gradient buffer strides
    g_stride_t: int
    t_stride_b: int  # teacher strides
    t_stride_t: int
    ignore_index: int
    norm: float  # num_items_in_batch given as a number (0: none)
    vocab_start: int = 0  # vocab-parallel: the global id of this shard's column 0
    V_total: int = 0  # vocab-parallel: the whole vocabulary (0: not sharded, V is all of it)


GEO_INTS = tuple(name for name in Geometry._fields if name != "norm")
"""Geometry's int fields, in order (the torch.library ops pass them as a list, norm apart)."""


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
    """head_kernel's vocab-parallel inputs."""

    stats: torch.Tensor | None  # (n_rows, STATS [+ TEACHER_STATS]) fp32 row statistics merged over the shards
    jsd: torch.Tensor | None  # (n_rows, 2) fp32 mixture-JSD shares (JSD, KL(p_s || M)) summed over the shards


class Prepare(NamedTuple):
    """head_kernel's program 0 does prepare_kernel's work (see launch_head(prepared=False))."""

    verdict: torch.Tensor | None  # prepare_kernel's verdict slot and dirty word, or None: no validation
    dirty: torch.Tensor | None
    nonce: int | None  # this call's tag (next_nonce); None: prepare_kernel ran
    sequence_ids: torch.Tensor | None = None  # prepare_kernel's: checked in range
    n_seq: int = 0  # sequences whose policy counters program 0 zeroes (scratch_size)


@triton.jit
def prepare_kernel(
    targets,  # (n_out + shift,) int, or None
    num_items,  # (1,) any dtype, or None
    sequence_ids,  # (n_out,) int, or None
    scratch,  # (SCRATCH,) int64 out
    verdict,  # (VERDICT,) int64 slot in pinned host memory, or None: no validation
    dirty,  # (1,) int64 in pinned host memory, set to 1 when any verdict is written
    geo,
    n_seq,  # sequences with per-sequence policy counters in scratch (SEQ_SCRATCH), or 0
    BLOCK: tl.constexpr,
):
    prepare_call(targets, num_items, sequence_ids, scratch, verdict, dirty, geo, n_seq, BLOCK)
    tl.store(scratch + 1, 0)


@triton.jit
def prepare_call(targets, num_items, sequence_ids, scratch, verdict, dirty, geo, n_seq, BLOCK: tl.constexpr):
    """prepare_kernel's work but the completion counter (scratch[1]): by one program."""
    offs = tl.arange(0, BLOCK)
    counted = tl.zeros([BLOCK], tl.int32)
    bad_ids = tl.zeros([BLOCK], tl.int32)
    big = 2**62
    first_bad = tl.full([BLOCK], big, tl.int64)
    for start in range(0, geo.n_out, BLOCK):
        slot = start + offs  # the index type of n_out: int32 below 2**31 slots
        inside = slot < geo.n_out
        if targets is None:
            counted += inside.to(tl.int32)
        else:
            scored = inside
            if geo.shift != 0:
                scored = inside & (slot % geo.K + geo.shift < geo.K)
            y = tl.load(targets + slot + geo.shift, mask=scored, other=geo.ignore_index).to(tl.int64)
            valid = scored & (y != geo.ignore_index)
            counted += valid.to(tl.int32)
            if verdict is not None:
                bad = valid & ((y < 0) | (y >= geo.V))
                first_bad = tl.minimum(first_bad, tl.where(bad, slot + geo.shift, big))
        if verdict is not None and sequence_ids is not None:
            ids = tl.load(sequence_ids + slot, mask=inside, other=0)
            bad_ids |= (inside & ((ids < 0) | (ids >= geo.n_out))).to(tl.int32)
    tl.store(scratch, tl.sum(counted.to(tl.int64), axis=0))
    if n_seq > 0:
        tl.store(scratch + 2, 0x7FFFFFFF)  # ratio min: above every finite fp32 bit pattern
        tl.store(scratch + 3, -1)  # ratio max: below every one
        for start in range(0, 3 * n_seq, BLOCK):
            i = start + offs
            tl.store(scratch + 4 + i, tl.zeros([BLOCK], tl.int64), mask=i < 3 * n_seq)
    if verdict is not None:
        where = tl.min(first_bad, axis=0)
        bad_items = tl.zeros([], tl.int64)
        if num_items is not None:
            n = tl.load(num_items).to(tl.float32)
            bad_items = ((n > 0.0) & (n < float("inf"))).to(tl.int64) ^ 1
        any_ids = tl.max(bad_ids, axis=0).to(tl.int64)
        if (where < big) | (bad_items != 0) | (any_ids != 0):
            value = tl.zeros([], tl.int64)
            if targets is not None:
                value = tl.load(targets + where, mask=where < big, other=0).to(tl.int64)
            tl.store(verdict + 1, tl.where(where < big, where, -1))
            tl.store(verdict + 2, value)
            tl.store(verdict + 3, bad_items)
            tl.store(verdict + 4, any_ids)
            tl.atomic_xchg(verdict, 1, sem="release", scope="sys")
            tl.atomic_xchg(dirty, 1, sem="release", scope="sys")


@triton.jit
def head_kernel(
    # pointers
    logits,  # (rows, V) addressed through geo.stride_b / stride_t, any float dtype
    targets,  # (n_out,) int, or None
    teacher,  # like logits (geo.t_stride_*), or None
    grad,  # like logits (geo.g_stride_*), may alias logits; None: no gradient pass
    rows,  # (n_out, C.N) fp32 packed per-row values
    pred,  # (n_out,) int64 argmax (-1 where not scored), or None
    policy,  # PolicyRows of (n_out,) fp32, or None
    num_items,  # (1,) num_items_in_batch on the device, or None
    scratch,  # (SCRATCH,) int64: counted rows (prepare_kernel), programs done
    loss,  # () fp32 reduced loss, or (n_out,) for reduction 'none'
    means,  # (C.N + 1,) fp32 column means and the loss, written with FINISH
    shard,  # ShardRows: vocab-parallel merged row statistics and summed mixture-JSD shares (None: not sharded)
    prep,  # Prepare: with a nonce, program 0 does prepare_kernel's work first (see launch_head)
    # sizes, strides, runtime scalars
    geo,
    S,
    # meta
    F: tl.constexpr,
    C: tl.constexpr,
    BLOCK_V: tl.constexpr,
    R: tl.constexpr,  # Tiles of the last program's reduction
    FINISH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # Program 0 prepares and the others wait for it (await_prepared): this relies on program 0 running,
    # which CUDA does not promise but does (blocks start in index order; the interpreter runs them in order)
    PREPARE: tl.constexpr = prep.nonce is not None  # (a tuple holding None cannot be compared with None)
    # a counted row waits once, before its first read of scratch; other rows before the completion count
    WAIT_IN_ROW: tl.constexpr = PREPARE and (F.HAS_POLICY or grad is not None)
    if PREPARE:
        if row == 0:
            prepare_call(targets, num_items, prep.sequence_ids, scratch, prep.verdict, prep.dirty, geo, prep.n_seq,
                         R.PREP_BLOCK)
            tl.atomic_xchg(scratch + 1, prep.nonce, sem="release")  # counted rows (and verdicts) published
    stats = shard.stats
    jsd = shard.jsd
    SHARDED: tl.constexpr = stats is not None
    NCOL: tl.constexpr = 16 if teacher is not None else 8  # merged statistics per row (sharded)
    V_math = geo.V  # the vocabulary of the math (label smoothing's eps / V): the whole one when sharded
    if SHARDED:
        V_math = geo.V_total
    b = row // geo.T
    t = row % geo.T
    row_ptr = logits + b * geo.stride_b + t * geo.stride_t
    grad_row = grad
    if grad is not None:
        grad_row = grad + b * geo.g_stride_b + t * geo.g_stride_t
    t_row = teacher
    if teacher is not None:
        t_row = teacher + b * geo.t_stride_b + t * geo.t_stride_t
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    row_out = rows + slot * C.N
    # an entropy without gradient is summed in the gradient pass when there is one
    # (sharded: from the merged sums, a gradient pass over one shard sums only its share)
    ENTROPY_IN_PASS_1: tl.constexpr = F.HAS_ENTROPY and (F.ENTROPY_GRAD or grad is None or SHARDED)
    ENTROPY_IN_PASS_3: tl.constexpr = F.HAS_ENTROPY and not ENTROPY_IN_PASS_1
    y_here = y  # the target's column in this row's logits (global id minus the shard's start)
    if SHARDED:
        y_here = y - geo.vocab_start
    if counted:
        # --- 1. stats pass (sharded: this shard's pass ran in shard_stats_kernel; merged stats)
        if SHARDED:
            m2, d, sum_x2, sum_ex2, arg, x2_y, slope_y = merged_stats(stats, row, row_ptr, y_here, geo.V, S, F,
                                                                     NCOL)
            tstats = 0
            if teacher is not None:
                tstats = merged_teacher(stats, row)
        else:
            m2, d, sum_x2, sum_ex2, arg, tstats = online_stats(row_ptr, t_row, geo.V, S, F, BLOCK_V,
                                                               ENTROPY_IN_PASS_1)
            x2_y = tl.zeros([], tl.float32)
            slope_y = tl.zeros([], tl.float32)
            if targets is not None:
                # out-of-range targets (validation off) give NaN, never an out-of-bounds read
                x2_y, slope_y = target_logit(row_ptr, y, geo.V, S, F.HAS_SOFTCAP)
        # --- 2. per-token values, term by term (natural units from here on)
        lse2 = m2 + tl.log2(d)
        lse = lse2 * LN2
        logp = (x2_y - lse2) * LN2
        entropy = tl.zeros([], tl.float32)
        if ENTROPY_IN_PASS_1:
            entropy = lse - sum_ex2 * LN2 / d
            put(row_out, C.entropy, entropy)
        token_loss = row_values(row_out, lse, logp, sum_x2, entropy, V_math, S, F, C)
        zero = tl.zeros([], tl.float32)
        dstate = (zero, zero, zero, zero)
        if teacher is not None:
            jsd_row = jsd
            if jsd is not None:
                jsd_row = jsd + row * 2
            weighted, dstate = distill_values(row_out, row_ptr, t_row, m2, d, arg, tstats, geo.V, S, F, C, BLOCK_V,
                                              jsd_row)
            token_loss += weighted
        d_logp = zero
        d_entropy = zero
        if WAIT_IN_ROW:  # the policy counters and extremes in scratch, the token count: program 0's
            await_prepared(scratch, prep.nonce, geo.n_rows)
        if F.HAS_POLICY:
            d_logp, d_entropy = policy_values(row_out, scratch, logp, entropy, policy, slot, S, F, C)
        if F.HAS_ARGMAX:
            put(row_out, C.accuracy, (arg == y).to(tl.float32))
            if pred is not None:
                tl.store(pred + slot, arg.to(tl.int64))
        put(row_out, C.token_loss, token_loss)
        put(row_out, C.lse, lse)
        put(row_out, C.logp, logp)
        if F.REDUCTION == 2:
            tl.store(loss + slot, token_loss)
        # --- 3. gradient pass
        if grad is not None:
            u = token_scale(scratch, num_items, geo, F)
            A, B, Cc, D = row_coefficients(u, d_logp, d_entropy, zero, lse, logp, entropy, V_math, S, F)
            sum_px2 = gradient_pass(
                row_ptr, t_row, grad_row, geo.V, y_here, x2_y, slope_y, lse, A, B, Cc, D, dstate,
                u * S.w_distill * S.inv_distill_temp, S, F, BLOCK_V, ENTROPY_IN_PASS_3,
            )
            if ENTROPY_IN_PASS_3:
                put(row_out, C.entropy, sum_px2 * LN2)
    else:
        if has_slot:
            COLS_P2: tl.constexpr = R.COLS_P2
            col = tl.arange(0, COLS_P2)
            tl.store(row_out + col, tl.zeros([COLS_P2], tl.float32), mask=col < C.N)
            if pred is not None:
                tl.store(pred + slot, -1)
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
        done = tl.atomic_add(scratch + 1, 1, sem="acq_rel")
        if PREPARE:
            done -= prep.nonce
        if done == geo.n_rows - 1:
            reduce_rows(rows, loss, means, scratch, num_items, policy, geo, F, C, R)
            if PREPARE:
                tl.store(scratch + 1, geo.n_rows)  # what a prepared call leaves: no trace of the nonce


@triton.jit
def await_prepared(scratch, nonce, n_rows):
    """Wait until program 0 has published this call's counted rows: scratch[1] then counts finished
    programs up from ``nonce``. A value outside [nonce, nonce + n_rows) is another call's (a stale
    buffer; a finished call, the last replay of a CUDA graph included, leaves n_rows < 2**32)."""
    seen = tl.atomic_add(scratch + 1, 0, sem="acquire")
    while (seen < nonce) | (seen >= nonce + n_rows):
        seen = tl.atomic_add(scratch + 1, 0, sem="acquire")


STATS = 8
"""Vocab-parallel row statistics (fp32): [0] max x2 (base-2 units), [1] sum 2^(x2 - max),
[2] sum x2 (label smoothing), [3] sum 2^(x2 - max) x2 (entropy), [4] the argmax's global id,
[5] the target's x2 where the shard holds it (else 0), [6] 1 where the shard holds it, [7] unused.
Global ids travel as fp32: exact for vocabularies below 2**24."""

TEACHER_STATS = 8
"""With a teacher, 8 more (terms.teacher_block's tstats): [8] the teacher's max, [9] its sum of
exponentials, [10] its sum e_t t2, [11] the forward-KL cross sum (against the teacher's max),
[12] / [13] the student's max and sum at the distillation temperature, [14] the reverse-KL cross
sum (against the student's max at T_d, or its own max without a temperature), [15] the teacher's
argmax as a global id."""


@triton.jit
def shard_stats_kernel(
    logits,  # (rows, V_shard) addressed through geo.stride_*
    targets,  # (n_out,) global ids, or None
    teacher,  # the teacher's logits on the same columns (geo.t_stride_*), or None
    part,  # (n_rows, NCOL) fp32 out: this shard's statistics (STATS, + TEACHER_STATS with a teacher)
    geo,
    S,
    F: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Phase 1 of a vocab-parallel head on one shard: the statistics every rank exchanges."""
    NCOL: tl.constexpr = 16 if teacher is not None else 8
    row = tl.program_id(0).to(tl.int64)
    b = row // geo.T
    t = row % geo.T
    row_ptr = logits + b * geo.stride_b + t * geo.stride_t
    t_row = teacher
    if teacher is not None:
        t_row = teacher + b * geo.t_stride_b + t * geo.t_stride_t
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    out = part + row * NCOL
    if counted:
        m2, d, sum_x2, sum_ex2, arg, tstats = online_stats(row_ptr, t_row, geo.V, S, F, BLOCK_V, F.HAS_ENTROPY)
        x2_y = tl.zeros([], tl.float32)
        owned = tl.zeros([], tl.float32)
        if targets is not None:
            y_here = y - geo.vocab_start
            if (y_here >= 0) & (y_here < geo.V):
                x2_y, slope_unused = target_logit(row_ptr, y_here, geo.V, S, F.HAS_SOFTCAP)
                owned = tl.full([], 1.0, tl.float32)
        tl.store(out, m2)
        tl.store(out + 1, d)
        tl.store(out + 2, sum_x2)
        tl.store(out + 3, sum_ex2)
        tl.store(out + 4, (arg + geo.vocab_start).to(tl.float32))
        tl.store(out + 5, x2_y)
        tl.store(out + 6, owned)
        if teacher is not None:
            mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = tstats
            tl.store(out + 8, mt)
            tl.store(out + 9, dt)
            tl.store(out + 10, sum_t)
            tl.store(out + 11, sum_ts)
            tl.store(out + 12, ms)
            tl.store(out + 13, ds)
            tl.store(out + 14, sum_st)
            tl.store(out + 15, (t_arg + geo.vocab_start).to(tl.float32))
    else:
        tl.store(out, float("-inf"))
        tl.store(out + 1, 0.0)
        tl.store(out + 2, 0.0)
        tl.store(out + 3, 0.0)
        tl.store(out + 4, 0.0)
        tl.store(out + 5, 0.0)
        tl.store(out + 6, 0.0)
        if teacher is not None:
            tl.store(out + 8, float("-inf"))
            tl.store(out + 9, 0.0)
            tl.store(out + 10, 0.0)
            tl.store(out + 11, 0.0)
            tl.store(out + 12, float("-inf"))
            tl.store(out + 13, 0.0)
            tl.store(out + 14, 0.0)
            tl.store(out + 15, 0.0)


@triton.jit
def shard_jsd_kernel(
    logits,  # (rows, V_shard)
    targets,  # (n_out,) global ids, or None
    teacher,  # the teacher's logits on the same columns
    stats,  # (n_rows, STATS + TEACHER_STATS) merged statistics
    jsd,  # (n_rows, 2) fp32 out: this shard's share of (JSD, KL(p_s || M))
    geo,
    S,
    F: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The mixture JSD's extra pass on one shard, with the whole vocabulary's normalisers: its terms
    are sums over the vocabulary, so the shards' shares add up (the second collective)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // geo.T
    t = row % geo.T
    row_ptr = logits + b * geo.stride_b + t * geo.stride_t
    t_row = teacher + b * geo.t_stride_b + t * geo.t_stride_t
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    value = tl.zeros([], tl.float32)
    kl_s = tl.zeros([], tl.float32)
    if counted:
        at = stats + row * 16
        lse_s2, lse_t2, t_minus_s = distill_lse(tl.load(at), tl.load(at + 1), merged_teacher(stats, row), F)
        value, kl_s = jsd_sums(row_ptr, t_row, geo.V, lse_s2, lse_t2, t_minus_s, S, BLOCK_V, F)
    tl.store(jsd + row * 2, value)
    tl.store(jsd + row * 2 + 1, kl_s)


@triton.jit
def merge_stats_kernel(parts, merged, n_rows, world, BLOCK: tl.constexpr, NCOL: tl.constexpr,
                       OWN_TEMP: tl.constexpr):
    """(world, n_rows, STATS) per-shard statistics -> (n_rows, STATS) of the whole vocabulary: the max
    of the maxima, the sums rescaled to it, the argmax of the lowest rank holding the max (its first
    index: shards are in vocabulary order), the owner's target logit and the owner count."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < n_rows
    at = rows.to(tl.int64) * NCOL
    stride = tl.full([], NCOL, tl.int64) * n_rows
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for r in range(world):
        top = tl.maximum(top, tl.load(parts + r * stride + at, mask=inside, other=float("-inf")))
    d = tl.zeros([BLOCK], tl.float32)
    sum_x2 = tl.zeros([BLOCK], tl.float32)
    sum_ex2 = tl.zeros([BLOCK], tl.float32)
    arg = tl.zeros([BLOCK], tl.float32)
    found = tl.zeros([BLOCK], tl.int1)
    x2_y = tl.zeros([BLOCK], tl.float32)
    owners = tl.zeros([BLOCK], tl.float32)
    for r in range(world):
        base = parts + r * stride + at
        m = tl.load(base, mask=inside, other=float("-inf"))
        scale = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
        d += tl.load(base + 1, mask=inside, other=0.0) * scale
        sum_x2 += tl.load(base + 2, mask=inside, other=0.0)
        sum_ex2 += tl.load(base + 3, mask=inside, other=0.0) * scale
        first = (m == top) & (found == 0)
        arg = tl.where(first, tl.load(base + 4, mask=inside, other=0.0), arg)
        found = found | (m == top)
        owned = tl.load(base + 6, mask=inside, other=0.0)
        x2_y += tl.where(owned > 0.5, tl.load(base + 5, mask=inside, other=0.0), 0.0)
        owners += owned
    # a NaN max (NaN logits) propagates as tl.maximum would not: keep it
    nan_top = tl.zeros([BLOCK], tl.int1)
    for r in range(world):
        m = tl.load(parts + r * stride + at, mask=inside, other=0.0)
        nan_top = nan_top | (m != m)
    top = tl.where(nan_top, float("nan"), top)
    out = merged + at
    tl.store(out, top, mask=inside)
    tl.store(out + 1, d, mask=inside)
    tl.store(out + 2, sum_x2, mask=inside)
    tl.store(out + 3, sum_ex2, mask=inside)
    tl.store(out + 4, arg, mask=inside)
    tl.store(out + 5, x2_y, mask=inside)
    tl.store(out + 6, owners, mask=inside)
    tl.store(out + 7, tl.zeros([BLOCK], tl.float32), mask=inside)
    if NCOL == 16:  # the teacher's sums against its max; the student's at T_d against theirs
        top_t = tl.full([BLOCK], float("-inf"), tl.float32)
        top_s = tl.full([BLOCK], float("-inf"), tl.float32)
        for r in range(world):
            base = parts + r * stride + at
            top_t = tl.maximum(top_t, tl.load(base + 8, mask=inside, other=float("-inf")))
            top_s = tl.maximum(top_s, tl.load(base + 12, mask=inside, other=float("-inf")))
        dt = tl.zeros([BLOCK], tl.float32)
        sum_t = tl.zeros([BLOCK], tl.float32)
        sum_ts = tl.zeros([BLOCK], tl.float32)
        ds = tl.zeros([BLOCK], tl.float32)
        sum_st = tl.zeros([BLOCK], tl.float32)
        t_arg = tl.zeros([BLOCK], tl.float32)
        t_found = tl.zeros([BLOCK], tl.int1)
        for r in range(world):
            base = parts + r * stride + at
            mt = tl.load(base + 8, mask=inside, other=float("-inf"))
            scale_t = tl.where(mt == float("-inf"), 0.0, tl.exp2(mt - top_t))
            dt += tl.load(base + 9, mask=inside, other=0.0) * scale_t
            sum_t += tl.load(base + 10, mask=inside, other=0.0) * scale_t
            sum_ts += tl.load(base + 11, mask=inside, other=0.0) * scale_t
            if OWN_TEMP:
                ms = tl.load(base + 12, mask=inside, other=float("-inf"))
                scale_s = tl.where(ms == float("-inf"), 0.0, tl.exp2(ms - top_s))
                ds += tl.load(base + 13, mask=inside, other=0.0) * scale_s
            else:  # the reverse-KL sum runs against the student's own max (column 0)
                m = tl.load(base, mask=inside, other=float("-inf"))
                scale_s = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
            sum_st += tl.load(base + 14, mask=inside, other=0.0) * scale_s
            first_t = (mt == top_t) & (t_found == 0)
            t_arg = tl.where(first_t, tl.load(base + 15, mask=inside, other=0.0), t_arg)
            t_found = t_found | (mt == top_t)
        tl.store(out + 8, top_t, mask=inside)
        tl.store(out + 9, dt, mask=inside)
        tl.store(out + 10, sum_t, mask=inside)
        tl.store(out + 11, sum_ts, mask=inside)
        tl.store(out + 12, top_s, mask=inside)
        tl.store(out + 13, ds, mask=inside)
        tl.store(out + 14, sum_st, mask=inside)
        tl.store(out + 15, t_arg, mask=inside)


@triton.jit
def merged_teacher(stats, row):
    """The teacher's statistics of a row from the merged (n_rows, 16) statistics (tstats layout)."""
    at = stats + row * 16
    return (tl.load(at + 8), tl.load(at + 9), tl.load(at + 10), tl.load(at + 11), tl.load(at + 12),
            tl.load(at + 13), tl.load(at + 14), tl.load(at + 15).to(tl.int32))


@triton.jit
def merged_stats(stats, row, row_ptr, y_here, V, S, F: tl.constexpr, NCOL: tl.constexpr):
    """(m2, d, sum_x2, sum_ex2, arg, x2_y, slope_y) of a row from the merged statistics. x2_y is NaN
    when no shard holds the target (out of range); slope_y (dx/dz at the target) is read here, and
    used by the gradient pass only where this shard holds the target."""
    at = stats + row * NCOL
    m2 = tl.load(at)
    d = tl.load(at + 1)
    sum_x2 = tl.load(at + 2)
    sum_ex2 = tl.load(at + 3)
    arg = tl.load(at + 4).to(tl.int32)
    x2_y = tl.where(tl.load(at + 6) > 0.5, tl.load(at + 5), float("nan"))
    x2_unused, slope_y = target_logit(row_ptr, y_here, V, S, F.HAS_SOFTCAP)  # (masked: no read off this shard)
    return m2, d, sum_x2, sum_ex2, arg, x2_y, slope_y


@triton.jit
def head_backward_kernel(
    # pointers
    logits,  # (rows, V) addressed through geo.stride_*
    targets,  # (n_out,) int, or None
    teacher,  # like logits, or None
    grad,  # like logits (geo.g_stride_*), may alias logits
    rows,  # (n_out, C.N) fp32 saved by the forward
    d_loss,  # (1,) fp32 upstream gradient of the reduced loss, (n_out,) for reduction 'none', or None
    d_rows,  # (n_out, C.N) fp32 upstream gradients of the per-row outputs, or None
    num_items,  # (1,) or None
    scratch,  # (SCRATCH,) int64 from the forward
    stats,  # vocab-parallel: the forward's merged (n_rows, STATS) statistics, or None
    # sizes, strides, runtime scalars
    geo,
    S,
    # meta
    F: tl.constexpr,
    C: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    SHARDED: tl.constexpr = stats is not None
    V_math = geo.V
    if SHARDED:
        V_math = geo.V_total
    b = row // geo.T
    t = row % geo.T
    row_ptr = logits + b * geo.stride_b + t * geo.stride_t
    grad_row = grad + b * geo.g_stride_b + t * geo.g_stride_t
    t_row = teacher
    if teacher is not None:
        t_row = teacher + b * geo.t_stride_b + t * geo.t_stride_t
    slot, has_slot, y, counted = row_slot(targets, row, geo)
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
        x2_y = zero
        slope_y = zero
        y_here = y
        if targets is not None:
            if SHARDED:
                y_here = y - geo.vocab_start
                m2_unused, d_unused, sx_unused, sex_unused, arg_unused, x2_y, slope_y = merged_stats(
                    stats, row, row_ptr, y_here, geo.V, S, F, 16 if teacher is not None else 8)
            else:
                x2_y, slope_y = target_logit(row_ptr, y, geo.V, S, F.HAS_SOFTCAP)
        logp = x2_y * LN2 - lse
        A, B, Cc, D = row_coefficients(u, d_logp, d_entropy, d_lse, lse, logp, entropy, V_math, S, F)
        dstate = (zero, zero, zero, zero)
        if teacher is not None:
            dstate = (tl.load(row_in + C.lse_s2), tl.load(row_in + C.lse_t2), tl.load(row_in + C.divergence),
                      tl.load(row_in + C.jsd_s))
        gradient_pass(
            row_ptr, t_row, grad_row, geo.V, y_here, x2_y, slope_y, lse, A, B, Cc, D, dstate,
            u * S.w_distill * S.inv_distill_temp, S, F, BLOCK_V, False,
        )
    else:
        zero_row(grad_row, geo.V, BLOCK_V)


@triton.jit
def finish_kernel(rows, loss, means, scratch, num_items, policy, geo, F: tl.constexpr, C: tl.constexpr,
                  R: tl.constexpr):
    reduce_rows(rows, loss, means, scratch, num_items, policy, geo, F, C, R)


@triton.jit
def _extremes_step(r_min, r_max, nan, ratio, keep):
    """Running extremes of the kept ratios; a kept NaN is flagged in ``nan`` (it wins, as torch's amin)."""
    nan |= (keep & (ratio != ratio)).to(tl.int32)
    ok = keep & (ratio == ratio)
    return tl.where(ok, tl.minimum(r_min, ratio), r_min), tl.where(ok, tl.maximum(r_max, ratio), r_max), nan


@triton.jit
def sequence_extremes_kernel(
    ratio, low, high,  # (n_seq * seq_len,) fp32 columns (strided), 0/1 indicators for low and high
    mask,  # (n_seq * seq_len,) fp32, 1 where a token counts
    part,  # (n_seq, 4) fp32 out: low fraction, -high fraction (inf: no token), ratio min, -ratio max
    stride_r, stride_l, stride_h, seq_len,
    BLOCK: tl.constexpr,
):
    """One program per sequence of ``seq_len`` rows: its clipped fractions and its counted tokens'
    ratio extremes (NaN if a counted ratio is NaN, as torch's amin), for extremes_finish_kernel."""
    s = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    n_low = tl.zeros([BLOCK], tl.float32)
    n_high = tl.zeros([BLOCK], tl.float32)
    n_tok = tl.zeros([BLOCK], tl.float32)
    r_min = tl.full([BLOCK], float("inf"), tl.float32)
    r_max = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, seq_len, BLOCK):
        t = start + offs
        inside = t < seq_len
        i = s * seq_len + t
        m = tl.load(mask + i, mask=inside, other=0.0).to(tl.float32)
        n_low += tl.load(low + i * stride_l, mask=inside, other=0.0).to(tl.float32) * m
        n_high += tl.load(high + i * stride_h, mask=inside, other=0.0).to(tl.float32) * m
        n_tok += m
        r = tl.load(ratio + i * stride_r, mask=inside, other=1.0).to(tl.float32)
        r_min, r_max, nan = _extremes_step(r_min, r_max, nan, r, m > 0)
    tokens = tl.sum(n_tok, axis=0)
    # correctly rounded, as torch divides (the GPU's default fp32 division is within 2 ulp)
    low_frac = tl.math.div_rn(tl.sum(n_low, axis=0), tl.maximum(tokens, 1.0))
    high_frac = tl.math.div_rn(tl.sum(n_high, axis=0), tl.maximum(tokens, 1.0))
    has_nan = tl.max(nan, axis=0) != 0
    lowest = tl.where(has_nan, float("nan"), tl.min(r_min, axis=0))
    highest = tl.where(has_nan, float("nan"), tl.max(r_max, axis=0))
    out = part + s * 4
    tl.store(out, tl.where(tokens > 0, low_frac, float("inf")))
    tl.store(out + 1, tl.where(tokens > 0, -high_frac, float("inf")))
    tl.store(out + 2, lowest)
    tl.store(out + 3, -highest)


@triton.jit
def extremes_finish_kernel(
    part,  # (n_seq, 4) fp32 from sequence_extremes_kernel
    count,  # (1,) counted tokens, any dtype
    low_mean, high_mean, ratio_mean,  # () fp32 token means
    out,  # (6,) fp32: low_min, high_max, ratio min, ratio max, clipped region mean, ratio mean
    n_seq,
    BLOCK: tl.constexpr,
):
    """The minima over sequences (NaN wins), and the values of a call with no counted token:
    clipped fractions 0, ratios 1."""
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, 4)
    acc = tl.full([BLOCK, 4], float("inf"), tl.float32)
    nan = tl.zeros([BLOCK, 4], tl.int32)
    for start in range(0, n_seq, BLOCK):
        i = start + offs
        v = tl.load(part + i[:, None] * 4 + cols[None, :], mask=(i < n_seq)[:, None], other=float("inf"))
        nan |= (v != v).to(tl.int32)
        acc = tl.where(v == v, tl.minimum(acc, v), acc)
    lowest = tl.min(acc, axis=0)
    lowest = tl.where(tl.max(nan, axis=0) != 0, float("nan"), lowest)
    sign = tl.where(cols % 2 == 0, 1.0, -1.0)
    counted = tl.load(count).to(tl.float32) > 0
    default = tl.where(cols >= 2, 1.0, 0.0)
    tl.store(out + cols, tl.where(counted, lowest * sign, default))
    tl.store(out + 4, tl.load(low_mean).to(tl.float32) + tl.load(high_mean).to(tl.float32))
    tl.store(out + 5, tl.where(counted, tl.load(ratio_mean).to(tl.float32), 1.0))


OBJECTIVE_PART = 16
"""Per-sequence fields policy_sequence_kernel writes for policy_objective_finish_kernel: [0] the sequence's
share of the loss, [1:9] sums over its counted tokens of the clipped-low / clipped-high indicators, the
ratio, logp, the dual-clip indicator, old - logp, the entropy and the KL, [9] its counted tokens,
[10] its low fraction and [11] minus its high fraction (inf: no token), [12] its smallest and [13] minus its
largest counted ratio (NaN if one is NaN), [14] / [15] its low / high fractions (0 without tokens)."""

OBJECTIVE_OUT = ("loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean", "logprob/mean",
                 "pg_clipfrac_lower", "ppo_kl", "entropy", "kl", "clip_ratio/low_min", "clip_ratio/high_max",
                 "ratio/min", "ratio/max", "clip_ratio/region_mean")
"""What policy_objective_finish_kernel writes into its (14,) metric vector, in this order."""

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_PART = tl.constexpr(16)  # OBJECTIVE_PART, for the kernels
OBJECTIVE_BLOCK = 512
"""Tokens per step of policy_sequence_kernel's passes over a sequence (its program loops over longer ones)."""


@triton.jit
def _objective_token(lp, o, r, a, iwv, keepf, L, g_self, S, F: tl.constexpr):
    """One token of the deferred mode's policy objective, the ratio exp(L) given (L: the token's own
    log-ratio, or its sequence's; ``g_self`` = d L / d logp of this token alone): (per_token,
    d per_token / d logp through this token alone, d per_token / d L, ratio, kl, low, high, dual).
    policy.objective_of and policy_objective have the same formulas in torch."""
    ratio = tl.exp(L)
    obj, d_obj, low, high, dual = _objective(lp, o, a, ratio, ratio * g_self, S, F)
    d_L = tl.zeros_like(lp)
    if F.IS_MODE == 1:  # (g_self = 0: d_obj is the part that does not go through the ratio)
        _, d_both, _, _, _ = _objective(lp, o, a, ratio, ratio, S, F)
        d_L = (d_both - d_obj) * iwv * keepf
    per_token = obj * iwv * keepf
    d_self = d_obj * iwv * keepf
    kl = tl.zeros_like(lp)
    if F.KL_EST != 0:
        kl, d_kl = _kl_penalty(lp, r, S, F)
        if F.KL_IS_CORR:
            d_kl = d_kl * ratio + kl * ratio * g_self
            if F.IS_MODE == 1:
                d_L += S.kl_beta * kl * ratio
            kl = kl * ratio
        per_token += S.kl_beta * kl
        d_self += S.kl_beta * d_kl
    return per_token, d_self, d_L, ratio, kl, low, high, dual


@triton.jit
def _objective_at(logp, entropy, old, ref, adv, iw, mask, weight, i, inside, stride_l, stride_e, adv_span, mean,
                  mean_drift, off_policy, n_counted, S, F: tl.constexpr):
    """Tokens ``i`` of a sequence (``inside`` it; old = logp when None, no rollout weight = 1; advantages
    by index ``i // adv_span``): (mask, logp, entropy, weight, the entropy bonus's weight, the token's
    log-ratio, and _objective_token's values) -- ``mean`` / ``mean_drift``: the sequence's mean log-ratio
    and off-policy drift."""
    m = tl.load(mask + i, mask=inside, other=0.0)
    counted = inside & (m > 0)  # the inputs are read at counted tokens only; 0 elsewhere (as torch's copies)
    lp = tl.load(logp + i * stride_l, mask=inside, other=0.0)
    o = lp
    if old is not None:
        o = tl.load(old + i, mask=counted, other=0.0).to(tl.float32)
    r = lp
    if F.KL_EST != 0:
        r = tl.load(ref + i, mask=counted, other=0.0).to(tl.float32)
    iwv = tl.full(lp.shape, 1.0, tl.float32)
    if iw is not None:
        iwv = tl.load(iw + i, mask=counted, other=0.0).to(tl.float32)
    ent = tl.zeros_like(lp)
    if entropy is not None:
        ent = tl.load(entropy + i * stride_e, mask=inside, other=0.0)
    a = tl.load(adv + i // adv_span, mask=counted, other=0.0).to(tl.float32)
    w = tl.load(weight + i, mask=inside, other=0.0)
    keepf = tl.full(lp.shape, 1.0, tl.float32)
    if F.OFF_POLICY:  # TRL: keep a sequence if A >= 0 or its mean drift is at most the threshold
        keepf = tl.where((a >= 0) | (tl.zeros_like(a) + mean_drift <= off_policy), 1.0, 0.0)
    log_ratio, L, g = _log_ratio_of(lp, o, mean, F)
    L = tl.where(inside, L, 0.0)  # lanes past the sequence: ratio 1 (its ratio there is inf * 0 = NaN in the sums)
    per_token, d_self, d_L, ratio, kl, low, high, dual = _objective_token(lp, o, r, a, iwv, keepf, L, g, S, F)
    bonus_w = w  # verl: the entropy aggregated like the loss; TRL: a mean over the call's counted tokens
    if F.ENT_TOKEN_MEAN:
        bonus_w = tl.math.div_rn(m, n_counted)
    return m, lp, ent, w, bonus_w, log_ratio, per_token, d_self, d_L, ratio, kl, low, high, dual


@triton.jit
def _log_ratio_of(lp, o, mean, F: tl.constexpr):
    """(the token's log-ratio as ppo_kl reads it, L, d L / d logp of the token alone) by the
    importance-sampling mode (``mean``: the sequence's mean log-ratio)."""
    log_ratio = lp - o
    g = tl.full(lp.shape, 1.0, tl.float32)
    if F.LOG_RATIO_CLAMP:
        g = tl.where((log_ratio >= -20.0) & (log_ratio <= 20.0), g, 0.0)
        log_ratio = tl.minimum(tl.maximum(log_ratio, -20.0), 20.0)
    if F.IS_MODE == 0:
        L = log_ratio
    elif F.IS_MODE == 1:  # TRL's GSPO: the sequence's ratio, the gradient through every token of it
        L = tl.zeros_like(lp) + mean
        g = tl.zeros_like(lp)
    else:  # verl's gspo: the sequence's value (at most 10), each token's own gradient
        L = tl.zeros_like(lp) + tl.where(mean > 10.0, 10.0, mean)
        g = tl.where(mean <= 10.0, 1.0, 0.0) + tl.zeros_like(lp)
    return log_ratio, L, g


@triton.jit
def policy_sequence_kernel(
    logp, entropy,  # (N,) columns of the deferred mode's packed rows (any stride); entropy None without one
    old, ref, adv, iw, mask, weight, sampled,  # (N,) flat policy inputs, any float dtype, read at counted tokens
    # only (mask > 0; fp32 mask and weight); advantages (N / adv_span,); old, ref, iw, sampled may be None
    # (sampled: the off-policy mask's rollout log-probs, else old)
    count,  # (1,) the call's counted tokens (TRL's token-mean entropy bonus), else None
    part,  # (n_seq, OBJECTIVE_PART) fp32 out, or None (gradient only)
    d_rows,  # (N, D_COLS) fp32 out: d loss / d logp and d loss / d entropy in their columns, 0 elsewhere; or None
    stride_l, stride_e, seq_len, adv_span, off_policy,
    S, F: tl.constexpr, D_COLS: tl.constexpr, COL_LOGP: tl.constexpr, COL_ENT: tl.constexpr,
    COLS_P2: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per sequence of ``seq_len`` rows: the policy objective of deferred mode (sequence-level
    ratios, the off-policy mask), its sums and extremes for the metrics, and d loss / d rows -- two launches
    where torch took about 100 small ops (policy.policy_objective, forward and backward)."""
    s = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    first = s * seq_len
    zero = tl.zeros([BLOCK], tl.float32)
    # 1. the sequence's mean log-ratio and the off-policy mask's mean drift
    mean = tl.zeros([], tl.float32)
    mean_drift = tl.zeros([], tl.float32)
    if F.IS_MODE != 0 or F.OFF_POLICY:
        acc_r = zero
        acc_d = zero
        acc_n = zero
        for start in range(0, seq_len, BLOCK):
            t = start + offs
            inside = t < seq_len
            i = first + t
            m = tl.load(mask + i, mask=inside, other=0.0)
            counted = inside & (m > 0)
            lp = tl.load(logp + i * stride_l, mask=inside, other=0.0)
            o = lp
            if old is not None:
                o = tl.load(old + i, mask=counted, other=0.0).to(tl.float32)
            acc_r += (lp - o) * m
            acc_n += m
            if F.OFF_POLICY:
                smp = o
                if sampled is not None:
                    smp = tl.load(sampled + i, mask=counted, other=0.0).to(tl.float32)
                drift = smp - lp  # torch.nan_to_num: NaN -> 0, +-inf -> fp32's extremes
                drift = tl.where(drift != drift, 0.0, tl.minimum(tl.maximum(drift, -_FP32_MAX), _FP32_MAX))
                acc_d += drift * m
        per = tl.maximum(tl.sum(acc_n, axis=0), 1.0)
        mean = tl.math.div_rn(tl.sum(acc_r, axis=0), per)
        mean_drift = tl.math.div_rn(tl.sum(acc_d, axis=0), per)
    n_counted = tl.full([], 1.0, tl.float32)
    if F.ENT_TOKEN_MEAN:
        n_counted = tl.maximum(tl.load(count).to(tl.float32), 1.0)
    # 2. the objective: the sequence's share of the loss and of the metrics, d loss / d L
    loss_acc = zero
    d_seq = zero
    s_low = zero
    s_high = zero
    s_ratio = zero
    s_lp = zero
    s_dual = zero
    s_pkl = zero
    s_ent = zero
    s_kl = zero
    n_tok = zero
    r_min = tl.full([BLOCK], float("inf"), tl.float32)
    r_max = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK], tl.int32)
    for start in range(0, seq_len, BLOCK):
        t = start + offs
        inside = t < seq_len
        i = first + t
        m, lp, ent, w, bonus_w, log_ratio, per_token, d_self, d_L, ratio, kl, low, high, dual = _objective_at(
            logp, entropy, old, ref, adv, iw, mask, weight, i, inside, stride_l, stride_e, adv_span, mean,
            mean_drift, off_policy, n_counted, S, F)
        loss_acc += w * per_token
        d_seq += w * d_L
        if F.ENT_BONUS:
            loss_acc -= S.entropy_coef * (ent * bonus_w)
        s_low += low.to(tl.float32) * m
        s_high += high.to(tl.float32) * m
        s_ratio += ratio * m
        s_lp += lp * m
        s_dual += dual.to(tl.float32) * m
        s_pkl += -log_ratio * m
        s_ent += ent * m
        s_kl += kl * m
        n_tok += m
        r_min, r_max, nan = _extremes_step(r_min, r_max, nan, ratio, m > 0)
    tokens = tl.sum(n_tok, axis=0)
    per = tl.maximum(tokens, 1.0)
    if part is not None:
        out = part + s * _PART
        tl.store(out, tl.sum(loss_acc, axis=0))
        tl.store(out + 1, tl.sum(s_low, axis=0))
        tl.store(out + 2, tl.sum(s_high, axis=0))
        tl.store(out + 3, tl.sum(s_ratio, axis=0))
        tl.store(out + 4, tl.sum(s_lp, axis=0))
        tl.store(out + 5, tl.sum(s_dual, axis=0))
        tl.store(out + 6, tl.sum(s_pkl, axis=0))
        tl.store(out + 7, tl.sum(s_ent, axis=0))
        tl.store(out + 8, tl.sum(s_kl, axis=0))
        tl.store(out + 9, tokens)
        low_frac = tl.math.div_rn(tl.sum(s_low, axis=0), per)
        high_frac = tl.math.div_rn(tl.sum(s_high, axis=0), per)
        tl.store(out + 10, tl.where(tokens > 0, low_frac, float("inf")))
        tl.store(out + 11, tl.where(tokens > 0, -high_frac, float("inf")))
        has_nan = tl.max(nan, axis=0) != 0
        tl.store(out + 12, tl.where(has_nan, float("nan"), tl.min(r_min, axis=0)))
        tl.store(out + 13, tl.where(has_nan, float("nan"), -tl.max(r_max, axis=0)))
        tl.store(out + 14, low_frac)
        tl.store(out + 15, high_frac)
    # 3. d loss / d logp (its own share, and through the sequence's ratio) and d loss / d entropy
    if d_rows is not None:
        through = tl.zeros([], tl.float32)
        if F.IS_MODE == 1:  # d L / d logp_t = mask_t / tokens
            through = tl.math.div_rn(tl.sum(d_seq, axis=0), per)
        cols = tl.arange(0, COLS_P2)
        for start in range(0, seq_len, BLOCK):
            t = start + offs
            inside = t < seq_len
            i = first + t
            m, _, _, w, bonus_w, _, _, d_self, _, _, _, _, _, _ = _objective_at(
                logp, entropy, old, ref, adv, iw, mask, weight, i, inside, stride_l, stride_e, adv_span, mean,
                mean_drift, off_policy, n_counted, S, F)
            d_logp = w * d_self
            if F.IS_MODE == 1:
                d_logp += through * m
            d_ent = tl.zeros([BLOCK], tl.float32)
            if F.ENT_BONUS:
                d_ent = -S.entropy_coef * bonus_w
            tile = tl.where(cols[None, :] == COL_LOGP, d_logp[:, None],
                            tl.where(cols[None, :] == COL_ENT, d_ent[:, None], 0.0))
            tl.store(d_rows + i[:, None] * D_COLS + cols[None, :], tile,
                     mask=inside[:, None] & (cols[None, :] < D_COLS))


@triton.jit
def _pick(values, cols, k: tl.constexpr):
    return tl.sum(tl.where(cols == k, values, 0.0), axis=0)


@triton.jit
def policy_objective_finish_kernel(
    part,  # (n_seq, OBJECTIVE_PART) fp32 from policy_sequence_kernel
    base_loss,  # () fp32: the other terms' loss (the policy term is added to it), or None
    total,  # () fp32 out: the loss
    out,  # (len(OBJECTIVE_OUT),) fp32 out: the metrics, OBJECTIVE_OUT's order
    n_seq, n_seq_div,  # sequences, and what the sequence means divide by (max(n_seq, 1), a float)
    F: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The sums over sequences, the extremes (NaN wins), and the metrics: token means, TRL's sequence-level
    clip fractions, and with no counted token clipped fractions 0 and ratios 1 (policy.policy_metrics_of)."""
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, _PART)
    sums = tl.zeros([BLOCK, _PART], tl.float32)
    mins = tl.full([BLOCK, _PART], float("inf"), tl.float32)
    nan = tl.zeros([BLOCK, _PART], tl.int32)
    for start in range(0, n_seq, BLOCK):
        i = start + offs
        valid = (i < n_seq)[:, None] & (cols[None, :] < _PART)
        v = tl.load(part + i[:, None] * _PART + cols[None, :], mask=valid, other=0.0)
        sums += v
        v = tl.where(valid, v, float("inf"))
        nan |= (v != v).to(tl.int32)
        mins = tl.where(v == v, tl.minimum(mins, v), mins)
    summed = tl.sum(sums, axis=0)
    lowest = tl.min(mins, axis=0)
    lowest = tl.where(tl.max(nan, axis=0) != 0, float("nan"), lowest)
    tokens = _pick(summed, cols, 9)
    per = tl.maximum(tokens, 1.0)
    counted = tokens > 0
    loss = _pick(summed, cols, 0)
    if base_loss is not None:
        loss = tl.load(base_loss) + loss
    tl.store(total, loss)
    tl.store(out, loss)
    low_mean = tl.math.div_rn(_pick(summed, cols, 1), per)
    high_mean = tl.math.div_rn(_pick(summed, cols, 2), per)
    if F.SEQ_CLIP_MEANS:
        low_mean = tl.math.div_rn(_pick(summed, cols, 14), n_seq_div)
        high_mean = tl.math.div_rn(_pick(summed, cols, 15), n_seq_div)
    tl.store(out + 1, low_mean)
    tl.store(out + 2, high_mean)
    tl.store(out + 3, tl.where(counted, tl.math.div_rn(_pick(summed, cols, 3), per), 1.0))
    for k in tl.static_range(4, 9):
        tl.store(out + k, tl.math.div_rn(_pick(summed, cols, k), per))
    tl.store(out + 9, tl.where(counted, _pick(lowest, cols, 10), 0.0))
    tl.store(out + 10, tl.where(counted, -_pick(lowest, cols, 11), 0.0))
    tl.store(out + 11, tl.where(counted, _pick(lowest, cols, 12), 1.0))
    tl.store(out + 12, tl.where(counted, -_pick(lowest, cols, 13), 1.0))
    tl.store(out + 13, low_mean + high_mean)


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
            row_ptr = grad + (row // geo.T) * geo.g_stride_b + (row % geo.T) * geo.g_stride_t
            for start in range(0, geo.V, BLOCK_V):
                cols = start + offs
                mask = cols < geo.V
                g = tl.load(row_ptr + cols, mask=mask).to(tl.float32)
                tl.store(row_ptr + cols, (g * factor).to(grad.dtype.element_ty), mask=mask)


# --- launchers -------------------------------------------------------------------------------

_COMPILED: dict[tuple, tuple] = {}
SCALE_PROGRAMS = 2048  # scale_grad_kernel's programs loop over the rows: fewer early exits when scale == 1


class _Params(NamedTuple):
    """A kernel's parameters, as C-level getters over a launch's keyword arguments."""

    runtime: operator.itemgetter  # -> tuple of the runtime arguments
    constexprs: operator.itemgetter  # -> tuple of the constexpr values
    every: operator.itemgetter  # -> tuple of every argument, in order
    runtime_at: tuple[int, ...]  # where the runtime arguments sit among every argument


_PARAMS: dict[object, _Params] = {}


def _getter(names: tuple[str, ...]) -> operator.itemgetter:
    """itemgetter that returns a tuple for any number of names (itemgetter of one name returns the item)."""
    if len(names) == 1:
        name = names[0]
        return lambda kwargs: (kwargs[name],)  # type: ignore[return-value]
    return operator.itemgetter(*names) if names else (lambda kwargs: ())  # type: ignore[return-value]


def _params_of(kernel) -> _Params:
    params = _PARAMS.get(kernel)
    if params is None:
        params = _PARAMS[kernel] = _Params(
            _getter(tuple(p.name for p in kernel.params if not p.is_constexpr)),
            _getter(tuple(p.name for p in kernel.params if p.is_constexpr)),
            _getter(tuple(p.name for p in kernel.params)),
            tuple(i for i, p in enumerate(kernel.params) if not p.is_constexpr),
        )
    return params


def _compiled_entry(compiled) -> tuple:
    """(C launch function, its fixed leading arguments) of a compiled variant: later launches call
    Triton's generated C launcher directly (its Python wrapper only allocates scratch, which these
    kernels never use), or (compiled.run, fixed arguments) when a variant does use scratch."""
    run = compiled.run
    fixed_meta = (compiled.packed_metadata, None, None, None)
    if getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0 \
            and hasattr(run, "launch"):
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, *fixed_meta)
    return run, (compiled.function, *fixed_meta)


_NORM_AT = Geometry._fields.index("norm")
_FLOATS_ONLY = {Scalars}  # NamedTuples of floats only: Triton specialises a float by its type, never its value


def _spec_of(arg):
    """What Triton's specialisation of one runtime argument depends on, cheaply: a tensor's dtype and
    16-byte alignment, an int's value, a float's type (see tests/test_launch.py)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    kind = type(arg)
    if kind is int or arg is None:
        return arg
    if kind is Geometry:  # ints, and norm (a float)
        return arg[:_NORM_AT] + arg[_NORM_AT + 1:]
    if kind in _FLOATS_ONLY:
        return kind
    if kind is Prepare:  # its nonce changes every call; next_nonce fixes how Triton specialises it
        return kind, _spec_of(arg.verdict), _spec_of(arg.dirty), arg.nonce is None, _spec_of(arg.sequence_ids), \
            arg.n_seq
    if kind is float:
        return float
    if isinstance(arg, tuple):
        return kind, tuple([_spec_of(a) for a in arg])
    return kind, arg  # bools and anything else: by type and value


def spec_key(args: tuple) -> tuple:
    """A key at least as fine as ``native_specialize_impl(args)``: equal keys, equal specialisations."""
    return tuple([_spec_of(a) for a in args])


def launch(kernel, grid: int, num_warps: int, **kwargs) -> None:
    """``kernel[(grid,)](**kwargs)``. After a variant's first launch, later launches of the same
    variant call its compiled C launcher directly, found by :func:`spec_key` over the runtime
    arguments (what Triton specialises on, computed in Python at a third of the cost of Triton's
    ``native_specialize_impl``; a new key falls back to that and to Triton's launch). Triton's own
    per-launch binding, cache key and launch metadata cost 20-50 us of host time per launch on an
    H200 host (benchmarks/bench_host.py). A profiler's launch hooks, the interpreter and
    ``HEADLOSS_FAST_LAUNCH=0`` take Triton's path."""
    hooks = triton.knobs.runtime.launch_enter_hook
    if not _FAST_LAUNCH or not isinstance(kernel, _JIT) or (hooks is not None and getattr(hooks, "calls", True)):
        kernel[(grid,)](**kwargs, num_warps=num_warps)
        return
    params = _params_of(kernel)
    device = _current_device()
    args = list(params.every(kwargs))
    spec = []
    for i in params.runtime_at:  # spec_key, and a CUDA tensor's address as an int: the C launcher then
        arg = args[i]  # skips its cuPointerGetAttribute per tensor (inputs were checked to be on the device)
        if isinstance(arg, torch.Tensor) and arg.is_cuda:
            address = args[i] = arg.data_ptr()
            spec.append((arg.dtype, not address & 15))
        else:
            spec.append(_spec_of(arg))
    constexprs = params.constexprs(kwargs)
    fast_key = (kernel, device, num_warps, constexprs, tuple(spec))
    entry = _FAST.get(fast_key)
    if entry is None:
        runtime = params.runtime(kwargs)
        caches = kernel.device_caches.get(device) if kernel.device_caches else None
        if caches is None:  # first launch on this device: Triton builds its caches and the backend
            kernel[(grid,)](**kwargs, num_warps=num_warps)
            return
        key = (kernel, device, num_warps, constexprs, native_specialize_impl(caches[3], runtime, False, True, True))
        entry = _COMPILED.get(key)
        if entry is None:
            compiled = kernel[(grid,)](**kwargs, num_warps=num_warps)
            if compiled is not None:
                _COMPILED[key] = _compiled_entry(compiled)
            return
        if len(_FAST) >= 4096:
            _FAST.clear()
        _FAST[fast_key] = entry
    run, fixed = entry
    run(grid, 1, 1, _raw_stream(device), *fixed, *args)


_FAST: dict[tuple, tuple] = {}
_JIT = triton.runtime.jit.JITFunction
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_FAST_LAUNCH = os.environ.get("HEADLOSS_FAST_LAUNCH", "1") != "0"
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass(frozen=True)
class LaunchConfig:
    block_v: int
    num_warps: int


def launch_config(vocab: int, teacher: bool = False, rows: int | None = None) -> LaunchConfig:
    """Block and warps for a row of ``vocab`` logits, in a launch of ``rows`` rows (cached).

    2048 columns x 4 warps (16 per thread) was fastest on an H200 at V=128256 for every spec
    (benchmarks/profile_head.py --ablate, bench_head.py --tune): small enough per-thread state
    for high occupancy, which this latency-bound loop needs. With a teacher the per-lane state
    doubles, and 1024 x 4 was fastest (2996 vs 3216 us, profile_head.py --terms).
    A launch of fewer than 1024 rows (the fused lm_head's chunks) has too few programs to fill
    the GPU with 4 warps each: 4096 x 8 (the same 16 per thread) ran 256/320/512-row chunks at
    2.39/2.05/1.77 ms per 8192 rows against 2.97/2.96/2.10 (benchmarks/profile_linear.py).
    HEADLOSS_BLOCK_V / HEADLOSS_NUM_WARPS (read at import) or :data:`LAUNCH_OVERRIDES` (set by those
    sweeps) override it.
    """
    return _launch_config(vocab, teacher, rows is not None and rows < 1024, LAUNCH_OVERRIDES["block_v"],
                          LAUNCH_OVERRIDES["num_warps"])


LAUNCH_OVERRIDES: dict[str, int | None] = {
    "block_v": int(os.environ["HEADLOSS_BLOCK_V"]) if os.environ.get("HEADLOSS_BLOCK_V") else None,
    "num_warps": int(os.environ["HEADLOSS_NUM_WARPS"]) if os.environ.get("HEADLOSS_NUM_WARPS") else None,
}
"""Block size and warps forced on every head launch (None: the measured defaults)."""


@functools.lru_cache(maxsize=1024)
def _launch_config(vocab: int, teacher: bool, few_rows: bool, block_v: int | None, num_warps: int | None
                   ) -> LaunchConfig:
    block = min(1 << (max(vocab, 16) - 1).bit_length(), 1024 if teacher else 2048)
    warps = 4 if block >= 1024 else (2 if block >= 256 else 1)
    if not teacher and few_rows and vocab >= 16384:
        block, warps = 4096, 8
    return LaunchConfig(block_v=block_v or block, num_warps=num_warps or warps)


def row_strides(t: torch.Tensor | None) -> tuple[int, int]:
    """(stride_b, stride_t) of a [N, V] (one sequence of N rows) or [B, T, V] tensor; (0, 0) for None."""
    if t is None:
        return 0, 0
    if t.dim() == 2:
        return 0, t.stride(0)
    return t.stride(0), t.stride(1)


class Tiles(NamedTuple):
    """Tiles of the last program's reduction (constexpr): [BLOCK_R, COLS_P2] over the packed rows,
    SEQ_BLOCK sequences at a time for the per-sequence policy metrics."""

    COLS_P2: int
    BLOCK_R: int
    SEQ_BLOCK: int
    PREP_BLOCK: int  # targets per step of the head kernel's in-kernel prepare (program 0): 2048 took the
    # head kernel from 72 to 125 registers and 1.57 to 1.90 ms at N=8192, V=128256 on an H200; 512, 69-71
    # registers and no slower than with a prepare launch (.scratch A/B, this change's closing note)


@functools.lru_cache(maxsize=256)
def _tiles(cols: int) -> Tiles:
    """Small tiles: this code runs once per call, but the registers it takes are reserved for the
    whole kernel (5 tiles of 2048 values slowed the GRPO head kernel from 1.47 to 2.54 ms on an H200)."""
    cols_p2 = 1 << (max(cols, 1) - 1).bit_length()
    return Tiles(COLS_P2=cols_p2, BLOCK_R=max(16, 2048 // cols_p2), SEQ_BLOCK=256, PREP_BLOCK=512)


def prepare(targets: torch.Tensor | None, num_items: torch.Tensor | None, sequence_ids: torch.Tensor | None,
            geo: Geometry, device: torch.device, verdict: tuple | None, n_seq: int = 0) -> torch.Tensor:
    """Launch prepare_kernel; returns the call's scratch (counted rows first). ``verdict`` is a
    (slot, dirty) pair of host tensors the device writes when a value is bad, or None (no checks)."""
    scratch = torch.empty(scratch_size(n_seq), dtype=torch.int64, device=device)
    slot, dirty = verdict if verdict is not None else (None, None)
    launch(prepare_kernel, 1, 8, targets=targets, num_items=num_items, sequence_ids=sequence_ids, scratch=scratch,
           verdict=slot, dirty=dirty, geo=geo, n_seq=n_seq, BLOCK=4096)
    return scratch


def launch_head(plan: KernelPlan, *, logits, targets, teacher, grad, rows, pred, policy, num_items, scratch, loss,
                means, geo: Geometry, finish: bool = True, stats: torch.Tensor | None = None,
                jsd: torch.Tensor | None = None, verdict: tuple | None = None, prepared: bool = True,
                sequence_ids: torch.Tensor | None = None, n_seq: int = 0) -> None:
    """One program per logits row; with ``finish`` the last one writes ``means`` and the reduced loss.
    ``prepared=False``: ``scratch`` (scratch_size(n_seq) words, any content) was not filled by
    :func:`prepare`; program 0 does that work first (``verdict``, ``sequence_ids`` and ``n_seq`` as
    prepare takes them), and the other programs wait for it only where they read what it writes --
    one launch fewer per call."""
    if geo.n_rows == 0:
        return
    cfg = launch_config(geo.V, plan.has_teacher, geo.n_rows)
    prep = _PREPARED
    if not prepared:
        prep = Prepare(*(verdict if verdict is not None else (None, None)), next_nonce(), sequence_ids, n_seq)
    launch(
        head_kernel, geo.n_rows, cfg.num_warps,
        logits=logits, targets=targets, teacher=teacher, grad=grad, rows=rows, pred=pred, policy=policy,
        num_items=num_items, scratch=scratch, loss=loss, means=means,
        shard=_UNSHARDED if stats is None else ShardRows(stats, jsd), prep=prep, geo=geo, S=plan.scalars,
        F=plan.flags, C=plan.cols, BLOCK_V=cfg.block_v, FINISH=finish, R=_tiles(plan.cols.N),
    )


_PREPARED = Prepare(None, None, None)
_UNSHARDED = ShardRows(None, None)
_NONCES = itertools.count(int.from_bytes(os.urandom(3), "little"))


def next_nonce() -> int:
    """A tag unique to one in-kernel prepare (``launch_head(prepared=False)``): a multiple of 2**32
    (so no count of finished programs reaches the next tag) above 2**32 (one int64 specialisation),
    from a random start (another process's stale buffer holds another tag)."""
    return (next(_NONCES) % (1 << 30) + 1) << 32


def launch_shard_stats(plan: KernelPlan, *, logits, targets, geo: Geometry, teacher=None) -> torch.Tensor:
    """This shard's (n_rows, STATS [+ TEACHER_STATS]) statistics (vocab-parallel phase 1)."""
    width = STATS + (TEACHER_STATS if teacher is not None else 0)
    part = torch.empty(geo.n_rows, width, dtype=torch.float32, device=logits.device)
    if geo.n_rows:
        cfg = launch_config(geo.V, teacher is not None, geo.n_rows)
        launch(shard_stats_kernel, geo.n_rows, cfg.num_warps, logits=logits, targets=targets, teacher=teacher,
               part=part, geo=geo, S=plan.scalars, F=plan.flags, BLOCK_V=cfg.block_v)
    return part


def launch_shard_jsd(plan: KernelPlan, *, logits, targets, teacher, stats, geo: Geometry) -> torch.Tensor:
    """This shard's (n_rows, 2) share of the mixture JSD (summed over the group by the caller)."""
    jsd = torch.empty(geo.n_rows, 2, dtype=torch.float32, device=logits.device)
    if geo.n_rows:
        cfg = launch_config(geo.V, True, geo.n_rows)
        launch(shard_jsd_kernel, geo.n_rows, cfg.num_warps, logits=logits, targets=targets, teacher=teacher,
               stats=stats, jsd=jsd, geo=geo, S=plan.scalars, F=plan.flags, BLOCK_V=cfg.block_v)
    return jsd


def launch_merge(parts: torch.Tensor, own_temp: bool = False) -> torch.Tensor:
    """merge_stats_kernel over (world, n_rows, STATS [+ TEACHER_STATS]) gathered statistics: one launch."""
    world, n_rows, width = parts.shape
    merged = torch.empty(n_rows, width, dtype=torch.float32, device=parts.device)
    if n_rows:
        block = 256 if width == STATS else 128
        launch(merge_stats_kernel, triton.cdiv(n_rows, block), 4, parts=parts, merged=merged, n_rows=n_rows,
               world=world, BLOCK=block, NCOL=width, OWN_TEMP=own_temp)
    return merged


def launch_finish(plan: KernelPlan, *, rows, loss, means, scratch, num_items, geo: Geometry) -> None:
    """The reduction of launch_head's last program, as a launch of its own (chunked callers; their
    per-sequence policy metrics are left to torch)."""
    policy = PolicyRows(None, None, None, None, None, 1, 0) if plan.flags.HAS_POLICY else None
    launch(finish_kernel, 1, 4, rows=rows, loss=loss, means=means, scratch=scratch, num_items=num_items,
           policy=policy, geo=geo, F=plan.flags, C=plan.cols, R=_tiles(plan.cols.N))


def launch_backward(plan: KernelPlan, *, logits, targets, teacher, grad, rows, d_loss, d_rows, num_items, scratch,
                    geo: Geometry, stats: torch.Tensor | None = None) -> None:
    """Deferred mode: d loss / d logits into ``grad`` from the saved rows and the upstream gradients."""
    if geo.n_rows == 0:
        return
    cfg = launch_config(geo.V, plan.has_teacher, geo.n_rows)
    launch(
        head_backward_kernel, geo.n_rows, cfg.num_warps,
        logits=logits, targets=targets, teacher=teacher, grad=grad, rows=rows, d_loss=d_loss, d_rows=d_rows,
        num_items=num_items, scratch=scratch, stats=stats, geo=geo, S=plan.scalars, F=plan.flags, C=plan.cols,
        BLOCK_V=cfg.block_v,
    )


def launch_sequence_extremes(ratio: torch.Tensor, low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor,
                             count: torch.Tensor, low_mean: torch.Tensor, high_mean: torch.Tensor,
                             ratio_mean: torch.Tensor, n_seq: int, seq_len: int) -> torch.Tensor:
    """(6,) fp32 [low_min, high_max, ratio min, ratio max, clipped region mean, ratio mean] of tokens
    in ``n_seq`` sequences of ``seq_len`` rows (1-D columns of any stride, ``mask`` contiguous): two
    launches where torch took about 30 small ops (policy.policy_extremes)."""
    part = torch.empty(n_seq, 4, dtype=torch.float32, device=mask.device)
    out = torch.empty(6, dtype=torch.float32, device=mask.device)
    block = min(1024, max(16, triton.next_power_of_2(seq_len)))
    launch(sequence_extremes_kernel, n_seq, 4, ratio=ratio, low=low, high=high, mask=mask, part=part,
           stride_r=ratio.stride(0), stride_l=low.stride(0), stride_h=high.stride(0), seq_len=seq_len, BLOCK=block)
    launch(extremes_finish_kernel, 1, 4, part=part, count=count, low_mean=low_mean, high_mean=high_mean,
           ratio_mean=ratio_mean, out=out, n_seq=n_seq, BLOCK=256)
    return out


def launch_policy_objective(flags, scalars: Scalars, *, logp: torch.Tensor, entropy: torch.Tensor | None,
                            old, ref, adv, iw, mask, weight, sampled, count, n_seq: int, seq_len: int,
                            adv_span: int, off_policy: float, d_cols: int, col_logp: int, col_ent: int,
                            base_loss: torch.Tensor | None = None, metrics: bool = True, grad: bool = True,
                            total: torch.Tensor | None = None, out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(loss, metrics (len(OBJECTIVE_OUT),), d_rows (N, d_cols)) of the deferred mode's policy term on
    ``n_seq`` sequences of ``seq_len`` rows (plan.ObjectiveFlags ``flags``; inputs as
    policy_sequence_kernel takes them): two launches, or one without ``metrics`` (loss and metrics
    None). The loss is ``base_loss`` plus the policy term; d_rows (``grad``, else None) is d loss / d rows
    for one unit of upstream gradient. ``total`` / ``out``: where to write the loss (it may be
    ``base_loss`` itself) and the metrics, instead of new tensors."""
    device = mask.device
    f32 = dict(dtype=torch.float32, device=device)
    part = torch.empty(n_seq, OBJECTIVE_PART, **f32) if metrics else None
    d_rows = torch.empty(n_seq * seq_len, d_cols, **f32) if grad else None
    block = min(OBJECTIVE_BLOCK, max(16, triton.next_power_of_2(seq_len)))
    launch(policy_sequence_kernel, n_seq, 4, logp=logp, entropy=entropy, old=old, ref=ref, adv=adv, iw=iw,
           mask=mask, weight=weight, sampled=sampled, count=count, part=part, d_rows=d_rows,
           stride_l=logp.stride(0), stride_e=0 if entropy is None else entropy.stride(0), seq_len=seq_len,
           adv_span=adv_span, off_policy=float(off_policy), S=scalars, F=flags, D_COLS=d_cols, COL_LOGP=col_logp,
           COL_ENT=col_ent, COLS_P2=triton.next_power_of_2(max(d_cols, 1)), BLOCK=block)
    if not metrics:
        return None, None, d_rows
    total = torch.empty((), **f32) if total is None else total
    out = torch.empty(len(OBJECTIVE_OUT), **f32) if out is None else out
    launch(policy_objective_finish_kernel, 1, 4, part=part, base_loss=base_loss, total=total, out=out, n_seq=n_seq,
           n_seq_div=float(max(n_seq, 1)), F=flags, BLOCK=64)
    return total, out, d_rows


def scale_grad_(grad: torch.Tensor, scale: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """grad *= scale in place (grad addressed through geo's gradient strides), skipped on the
    device when scale == 1 (no host sync)."""
    if geo.n_rows > 0:
        cfg = launch_config(geo.V)
        launch(scale_grad_kernel, min(geo.n_rows, SCALE_PROGRAMS), cfg.num_warps, grad=grad, scale=scale, geo=geo,
               BLOCK_V=cfg.block_v)
    return grad
