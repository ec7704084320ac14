"""The distillation term from a sparse teacher: its top-k, or its log-prob at the target token.

A top-k teacher gives, per row, K ids (``-1``: no entry) and their log-probs lq_k. After the
stats pass the kernel loads the student's K logits x_k (K reads of the row) and, with lse from
the pass, computes every convention's value from the K pairs (x_k - lse, lq_k) alone. Its
gradient with respect to x has the form

    g_i = a * p_i + h_i * [i in K]

so ``a`` joins the row's A coefficient (the gradient pass's dense share) and the K sparse
entries are written after the pass, each over the value the pass stored there: no [N, V]
temporary, one rounding. ``spec.Distillation`` defines the conventions; with outcomes o (the K
ids, and for ``rest`` one more) and G_o = dD/dp_o of the divergence D:

    verl          D = max(sum_k q_k (lq_k - lps_k), 0)      a = sum q_k,   h_k = -q_k     (on D >= 0)
    renormalized  ps~, qt~ over the ids                     a = 0,         h_k = ps~_k (G_k - sum ps~ G)
    rest          tails p_r, q_r (TRL's clamp, below)       a = (1 - p_r) G_r - sum_k p_k G_k, h_k = p_k (G_k - G_r)

An entry whose id is -1 or whose teacher log-prob is -inf is no entry (TRL's ``valid`` mask): it is not read,
counts in neither mass and may repeat another entry's id. ``rest`` follows TRL's ``_add_tail_bucket``: each
side's log top-k mass is clamped at -1e-7 before ``log(-expm1(.))``, so a tail is at least REST_FLOOR and a
clamped tail is a constant (no gradient through it). The student's tail p_r is the exponential sum off the
ids (:func:`rest_sum`, from online_stats' sum without the max's elements), not 1 - sum p_k in fp32; the
teacher's is 1 - sum q_k in float64. The kernels store the whole gradient at the ids (``h`` below is a + h_k there,
written over the pass's value with the other terms' share), so a large G_r never cancels in fp32.

A per-token teacher gives lq at the target: the estimator f(logp, lq) is a function of log p(y),
whose gradient the row's D coefficient carries (terms.row_coefficients' ``d_logp``).
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..layouts import STATS_AT, TEACHER_KEYS, TEACHER_MARK, VERDICT_AT
from .launch import launch
from .primitives import LN2, LOG2E, NEG_BIG, transform
from .terms import kl_estimator, put

NO_BAD_ENTRY = tl.constexpr(TEACHER_MARK)
REST_FLOOR = tl.constexpr(-math.expm1(-1e-7))
"""The least tail of ``topk: rest``: TRL clamps the log top-k mass at -1e-7, so 1 - mass >= -expm1(-1e-7)."""
SORTS_LAST = tl.constexpr(2**63 - 1)  # (a sort key past every (id, entry) key: an entry with no id)
LIST_END = tl.constexpr(2**31 - 1)  # (a selected list's column past every column: an entry with no id)


class SparseRows(NamedTuple):
    """A sparse teacher's per-slot inputs: top-k ``ids`` [n_out, K] (int, -1 where no entry) and
    ``logprobs`` [n_out, K]; or, per target token, ``logprobs`` [n_out] with ``ids`` None and K 1.
    Both contiguous."""

    ids: torch.Tensor | None
    logprobs: torch.Tensor
    K: int
    # a top-k teacher given as probabilities: them, as given (``logprobs`` holds their log); the kernels
    # read nothing from it, a bad entry's error names teacher_probs (validation.CheckContext.teacher_input)
    probs: torch.Tensor | None = None


def block_of(k: int) -> int:
    """K entries rounded up to a power of two: the kernels' BLOCK_K."""
    return 1 << (max(k, 1) - 1).bit_length()


def block_if(n: int) -> int:
    """``n`` entries rounded up to a power of two, 0 for none (a variant's selected ids or student top-k)."""
    return block_of(n) if n else 0


