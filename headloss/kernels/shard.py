"""Vocab-parallel kernels: each rank's statistics of its vocabulary shard, their merge, the JSD's shares.

``shard_stats_kernel``  phase 1 on one shard: per row the layouts.Stats values every rank exchanges
``merge_stats_kernel``  the gathered (world, rows, N) statistics -> the whole vocabulary's, one launch
``shard_jsd_kernel``    the mixture JSD's extra pass on one shard, with the merged normalisers
``merged_stats`` / ``merged_teacher``  a row's merged statistics, read by the head kernels (a call whose
                          statistics are the student's alone: the gathered shares, merged per row)

The head kernel then runs phases 2 and 3 on the shard with the merged statistics (headloss.parallel
does the one collective between).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..layouts import JSD_AT, JSD_SHARES, STATS, STATS_AT
from ..plan import KernelPlan
from .blocks import online_stats, row_slot, row_start, row_temperature, target_logit
from .launch import FIT_SPILLS, Geometry, launch, launch_config
from .sparse import SparseRows, block_if, rest_sum, shard_selected, shard_topk, topk_block
from .terms import distill_lse, jsd_sums
from .topk import bound_blocks, collect_words, row_buffers, topk_shard_store, topk_start


@triton.jit
def shard_stats_kernel(
    logits,  # (rows, V_shard) addressed through geo.stride_*
    targets,  # (n_out,) global ids, or None
    teacher,  # the teacher's logits on the same columns (geo.t_stride_*), or None
    part,  # (n_rows, NCOL) fp32 out: this shard's statistics (layouts.Stats: N columns, N_TEACHER with a teacher)
    sparse,  # kernels.sparse.SparseRows of a top-k teacher (F.SPARSE == 1), or None
    x2k,  # (n_rows, BLOCK_K) fp32 out: this shard's top-k logits (sparse.shard_topk), or None
    temperature,  # (n_out,) fp32 per-row temperature, or None (kernels.head.head_kernel's)
    selected,  # (n_out, F.SELECTED) int64 selected ids, or None
    x2s,  # (n_rows, BLOCK_S) fp32 out: this shard's selected logits (sparse.shard_selected), or None
    keys,  # (n_rows, 2 BLOCK_T) fp32 out: this shard's top-k keys (topk.topk_shard_store), or None
    buf,  # (n_rows, topk.collect_words(BLOCK_T, BLOCK_V, BLOCK_NB)) int64: the top-k's buffer a row, or None
    geo,
    S,
    F: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,  # the student's top-k (F.STUDENT_TOPK) rounded up to a power of two, 0 without
    BLOCK_NB: tl.constexpr,  # the blocks of a row its bound keeps (kernels.topk.bound_blocks), 0 without
):
    """Phase 1 of a vocab-parallel head on one shard: the statistics every rank exchanges."""
    NCOL: tl.constexpr = STATS_AT.N_TEACHER if teacher is not None else STATS_AT.N
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits, row, geo.T, geo.stride_b, geo.stride_t)
    t_row = row_start(teacher, row, geo.T, geo.t_stride_b, geo.t_stride_t)
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    S = row_temperature(S, temperature, slot, has_slot)
    out = part + row * NCOL
    x2_ids = tl.zeros([BLOCK_K], tl.float32)
    if F.SPARSE == 1:
        x2_ids = shard_topk(x2k, sparse, slot, row, row_ptr, counted, geo, S, F, BLOCK_K)
    if F.SELECTED > 0:
        shard_selected(x2s, selected, slot, row, row_ptr, counted, geo, S, F, BLOCK_S)
    if counted:
        m2, d, sum_x2, sum_ex2, arg, tstats, off, top = online_stats(
            row_ptr, t_row, geo.V, S, F, BLOCK_V, F.HAS_ENTROPY, BLOCK_T, geo.vocab_start, BLOCK_NB,
            None if buf is None else buf + row * collect_words(BLOCK_T, BLOCK_V, BLOCK_NB))
        if BLOCK_T > 0:
            topk_shard_store(keys + row * 2 * BLOCK_T, top, counted, F.STUDENT_TOPK, BLOCK_T)
        rest = tl.zeros([], tl.float32)
        if F.TOPK_FORM == 2:  # this shard's sum off the teacher's ids (its ids: x2 > -inf)
            rest = rest_sum(x2_ids, x2_ids > float("-inf"), m2, off)
        x2_y = tl.zeros([], tl.float32)
        owned = tl.zeros([], tl.float32)
        if targets is not None:
            y_here = y - geo.vocab_start
            if (y_here >= 0) & (y_here < geo.V):
                x2_y, slope_unused = target_logit(row_ptr, y_here, geo.V, S, F.HAS_SOFTCAP)
                owned = tl.full([], 1.0, tl.float32)
        tl.store(out + STATS_AT.m2, m2)
        tl.store(out + STATS_AT.d, d)
        tl.store(out + STATS_AT.sum_x2, sum_x2)
        tl.store(out + STATS_AT.sum_ex2, sum_ex2)
        tl.store(out + STATS_AT.arg, (arg + geo.vocab_start).to(tl.float32))
        tl.store(out + STATS_AT.x2_y, x2_y)
        tl.store(out + STATS_AT.owned, owned)
        tl.store(out + STATS_AT.rest, rest)
        if teacher is not None:
            mt, dt, sum_t, sum_ts, ms, ds, sum_st, t_arg = tstats
            tl.store(out + STATS_AT.t_m2, mt)
            tl.store(out + STATS_AT.t_d, dt)
            tl.store(out + STATS_AT.t_sum, sum_t)
            tl.store(out + STATS_AT.t_cross, sum_ts)
            tl.store(out + STATS_AT.s_m2, ms)
            tl.store(out + STATS_AT.s_d, ds)
            tl.store(out + STATS_AT.s_cross, sum_st)
            tl.store(out + STATS_AT.t_arg, (t_arg + geo.vocab_start).to(tl.float32))
    else:
        if BLOCK_T > 0:
            topk_shard_store(keys + row * 2 * BLOCK_T, topk_start(F.STUDENT_TOPK, BLOCK_T), counted, F.STUDENT_TOPK,
                             BLOCK_T)
        tl.store(out + STATS_AT.m2, float("-inf"))
        tl.store(out + STATS_AT.d, 0.0)
        tl.store(out + STATS_AT.sum_x2, 0.0)
        tl.store(out + STATS_AT.sum_ex2, 0.0)
        tl.store(out + STATS_AT.arg, 0.0)
        tl.store(out + STATS_AT.x2_y, 0.0)
        tl.store(out + STATS_AT.owned, 0.0)
        tl.store(out + STATS_AT.rest, 0.0)
        if teacher is not None:
            tl.store(out + STATS_AT.t_m2, float("-inf"))
            tl.store(out + STATS_AT.t_d, 0.0)
            tl.store(out + STATS_AT.t_sum, 0.0)
            tl.store(out + STATS_AT.t_cross, 0.0)
            tl.store(out + STATS_AT.s_m2, float("-inf"))
            tl.store(out + STATS_AT.s_d, 0.0)
            tl.store(out + STATS_AT.s_cross, 0.0)
            tl.store(out + STATS_AT.t_arg, 0.0)


@triton.jit
def shard_jsd_kernel(
    logits,  # (rows, V_shard)
    targets,  # (n_out,) global ids, or None
    teacher,  # the teacher's logits on the same columns
    stats,  # (n_rows, NCOL) merged statistics: layouts.Stats' N_TEACHER columns, then their tail
    jsd,  # (n_rows, JSD_SHARES.N) fp32 out: this shard's share of the JSD and KL(p_s || M)
    temperature,  # (n_out,) fp32 per-row temperature, or None
    geo,
    S,
    F: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NCOL: tl.constexpr,
):
    """The mixture JSD's extra pass on one shard, with the whole vocabulary's normalisers: its terms
    are sums over the vocabulary, so the shards' shares add up (the second collective)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits, row, geo.T, geo.stride_b, geo.stride_t)
    t_row = row_start(teacher, row, geo.T, geo.t_stride_b, geo.t_stride_t)
    slot, has_slot, y, counted = row_slot(targets, row, geo)
    S = row_temperature(S, temperature, slot, has_slot)
    value = tl.zeros([], tl.float32)
    kl_s = tl.zeros([], tl.float32)
    if counted:
        at = stats + row * NCOL
        lse_s2, lse_t2, t_minus_s = distill_lse(tl.load(at + STATS_AT.m2), tl.load(at + STATS_AT.d),
                                                merged_teacher(stats, row, NCOL), F)
        value, kl_s = jsd_sums(row_ptr, t_row, geo.V, lse_s2, lse_t2, t_minus_s, S, BLOCK_V, F)
    tl.store(jsd + row * JSD_AT.N + JSD_AT.value, value)
    tl.store(jsd + row * JSD_AT.N + JSD_AT.kl_s, kl_s)