def topk_block(sparse: SparseRows | None) -> int:
    """A top-k teacher's BLOCK_K; 0 without one."""
    return 0 if sparse is None or sparse.ids is None else block_of(sparse.K)


@triton.jit
def rest_sum(x2, mask, m2, off):
    """A row's sum of 2^(x2 - m2) off its top-k ids (``mask``: the ids of these columns) from the row's
    ``off`` statistics (blocks.online_stats: the sum without the max's elements, and their count): ids
    at the max take one of the count each, the others their term from the sum. No term near 1 is
    subtracted from another, so a tail far below fp32's resolution of the top-k mass keeps its digits."""
    d_off, count = off
    at_max = mask & (x2 == m2)
    e = tl.where(mask & (x2 != m2), tl.exp2(x2 - m2), 0.0)
    rest = (count - tl.sum(at_max.to(tl.float32), axis=0)) + (d_off - tl.sum(e, axis=0))
    return tl.maximum(rest, 0.0)


@triton.jit
def token_values(row_out, sparse, slot, logp, S, F: tl.constexpr, C: tl.constexpr):
    """The per-token teacher's estimator at the target: (weighted value, d value / d logp)."""
    lq = tl.load(sparse.logprobs + slot).to(tl.float32)
    kl, d_kl = kl_estimator(logp, lq, F.TOKEN_EST, F.TOKEN_CLAMP, F.TOKEN_K2_GRAD)
    put(row_out, C.divergence, kl)
    return S.w_distill * kl, d_kl