@triton.jit
def _merge_start(zero):
    """The empty accumulator of :func:`_merge_rank`, shaped like ``zero`` (a block of rows, or one row):
    (sum_a, sum_b, sum_c, arg, found)."""
    return zero, zero, zero, zero, zero != zero


@triton.jit
def _merge_rank(base, inside, top, acc, M: tl.constexpr, SUM_A: tl.constexpr, SUM_B: tl.constexpr,
                SUM_C: tl.constexpr, ARG: tl.constexpr):
    """One rank's share of a merged softmax: its columns SUM_A, SUM_B, SUM_C rescaled from its max
    (column M) to ``top`` and added to ``acc``'s sums, and its column ARG taken when it is the lowest
    rank whose max is ``top`` (its first index: shards are in vocabulary order). A column of -1 is
    not read."""
    sum_a, sum_b, sum_c, arg, found = acc
    m = tl.load(base + M, mask=inside, other=float("-inf"))
    scale = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
    if SUM_A >= 0:
        sum_a += tl.load(base + SUM_A, mask=inside, other=0.0) * scale
    if SUM_B >= 0:
        sum_b += tl.load(base + SUM_B, mask=inside, other=0.0) * scale
    if SUM_C >= 0:
        sum_c += tl.load(base + SUM_C, mask=inside, other=0.0) * scale
    if ARG >= 0:
        first = (m == top) & (found == 0)
        arg = tl.where(first, tl.load(base + ARG, mask=inside, other=0.0), arg)
        found = found | (m == top)
    return sum_a, sum_b, sum_c, arg, found