@triton.jit
def topk_inputs(sparse, slot, row_ptr, gathered, vocab_start, V, V_total, S, F: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """(ids, local ids, given, mine, x2, slope, lq) of a row's K teacher entries: ``given`` where an id
    is not -1 and its log-prob not -inf, the rest as :func:`logits_at` gives them; lq is 0 where not given."""
    k = tl.arange(0, BLOCK_K)
    inside = k < sparse.K
    at = slot * sparse.K + k
    ids = tl.load(sparse.ids + at, mask=inside, other=-1).to(tl.int64)
    has_id = inside & (ids != -1)
    lq = tl.load(sparse.logprobs + at, mask=has_id, other=0.0).to(tl.float32)
    given = has_id & (lq != float("-inf"))  # (a NaN log-prob stays an entry: its NaN reaches the row)
    lq = tl.where(given, lq, 0.0)
    local, valid, mine, x2, slope = logits_at(ids, given, inside, row_ptr, gathered, vocab_start, V, V_total, S, F)
    return ids, local, given, mine, x2, slope, lq


@triton.jit
def logits_at(ids, given, inside, row_ptr, gathered, vocab_start, V, V_total, S, F: tl.constexpr):
    """(local ids, valid, mine, x2, slope) of a row's logits at K ``ids`` (a top-k teacher's, the selected ids;
    ``given`` the entries that are ids, ``inside`` the K of the block): ``valid`` where a given id is in
    [0, V_total), ``mine`` where it is also in this row's columns [vocab_start, vocab_start + V) (its logit is
    read there: its slope, and x2 unless ``gathered``, a vocab-parallel row's K logits merged over the
    shards). An id outside [0, V_total) (validation off) gives NaN, never an out-of-bounds read."""
    valid = given & (ids >= 0) & (ids < V_total)
    local = ids - vocab_start
    mine = valid & (local >= 0) & (local < V)
    z = tl.load(row_ptr + local, mask=mine, other=0.0).to(tl.float32)
    x2, slope = transform(z, S, F.HAS_SOFTCAP)
    if gathered is not None:
        x2 = tl.load(gathered + tl.arange(0, ids.shape[0]), mask=inside, other=float("-inf"))
    x2 = tl.where(given & ~valid, float("nan"), x2)
    return local, valid, mine, x2, slope


@triton.jit
def gathered_row(stats, row, NCOL: tl.constexpr, SPARSE: tl.constexpr):
    """Where a vocab-parallel row's merged top-k logits start in the merged statistics (after the
    layouts.Stats columns); None when not vocab-parallel or without a top-k teacher."""
    start = None
    if stats is not None:
        if SPARSE == 1:
            start = stats + row * NCOL + STATS_AT.N
    return start


@triton.jit
def shard_topk(x2k, sparse, slot, row, row_ptr, counted, geo, S, F: tl.constexpr, BLOCK_K: tl.constexpr):
    """A vocab-parallel shard's share of its rows' top-k logits: x2 at the ids in its columns, -inf at
    the others (the merge takes the max over the shards), stored in ``x2k`` [n_rows, BLOCK_K] and
    returned for the shard's rest sum (:func:`rest_sum` over the ids it holds)."""
    k = tl.arange(0, BLOCK_K)
    x2 = tl.full([BLOCK_K], float("-inf"), tl.float32)
    if counted:
        ids, local, given, mine, x2_mine, slope, lq = topk_inputs(sparse, slot, row_ptr, None, geo.vocab_start,
                                                                  geo.V, geo.V_total, S, F, BLOCK_K)
        x2 = tl.where(mine, x2_mine, float("-inf"))
    tl.store(x2k + row * BLOCK_K + k, x2)
    return x2


@triton.jit
def _outcome(ls, lt, given, S, F: tl.constexpr):
    """(D_o, G_o, p_o G_o) of the divergence's outcomes (0 log 0 = 0; vectors or scalars) with student
    log-prob ls and teacher lt, G_o = dD/dp_o: forward KL -q/p, reverse KL log(p / q) + 1, or the mixture
    JSD's (1 - beta) log(p / M)."""
    p = tl.where(given, tl.exp(ls), 0.0)
    q = tl.where(given, tl.exp(lt), 0.0)
    if F.TOPK_DIV == 0:
        d = tl.where(q > 0.0, q * (lt - ls), 0.0)
        G = tl.where(q > 0.0, -q / p, 0.0)
        h = -q
    elif F.TOPK_DIV == 1:
        gap = tl.where(p > 0.0, ls - lt, 0.0)
        d = p * gap
        G = tl.where(p > 0.0, gap + 1.0, 0.0)
        h = d + p
    else:
        a = ls + tl.log(1.0 - S.jsd_beta)
        b = lt + tl.log(S.jsd_beta)
        top = tl.maximum(a, b)
        top = tl.where(top == float("-inf"), 0.0, top)
        log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
        d = S.jsd_beta * tl.where(q > 0.0, q * (lt - log_m), 0.0) + \
            (1.0 - S.jsd_beta) * tl.where(p > 0.0, p * (ls - log_m), 0.0)
        G = tl.where(p > 0.0, (1.0 - S.jsd_beta) * (ls - log_m), 0.0)
        h = p * G
    return d, G, h


@triton.jit
def topk_math(x2, lq, ids, given, lse2, p_rest, arg, S, F: tl.constexpr, BLOCK_K: tl.constexpr):
    """(D, student mass, teacher mass, top-1 agreement, a, h) of a row's top-k teacher (module
    docstring); ``arg`` the student's argmax, ``p_rest`` its probability off the ids (``rest`` only:
    :func:`rest_sum` / d). The gradient is a p_i everywhere but at the ids, h_k there (a p_k included)."""
    lps = (x2 - lse2) * LN2
    ps = tl.where(given, tl.exp(lps), 0.0)
    qs = tl.where(given, tl.exp(lq), 0.0)
    mass_s = tl.sum(ps, axis=0)
    mass_t = tl.sum(qs, axis=0)
    lq_given = tl.where(given, lq, float("-inf"))
    top = tl.argmax(lq_given, axis=0)
    k = tl.arange(0, BLOCK_K)
    top_id = tl.sum(tl.where(k == top, ids, 0), axis=0)
    agree = ((tl.max(given.to(tl.int32), axis=0) > 0) & (top_id == arg)).to(tl.float32)
    if F.TOPK_FORM == 0:  # verl: sum q (lq - lps) over the entries as they are, clamped at 0
        keep = given
        lps_c = lps
        lq_c = lq
        if F.TOPK_CLAMP:
            keep = given & (lps >= S.topk_min_logprob)
            lps_c = tl.maximum(lps, S.topk_min_logprob)
            lq_c = tl.maximum(lq, S.topk_min_logprob)
        qc = tl.where(given, tl.exp(lq_c), 0.0)
        D = tl.sum(tl.where(qc > 0.0, qc * (lq_c - lps_c), 0.0), axis=0)
        on = (D >= 0.0).to(tl.float32)  # clamp_min's gradient: where D >= 0
        D = tl.where(D < 0.0, 0.0, D)  # (NaN stays NaN)
        h = -on * tl.where(keep, qc, 0.0)
        a = -tl.sum(h, axis=0)
        h = h + a * ps
    elif F.TOPK_FORM == 1:  # both sides renormalised over the ids
        xk = x2 * LN2
        top_x = tl.max(tl.where(given, xk, float("-inf")), axis=0)
        top_x = tl.where(top_x == float("-inf"), 0.0, top_x)
        lse_k = top_x + tl.log(tl.sum(tl.where(given, tl.exp(xk - top_x), 0.0), axis=0))
        top_q = tl.max(lq_given, axis=0)
        top_q = tl.where(top_q == float("-inf"), 0.0, top_q)
        lse_q = top_q + tl.log(tl.sum(tl.where(given, tl.exp(lq - top_q), 0.0), axis=0))
        ls = xk - lse_k
        d, G, hp = _outcome(ls, lq - lse_q, given, S, F)
        p_tilde = tl.where(given, tl.exp(ls), 0.0)
        D = tl.sum(d, axis=0)
        h = hp - p_tilde * tl.sum(hp, axis=0)
        a = tl.zeros([], tl.float32)
    else:  # the ids plus the rest of the vocabulary: TRL's tail bucket, each side's tail at least REST_FLOOR
        mass_t64 = tl.sum(tl.where(given, tl.exp(lq.to(tl.float64)), 0.0), axis=0)
        q_rest = (1.0 - mass_t64).to(tl.float32)
        d, G, hp = _outcome(lps, lq, given, S, F)
        d_r, G_r, h_r = _outcome(tl.log(tl.maximum(p_rest, REST_FLOOR)), tl.log(tl.maximum(q_rest, REST_FLOOR)),
                                 True, S, F)
        free = p_rest > REST_FLOOR  # a clamped tail is a constant: nothing flows through it
        G_r = tl.where(free, G_r, 0.0)
        h_r = tl.where(free, h_r, 0.0)
        sum_hp = tl.sum(hp, axis=0)
        D = tl.sum(d, axis=0) + d_r
        # dD/dx_i = p_i ((1 - p_r) G_r - sum_k p_k G_k) + [i in K] p_i (G_i - G_r); at the ids that is
        # p_k G_k - p_k (p_r G_r + sum p G), with no large G_r to cancel
        a = G_r - h_r - sum_hp
        h = hp - ps * (h_r + sum_hp)
    return D, mass_s, mass_t, agree, a, tl.where(given, h, 0.0)


@triton.jit
def topk_values(row_out, x2, lq, ids, given, lse2, p_rest, arg, S, F: tl.constexpr, C: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """A row's top-k values stored in their columns: (weighted D, a, h) for the gradient."""
    D, mass_s, mass_t, agree, a, h = topk_math(x2, lq, ids, given, lse2, p_rest, arg, S, F, BLOCK_K)
    put(row_out, C.rest_mass, p_rest)
    put(row_out, C.divergence, D)
    put(row_out, C.student_mass, mass_s)
    put(row_out, C.teacher_mass, mass_t)
    put(row_out, C.agreement, agree)
    return S.w_distill * D, a, h


@triton.jit
def topk_scatter(grad_row_ptr, ids, in_range, x2, slope, lse, A, B, C, D, y, h, S, F: tl.constexpr):
    """Rewrite the gradient at the teacher's ids whole, after the gradient pass stored its dense share
    there (the caller's barrier orders the two): p (A + B x) + C + D [id = y] + h, times dx/dz, with
    ``A`` the other terms' share (without the teacher's a) and ``h`` the teacher's whole share there."""
    p = tl.exp2(x2 - lse * LOG2E)
    g = p * (A + B * LN2 * tl.maximum(x2, NEG_BIG)) + h
    if F.HAS_SMOOTHING:
        g += C
    g += tl.where(ids == y, D, 0.0)
    g = g * slope  # (without softcap, transform's constant dx/dz)
    tl.store(grad_row_ptr + ids, g.to(grad_row_ptr.dtype.element_ty), mask=in_range)


# --- the selected ids (outputs: selected_logprobs) -------------------------------------------------------
#
# K ids per row (-1: none; an id may repeat). Their log-probs are x_k - lse from the K logits the kernel loads
# after its stats pass (a vocab-parallel row's K logits come merged with its statistics, as a top-k teacher's).
# The gradient of sum_k g_k log p(id_k) is g_i = [i in ids] h_i - G p_i with G = sum g_k and h_i the sum of the
# g_k of the entries holding id i: -G joins the row's A coefficient. Each id's h joins the gradient pass: the
# backward sorts the row's entries by id into a short list (selected_grads) and the pass walks it beside its
# blocks (selected_add), adding h to a column before the block's one store -- no second write of the row's
# columns and no read of them back (64 such read-modify-writes a row after the pass cost the deferred call 3%).
# The columns rewritten whole after the pass take their h along: the target's through D, a top-k teacher's ids
# through their h (selected_share).


@triton.jit
def selected_inputs(ids_ptr, slot, row_ptr, gathered, vocab_start, V, V_total, S, F: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """(ids, local ids, given, valid, mine, x2, slope) of a row's F.SELECTED selected ids: ``given`` where an id
    is not -1, the rest as :func:`logits_at` gives them."""
    k = tl.arange(0, BLOCK_S)
    inside = k < F.SELECTED
    ids = tl.load(ids_ptr + slot * F.SELECTED + k, mask=inside, other=-1)
    given = inside & (ids != -1)
    local, valid, mine, x2, slope = logits_at(ids, given, inside, row_ptr, gathered, vocab_start, V, V_total, S, F)
    return ids, local, given, valid, mine, x2, slope


@triton.jit
def selected_values(row_out, x2, given, lse2, C: tl.constexpr, F: tl.constexpr, BLOCK_S: tl.constexpr):
    """Store a row's selected log-probs (x2 - lse2) ln 2 in its ``selected`` columns, 0 where no id."""
    k = tl.arange(0, BLOCK_S)
    tl.store(row_out + C.selected + k, tl.where(given, (x2 - lse2) * LN2, 0.0), mask=k < F.SELECTED)


@triton.jit
def zero_selected(row_out, C: tl.constexpr, F: tl.constexpr, BLOCK_S: tl.constexpr):
    """Zero a row's ``selected`` columns (a row that is not scored)."""
    k = tl.arange(0, BLOCK_S)
    tl.store(row_out + C.selected + k, tl.zeros([BLOCK_S], tl.float32), mask=k < F.SELECTED)


@triton.jit
def _same_id_sum(a_id, a_g, b_id, b_g):
    """A scan's step over entries sorted by id: b's running sum of the g of the entries at its id."""
    return b_id, b_g + tl.where(a_id == b_id, a_g, 0.0)


@triton.jit
def selected_grads(d_in, ids_row, y, vocab_start, V_total, work, C: tl.constexpr, F: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """(G, h_y, n) of a row's upstream gradients g_k of its selected log-probs (``d_in``: the row's d rows;
    ``ids_row``: its ids; ``y``: the target's local column): their sum G (the dense share is -G p_i), the h of
    the target's column (0 where no entry holds it) and the number n of entries holding an id in
    [0, V_total) (an entry at another id takes no gradient, as the plain-torch path's NaN). The row's list
    goes to ``work`` (int32 pairs, BLOCK_S of them: a local column, ascending, and the fp32 bits of its h),
    its n entries first: the entries sorted by (id, entry), so an id's entries are adjacent, and a scan sums
    each run of equal ids onto its last entry (the others hold 0). No loop over the K, no [K, K] block."""
    k = tl.arange(0, BLOCK_S)
    inside = k < F.SELECTED
    ids = tl.load(ids_row + k, mask=inside, other=-1).to(tl.int64)
    valid = inside & (ids >= 0) & (ids < V_total)
    g = tl.load(d_in + C.selected + k, mask=valid, other=0.0)
    key = tl.sort(tl.where(valid, ids * BLOCK_S + k, SORTS_LAST))
    held = key != SORTS_LAST
    sid = tl.where(held, key // BLOCK_S, -1)
    unused, h = tl.associative_scan((sid, tl.where(held, tl.gather(g, (key % BLOCK_S).to(tl.int32), 0), 0.0)), 0,
                                    _same_id_sum)
    after = tl.gather(sid, tl.minimum(k + 1, BLOCK_S - 1), 0)
    h = tl.where(held & ((k == BLOCK_S - 1) | (after != sid)), h, 0.0)
    local = tl.where(held, sid - vocab_start, LIST_END).to(tl.int32)
    tl.store(work + 2 * k, local)
    tl.store(work + 2 * k + 1, h.to(tl.int32, bitcast=True))
    h_y = tl.sum(tl.where((local == y) & (local >= 0), h, 0.0), axis=0)
    return tl.sum(g, axis=0), h_y, tl.sum(held.to(tl.int32), axis=0)


@triton.jit
def _list_entry(work, at, n):
    """(local column, h) of a row's list entry ``at``: past its n entries LIST_END, before the first -1 (either
    ends a walk)."""
    inside = (at >= 0) & (at < n)
    local = tl.load(work + 2 * at, mask=inside, other=0)
    h = tl.load(work + 2 * at + 1, mask=inside, other=0).to(tl.float32, bitcast=True)
    return tl.where(inside, local, tl.where(at < 0, -1, LIST_END)), h


@triton.jit
def selected_first(sel, DESCENDING: tl.constexpr):
    """A walk's state (entry, its local column, its h) at the start of the gradient pass over the row: the
    list's last entry holding an id when the pass walks the row last block first, else its first."""
    work, n = sel
    at = tl.zeros([], tl.int32)
    if DESCENDING:
        at = n - 1
    local, h = _list_entry(work, at, n)
    return at, local, h


@triton.jit
def selected_add(g, cols, start, sel, walk, scale, BLOCK_V: tl.constexpr, DESCENDING: tl.constexpr):
    """(g, walk) with the h of the list's entries in the block [start, start + BLOCK_V) added at their columns
    (times ``scale``: the transform's dx/dz where the pass folds it into g) and the walk past them. An entry
    at another shard's column matches no column: those on the side the walk starts from are passed by its
    first block, those on the far side never reached."""
    work, n = sel
    at, local, h = walk
    if DESCENDING:
        while local >= start:
            g = tl.where(cols == local, g + h * scale, g)
            at -= 1
            local, h = _list_entry(work, at, n)
    else:
        while local < start + BLOCK_V:
            g = tl.where(cols == local, g + h * scale, g)
            at += 1
            local, h = _list_entry(work, at, n)
    return g, (at, local, h)


@triton.jit
def selected_share(sel, cols, BLOCK_S: tl.constexpr):
    """Each of ``cols``' h in the row's list (0 where no entry holds it): the last entry at or below it, by a
    binary search (for the columns rewritten whole after the pass: a top-k teacher's ids)."""
    work, n = sel
    below = tl.zeros(cols.shape, tl.int32)  # entries known <= the column
    for level in tl.static_range(_log2(BLOCK_S)):
        step = BLOCK_S >> (level + 1)
        probe, unused = _list_entry(work, below + step - 1, n)
        below = tl.where(probe <= cols, below + step, below)
    probe, unused = _list_entry(work, below, n)  # (below <= BLOCK_S - 1 here: the last entry's test)
    below = tl.where(probe <= cols, below + 1, below)
    local, h = _list_entry(work, below - 1, n)
    return tl.where((below > 0) & (local == cols), h, 0.0)


@triton.constexpr_function
def _log2(n):
    """log2 of a power of two."""
    return n.bit_length() - 1


@triton.jit
def shard_selected(x2s, ids_ptr, slot, row, row_ptr, counted, geo, S, F: tl.constexpr, BLOCK_S: tl.constexpr):
    """A vocab-parallel shard's share of its rows' selected logits: x2 at the ids in its columns, -inf at the
    others (the merge takes the max over the shards), stored in ``x2s`` [n_rows, BLOCK_S]."""
    k = tl.arange(0, BLOCK_S)
    x2 = tl.full([BLOCK_S], float("-inf"), tl.float32)
    if counted:
        ids, local, given, valid, mine, x2_mine, slope = selected_inputs(
            ids_ptr, slot, row_ptr, None, geo.vocab_start, geo.V, geo.V_total, S, F, BLOCK_S)
        x2 = tl.where(mine, x2_mine, float("-inf"))
    tl.store(x2s + row * BLOCK_S + k, x2)


@triton.jit
def check_selected_kernel(
    ids,  # (n_rows, K) int64 selected ids
    n,  # entries
    V,
    verdict,  # (VERDICT.N,) int64 slot (host memory), written only when an entry is bad
    dirty,  # (1,) int64 host word set with it
    BLOCK: tl.constexpr,
):
    """The selected ids on the device (validation): each -1 or in [0, V). The first bad entry's flat index
    reaches the verdict slot (Verdict.selected) as TEACHER_MARK - index by a maximum, then the slot's flag
    and the dirty word are set; nothing is written when all is well."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    id_ = tl.load(ids + i, mask=inside, other=-1)
    bad = inside & (id_ != -1) & ((id_ < 0) | (id_ >= V))
    first = tl.min(tl.where(bad, i, NO_BAD_ENTRY), axis=0)
    if first < NO_BAD_ENTRY:
        tl.atomic_max(verdict + VERDICT_AT.selected, NO_BAD_ENTRY - first, sem="relaxed", scope="sys")
        tl.atomic_xchg(verdict + VERDICT_AT.flag, 1, sem="release", scope="sys")
        tl.atomic_xchg(dirty, 1, sem="release", scope="sys")


def launch_check_selected(ids: torch.Tensor, vocab: int, verdict: tuple) -> None:
    """check_selected_kernel over a call's selected ids ([n_out, K] int64) into its verdict slot (slot, dirty)."""
    n = ids.numel()
    if n:
        slot, dirty = verdict
        launch(check_selected_kernel, triton.cdiv(n, CHECK_ENTRIES), 4, ids=ids, n=n, V=vocab, verdict=slot,
               dirty=dirty, BLOCK=CHECK_ENTRIES)


@triton.jit
def check_teacher_kernel(
    ids,  # (n_rows, K) int top-k ids, or None: a per-token teacher
    logprobs,  # (n_rows, K) float, (n_rows,) for a per-token teacher
    n_rows,
    K,  # entries per row (1 for a per-token teacher)
    V,
    verdict,  # (VERDICT.N,) int64 slot (host memory), written only when an entry is bad
    dirty,  # (1,) int64 host word set with it
    ROWS: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # K rounded up to a power of two
):
    """The sparse teacher's values, on the device (validation): ids in [0, V) or -1, log-probs <= 0
    and not NaN where an id is given (every entry of a per-token teacher), and no id twice among a
    row's entries (an entry with id -1 or log-prob -inf is no entry). Each row's entries are sorted by
    (id, position), so an entry that repeats an id follows its first one. The first bad entry's key
    (layouts.TeacherKeys: 3 x its flat index + the kind) reaches the verdict slot as
    TEACHER_MARK - key by a maximum, then the slot's flag and the dirty word are set; nothing is
    written when all is well."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    inside = (r < n_rows) & (k < K)
    i = r * K + k
    lq = tl.load(logprobs + i, mask=inside, other=0.0).to(tl.float32)
    none = NO_BAD_ENTRY
    if ids is None:
        key = tl.where(inside & ~(lq <= 0.0), TEACHER_KEYS.N * i + TEACHER_KEYS.logprob, none)
    else:
        id_ = tl.load(ids + i, mask=inside, other=-1).to(tl.int64)
        has_id = inside & (id_ != -1)
        bad_id = has_id & ((id_ < 0) | (id_ >= V))
        key = tl.where(bad_id, TEACHER_KEYS.N * i + TEACHER_KEYS.id,
                       tl.where(has_id & ~(lq <= 0.0), TEACHER_KEYS.N * i + TEACHER_KEYS.logprob, none))
        if BLOCK_K > 1:  # duplicates: an entry sorts as id * BLOCK_K + position, a non-entry as an id past V
            entry = has_id & ~bad_id & (lq != float("-inf"))
            order = tl.sort(tl.where(entry, id_, V + 1 + k) * BLOCK_K + k, dim=1)
            following = tl.gather(order, tl.minimum(k + 1, BLOCK_K - 1) + tl.zeros([ROWS, BLOCK_K], tl.int32), 1)
            repeats = (k < BLOCK_K - 1) & (following // BLOCK_K == order // BLOCK_K)
            at = r * K + following % BLOCK_K  # the entry that repeats the id
            key = tl.minimum(key, tl.where(repeats, TEACHER_KEYS.N * at + TEACHER_KEYS.repeat, none))
    first = tl.min(tl.min(key, axis=1), axis=0)
    if first < none:
        tl.atomic_max(verdict + VERDICT_AT.teacher, none - first, sem="relaxed", scope="sys")
        tl.atomic_xchg(verdict + VERDICT_AT.flag, 1, sem="release", scope="sys")
        tl.atomic_xchg(dirty, 1, sem="release", scope="sys")


CHECK_ENTRIES = 2048
"""Entries per program of check_teacher_kernel (a power of two: whole rows of a top-k teacher)."""


def launch_check_teacher(sparse: SparseRows, vocab: int, verdict: tuple) -> None:
    """check_teacher_kernel over a sparse teacher's entries into a call's verdict slot (slot, dirty)."""
    entries = sparse.logprobs.numel()
    if entries:
        slot, dirty = verdict
        block_k = topk_block(sparse) if sparse.ids is not None else 1
        n_rows = entries // sparse.K
        rows = max(CHECK_ENTRIES // block_k, 1)
        launch(check_teacher_kernel, triton.cdiv(n_rows, rows), 4, ids=sparse.ids, logprobs=sparse.logprobs,
               n_rows=n_rows, K=sparse.K, V=vocab, verdict=slot, dirty=dirty, ROWS=rows, BLOCK_K=block_k)