@triton.jit
def _store4(out, inside, A: tl.constexpr, a, B: tl.constexpr, b, C: tl.constexpr, c, D: tl.constexpr, d):
    """Columns A, B, C, D of the merged rows ``out`` (masked by ``inside``)."""
    tl.store(out + A, a, mask=inside)
    tl.store(out + B, b, mask=inside)
    tl.store(out + C, c, mask=inside)
    tl.store(out + D, d, mask=inside)


@triton.jit
def _merge_student(rows, stride, inside, world, zero):
    """The student's statistics of ``rows`` (pointers to rank 0's share of each row; rank r's ``r * stride``
    on), merged over ``world`` shards: (m2, d, sum_x2, sum_ex2, rest, arg, x2_y, owners) -- the max of the
    maxima, the sums rescaled to it, the argmax of the lowest rank holding the max (its first index:
    shards are in vocabulary order), the owner's target logit and the owner count; a NaN max propagates.
    Shaped like ``zero``: a block of rows (merge_stats_kernel) or one row (the head kernels)."""
    top = zero + float("-inf")
    for r in range(world):
        top = tl.maximum(top, tl.load(rows + r * stride + STATS_AT.m2, mask=inside, other=float("-inf")))
    student = _merge_start(zero)
    sum_x2 = zero
    x2_y = zero
    owners = zero
    for r in range(world):
        base = rows + r * stride
        student = _merge_rank(base, inside, top, student, STATS_AT.m2, STATS_AT.d, STATS_AT.sum_ex2, STATS_AT.rest,
                              STATS_AT.arg)
        sum_x2 += tl.load(base + STATS_AT.sum_x2, mask=inside, other=0.0)
        owned = tl.load(base + STATS_AT.owned, mask=inside, other=0.0)
        x2_y += tl.where(owned > 0.5, tl.load(base + STATS_AT.x2_y, mask=inside, other=0.0), 0.0)
        owners += owned
    d, sum_ex2, rest, arg, _ = student
    # a NaN max (NaN logits) propagates as tl.maximum would not: keep it
    nan_top = zero != zero
    for r in range(world):
        m = tl.load(rows + r * stride + STATS_AT.m2, mask=inside, other=0.0)
        nan_top = nan_top | (m != m)
    top = tl.where(nan_top, float("nan"), top)
    return top, d, sum_x2, sum_ex2, rest, arg, x2_y, owners


@triton.jit
def merge_stats_kernel(parts, merged, n_rows, world, BLOCK: tl.constexpr, NCOL: tl.constexpr,
                       OWN_TEMP: tl.constexpr):
    """(world, n_rows, NCOL) per-shard statistics (layouts.Stats) -> (n_rows, NCOL) of the whole vocabulary: the max
    of the maxima, the sums rescaled to it, the argmax of the lowest rank holding the max (its first
    index: shards are in vocabulary order), the owner's target logit and the owner count."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = rows < n_rows
    at = rows.to(tl.int64) * NCOL
    stride = tl.full([], NCOL, tl.int64) * n_rows
    zero = tl.zeros([BLOCK], tl.float32)
    top, d, sum_x2, sum_ex2, rest, arg, x2_y, owners = _merge_student(parts + at, stride, inside, world, zero)
    out = merged + at
    _store4(out, inside, STATS_AT.m2, top, STATS_AT.d, d, STATS_AT.sum_x2, sum_x2, STATS_AT.sum_ex2, sum_ex2)
    _store4(out, inside, STATS_AT.arg, arg, STATS_AT.x2_y, x2_y, STATS_AT.owned, owners, STATS_AT.rest, rest)
    if NCOL == STATS_AT.N_TEACHER:  # the teacher's sums against its max; the student's at T_d against theirs
        top_t = tl.full([BLOCK], float("-inf"), tl.float32)
        top_s = tl.full([BLOCK], float("-inf"), tl.float32)
        for r in range(world):
            base = parts + r * stride + at
            top_t = tl.maximum(top_t, tl.load(base + STATS_AT.t_m2, mask=inside, other=float("-inf")))
            top_s = tl.maximum(top_s, tl.load(base + STATS_AT.s_m2, mask=inside, other=float("-inf")))
        teacher = _merge_start(zero)
        at_temp = _merge_start(zero)
        for r in range(world):
            base = parts + r * stride + at
            teacher = _merge_rank(base, inside, top_t, teacher, STATS_AT.t_m2, STATS_AT.t_d, STATS_AT.t_sum,
                                  STATS_AT.t_cross, STATS_AT.t_arg)
            if OWN_TEMP:
                at_temp = _merge_rank(base, inside, top_s, at_temp, STATS_AT.s_m2, STATS_AT.s_d, STATS_AT.s_cross, -1,
                                      -1)
            else:  # the reverse-KL sum runs against the student's own max (column 0)
                at_temp = _merge_rank(base, inside, top, at_temp, STATS_AT.m2, -1, STATS_AT.s_cross, -1, -1)
        dt, sum_t, sum_ts, t_arg, _ = teacher
        ds, sum_st, _, _, _ = at_temp
        _store4(out, inside, STATS_AT.t_m2, top_t, STATS_AT.t_d, dt, STATS_AT.t_sum, sum_t, STATS_AT.t_cross, sum_ts)
        _store4(out, inside, STATS_AT.s_m2, top_s, STATS_AT.s_d, ds, STATS_AT.s_cross, sum_st, STATS_AT.t_arg, t_arg)


@triton.jit
def merged_teacher(stats, row, NCOL: tl.constexpr):
    """The teacher's statistics of a row from the merged (n_rows, NCOL) statistics (tstats layout; NCOL: layouts.Stats'
    N_TEACHER columns, then a tail of the selected ids' logits and the student's top-k keys)."""
    at = stats + row * NCOL
    return (tl.load(at + STATS_AT.t_m2), tl.load(at + STATS_AT.t_d), tl.load(at + STATS_AT.t_sum),
            tl.load(at + STATS_AT.t_cross), tl.load(at + STATS_AT.s_m2), tl.load(at + STATS_AT.s_d),
            tl.load(at + STATS_AT.s_cross), tl.load(at + STATS_AT.t_arg).to(tl.int32))


@triton.jit
def merged_stats(stats, row, row_ptr, y_here, V, S, F: tl.constexpr, NCOL: tl.constexpr, world, n_rows):
    """(m2, d, sum_x2, sum_ex2, arg, x2_y, slope_y) of a row from the merged statistics, or with ``world`` > 0
    from the gathered (world, n_rows, STATS.N) shares, merged here (:func:`gathered_stats`). x2_y is NaN
    when no shard holds the target (out of range); slope_y (dx/dz at the target) is read here, and
    used by the gradient pass only where this shard holds the target. (A top-k 'rest' row's sum off
    the teacher's ids: :func:`merged_rest`.)"""
    if world > 0:
        m2, d, sum_x2, sum_ex2, arg, x2_y, owned = gathered_stats(stats, row, n_rows, world)
    else:
        at = stats + row * NCOL
        m2 = tl.load(at + STATS_AT.m2)
        d = tl.load(at + STATS_AT.d)
        sum_x2 = tl.load(at + STATS_AT.sum_x2)
        sum_ex2 = tl.load(at + STATS_AT.sum_ex2)
        arg = tl.load(at + STATS_AT.arg)
        x2_y = tl.load(at + STATS_AT.x2_y)
        owned = tl.load(at + STATS_AT.owned)
    x2_y = tl.where(owned > 0.5, x2_y, float("nan"))
    x2_unused, slope_y = target_logit(row_ptr, y_here, V, S, F.HAS_SOFTCAP)  # (masked: no read off this shard)
    return m2, d, sum_x2, sum_ex2, arg.to(tl.int32), x2_y, slope_y


@triton.jit
def gathered_stats(parts, row, n_rows, world):
    """A row's student statistics (m2, d, sum_x2, sum_ex2, arg, x2_y, owners) from every shard's
    (world, n_rows, STATS.N) share, merged as merge_stats_kernel merges them (:func:`_merge_student`): the
    head kernels of a call whose statistics are the student's alone take them gathered (one launch fewer)."""
    stride = tl.full([], STATS_AT.N, tl.int64) * n_rows
    top, d, sum_x2, sum_ex2, rest_unused, arg, x2_y, owners = _merge_student(
        parts + row * STATS_AT.N, stride, row < n_rows, world, tl.zeros([], tl.float32))
    return top, d, sum_x2, sum_ex2, arg, x2_y, owners


@triton.jit
def merged_rest(stats, row, NCOL: tl.constexpr):
    """A top-k 'rest' row's sum of 2^(x2 - m2) off the teacher's ids, merged over the shards: a sum of
    positive shares, so it keeps the digits 1 - sum p_k would lose."""
    return tl.load(stats + row * NCOL + STATS_AT.rest)



def launch_shard_stats(plan: KernelPlan, *, logits, targets, geo: Geometry, teacher=None,
                       sparse: SparseRows | None = None, temperature: torch.Tensor | None = None,
                       selected: torch.Tensor | None = None) -> torch.Tensor:
    """This shard's (n_rows, STATS.N or N_TEACHER) statistics (vocab-parallel phase 1), followed with a
    top-k teacher by its share of the K logits (:func:`~headloss.kernels.sparse.shard_topk`, BLOCK_K
    columns more, of which the merge takes the max), then with selected ids by their share of those logits
    (:func:`~headloss.kernels.sparse.shard_selected`, likewise)."""
    width = STATS.N_TEACHER if teacher is not None else STATS.N
    block_k = topk_block(sparse)
    block_s, block_t = block_if(plan.flags.SELECTED), block_if(plan.flags.STUDENT_TOPK)
    f32 = dict(dtype=torch.float32, device=logits.device)
    part = torch.empty(geo.n_rows, width, **f32)
    x2k = torch.empty(geo.n_rows, block_k, **f32) if block_k else None
    x2s = torch.empty(geo.n_rows, block_s, **f32) if block_s else None
    keys = torch.empty(geo.n_rows, 2 * block_t, **f32) if block_t else None
    if geo.n_rows:
        cfg = launch_config(geo.V, teacher is not None, geo.n_rows)
        nb = bound_blocks(geo.V, cfg.block_v) if block_t else 0
        buf = row_buffers(geo.n_rows, block_t, cfg.block_v, nb, logits.device)
        args = dict(logits=logits, targets=targets, teacher=teacher, part=part, sparse=sparse if block_k else None,
                    x2k=x2k, temperature=temperature, selected=selected if block_s else None, x2s=x2s, keys=keys,
                    buf=buf, geo=geo, S=plan.scalars, F=plan.flags, BLOCK_V=cfg.block_v, BLOCK_K=max(block_k, 1),
                    BLOCK_S=max(block_s, 1), BLOCK_T=block_t, BLOCK_NB=nb)
        sibling = None  # with the student's top-k: the registers of the same launch without it
        if block_t:
            sibling = functools.partial(dict, args, F=plan.flags._replace(STUDENT_TOPK=0), BLOCK_T=0, BLOCK_NB=0,
                                        keys=None, buf=None)
        launch(shard_stats_kernel, geo.n_rows, cfg.num_warps, registers_of=sibling, fit_spills=FIT_SPILLS, **args)
    tails = [t for t in (x2k, x2s, keys) if t is not None]
    return torch.cat((part, *tails), dim=1) if tails else part


def launch_shard_jsd(plan: KernelPlan, *, logits, targets, teacher, stats, geo: Geometry,
                     temperature: torch.Tensor | None = None) -> torch.Tensor:
    """This shard's (n_rows, JSD_SHARES.N) share of the mixture JSD (summed over the group by the caller)."""
    jsd = torch.empty(geo.n_rows, JSD_SHARES.N, dtype=torch.float32, device=logits.device)
    if geo.n_rows:
        cfg = launch_config(geo.V, True, geo.n_rows)
        launch(shard_jsd_kernel, geo.n_rows, cfg.num_warps, logits=logits, targets=targets, teacher=teacher,
               stats=stats, jsd=jsd, temperature=temperature, geo=geo, S=plan.scalars, F=plan.flags,
               BLOCK_V=cfg.block_v, NCOL=stats.shape[1])
    return jsd


def launch_merge(parts: torch.Tensor, own_temp: bool = False, tail: int = 0, keys: int = 0) -> torch.Tensor:
    """merge_stats_kernel over the (world, n_rows, N) gathered statistics (layouts.Stats): one launch.
    ``tail``: that many columns follow layouts.Stats' (a top-k teacher's K logits, the selected ids', then
    the student's top-k keys: launch_shard_stats); the logits merge by their max (each id's logit comes from
    the shard holding it, -inf from the others), the last ``keys`` int64 keys (2 fp32 columns each) by the
    top ``keys`` of every shard's."""
    if tail:
        head, width = parts.shape[-1] - tail, parts.shape[-1] - 2 * keys
        merged = [launch_merge(parts[..., :head].contiguous(), own_temp), parts[..., head:width].amax(0)]
        if keys:
            every = parts[..., width:].contiguous().view(torch.int64)  # (world, rows, keys)
            every = every.permute(1, 0, 2).reshape(parts.shape[1], -1)
            merged.append(every.topk(keys, dim=-1).values.contiguous().view(torch.float32))
        return torch.cat(merged, dim=1)
    world, n_rows, width = parts.shape
    merged = torch.empty(n_rows, width, dtype=torch.float32, device=parts.device)
    if n_rows:
        block = 256 if width == STATS.N else 128
        launch(merge_stats_kernel, triton.cdiv(n_rows, block), 4, parts=parts, merged=merged, n_rows=n_rows,
               world=world, BLOCK=block, NCOL=width, OWN_TEMP=own_temp)
    return merged
