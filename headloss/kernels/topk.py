"""The student's top-k (``student_topk``), streamed through the stats pass: no second read of the logits
(but at the rare row below).

Each element of a row is ranked by one int64 key, its transformed logit's fp32 bits made order-preserving as
signed int32 in the high word and 0xFFFFFFFF - its id in the low word: a larger key is a larger logit, or the
same logit at a lower id (torch.topk's order on ties, which torch does not promise but gives on a stable sort).

The pass keeps, per lane of the block (each of BLOCK_V positions, walked down the row one block at a time),
its largest logit and that logit's id -- for k above LANE_TOP1_K its two largest -- and the largest value
below them (:func:`lanes_block`: two comparisons and a few selects per logit, no reduction). With 16-bit
logits at k <= LANE_TOP1_K a lane keeps one int32 instead (:func:`key16`: the raw logit's bits in order and
the block's index), and the largest value dropped is kept per 8 lanes of a thread: 18 registers of state,
not 48 (the raw order is the transformed order but for ties the transform makes, which the merge checks). A block is
skipped after one comparison where its largest logit is below the least of the k largest block maxima so far
(k elements are at least that, so nothing below it is in the top k). At the row's end the lanes' keys are
merged to the row's top k (:func:`lanes_finish`: k rounds of the largest key, or ``tl.topk``); that is the
row's top k unless some lane held more of it than it kept, which its next value shows (a next value at or
above the k-th, as also when the k-th is -inf or the row holds NaN): that row is read again with the
running insertion (:func:`topk_block`; about 1.5% of rows in random order at k 8, 1.2% at k 64). Measured
against the alternatives: docs/performance.md ("What the student's top-k costs").

With a top-k teacher the row also gets verl's overlap diagnostics (verl/trainer/distillation/fsdp/losses.py):
how many of the teacher's ids are among the student's top-k, and the mean over them of
-q_k (log q_k - log p_k) (verl's token KL of the entry, its ``log_prob_min_clamp`` applied), 0 where none is.
"""

import triton
import triton.language as tl

from .launch import LAUNCH_OVERRIDES, LaunchConfig
from .primitives import LN2, transform

LANE_TOP1 = 8
"""The largest k whose lanes keep only their largest logit: with 2048 lanes about k^2 / 4096 of the rows (in
random order) hold two of their top k in one lane and are read again, 1.5% at k 8; above it each lane keeps
two (three in one lane: about k^3 / (6 * 2048^2), 1% at k 64), and its launches take twice the warps (the
lanes' state per thread halved: :func:`lanes_warps`)."""
LANE_TOP1_K = tl.constexpr(LANE_TOP1)


def check_lanes(vocab: int, block_v: int, k: int, dtype) -> None:
    """16-bit logits' lanes (k <= LANE_TOP1) hold a block's index in 16 bits: at most 65536 blocks a row."""
    if 0 < k <= LANE_TOP1 and dtype.itemsize == 2 and -(-vocab // block_v) > 1 << 16:
        raise ValueError(f"logits: student_topk {k} on 16-bit logits takes at most {(1 << 16) * block_v} columns "
                         f"a row ({1 << 16} blocks of {block_v}); got {vocab}. Pass fp32 logits.")


def lanes_warps(cfg: LaunchConfig, k: int, vocab: int, dtype) -> int:
    """A stats pass's warps with the student's top-k (k; 0: none) over rows of ``vocab`` ``dtype`` logits,
    checked by :func:`check_lanes`: twice the config's (at most 16) where the lanes keep two logits each
    (k > LANE_TOP1), unless the warps are forced (LAUNCH_OVERRIDES)."""
    check_lanes(vocab, cfg.block_v, k, dtype)
    forced = LAUNCH_OVERRIDES["num_warps"] is not None
    return min(2 * cfg.num_warps, 16) if k > LANE_TOP1 and not forced else cfg.num_warps


KEY_MIN = tl.constexpr(-(2**63))
KEY16_MIN = tl.constexpr(-(2**31))
REST_GROUP = tl.constexpr(8)
KEY_MAX = tl.constexpr(2**63 - 1)
LOW_WORD = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _high(x2):
    """fp32 values -> int32 words in the same order (any NaN above +inf and -0 as 0, as torch orders them)."""
    x2 = tl.where(x2 == 0.0, 0.0, x2)
    bits = tl.where(x2 != x2, float("nan"), x2).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def topk_start(K: tl.constexpr, BLOCK_T: tl.constexpr):
    """The empty running top-k: (keys, threshold)."""
    t = tl.arange(0, BLOCK_T)
    keys = tl.where(t < K, tl.full([BLOCK_T], KEY_MIN, tl.int64), tl.full([BLOCK_T], KEY_MAX, tl.int64))
    return keys, tl.full([], KEY_MIN, tl.int64)


@triton.jit
def topk_block(x2, cols, V, top, first, BLOCK_T: tl.constexpr):
    """One block of x2 (its columns ``cols`` of the row, whose ids start at ``first``: a vocab-parallel shard's
    vocab_start; columns >= V are padding) into the running top-k ``top``."""
    keys, thr = top
    block_max = tl.max(x2, axis=0)
    if _high(block_max).to(tl.int64) >= (thr >> 32):
        t = tl.arange(0, BLOCK_T)
        key = key_of(x2, cols.to(tl.int64) + first)
        key = tl.where(cols < V, key, KEY_MIN)
        best = tl.max(tl.where(key > thr, key, KEY_MIN), axis=0)
        while best > thr:  # the block's keys above the threshold, largest first
            at = tl.min(tl.where(keys == thr, t, BLOCK_T), axis=0)
            keys = tl.where(t == at, best, keys)
            thr = tl.min(keys, axis=0)
            key = tl.where(key == best, KEY_MIN, key)
            best = tl.max(tl.where(key > thr, key, KEY_MIN), axis=0)
    return keys, thr


@triton.jit
def key_of(x2, ids):
    """The int64 keys of fp32 values ``x2`` at ids ``ids``."""
    return (_high(x2).to(tl.int64) << 32) | (LOW_WORD - ids.to(tl.int64))


@triton.jit
def value_of(keys):
    """The fp32 values of int64 keys."""
    high = (keys >> 32).to(tl.int32)
    return tl.where(high < 0, high ^ 0x7FFFFFFF, high).to(tl.float32, bitcast=True)


@triton.jit
def lanes_start(K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PACKED: tl.constexpr):
    """The empty lanes: (largest, its column, second, its column, the next value below them, the K largest
    block maxima so far, their least). At k <= LANE_TOP1_K ``second`` is the next value and the others are
    placeholders; ``PACKED`` (16-bit logits at k <= LANE_TOP1_K): the largest's :func:`key16` and the next
    value's, in the places of the largest and the second (the columns are the keys' low halves)."""
    neg = tl.full([BLOCK_V], float("-inf"), tl.float32)
    col = tl.zeros([BLOCK_V], tl.int32)
    t = tl.arange(0, BLOCK_T)
    maxima = tl.where(t < K, tl.full([BLOCK_T], float("-inf"), tl.float32),
                      tl.full([BLOCK_T], float("inf"), tl.float32))  # (past K never replaced)
    bound = tl.full([], float("-inf"), tl.float32)
    i2 = tl.zeros([1], tl.int32)
    m3 = tl.zeros([1], tl.float32)
    if PACKED:
        lanes = (tl.full([BLOCK_V], KEY16_MIN, tl.int32), i2, tl.full([BLOCK_V // REST_GROUP], KEY16_MIN, tl.int32),
                 i2, m3, maxima, bound)
    else:
        if K > LANE_TOP1_K:
            i2 = col
            m3 = neg
        lanes = (neg, col, neg, i2, m3, maxima, bound)
    return lanes


@triton.jit
def key16(z, low):
    """int32 keys of 16-bit floats ``z`` (their bits, as loaded) in their order, ``low`` (< 2^16) in the low
    half: a larger key is a larger value (-0 below +0, a NaN above +inf), or the same value at a larger
    ``low``."""
    s = z.to(tl.int16, bitcast=True).to(tl.int32)
    return (s ^ ((s >> 15) & 0x7FFF)) * 65536 + low


@triton.jit
def raw16(key, dtype: tl.constexpr):
    """The 16-bit float of ``dtype`` whose :func:`key16` is ``key``."""
    o = key >> 16
    return (o ^ ((o >> 15) & 0x7FFF)).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def lanes_block(x2, z, start, V, lanes, K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
                PACKED: tl.constexpr, MASKED: tl.constexpr):
    """One block into the lanes: x2 (transformed; padding -inf) of the raw block z at columns start.. of the
    row. Strict comparisons keep a lane's earlier (lower) column on ties; packed keys rank the raw values
    and hold 0xFFFF - the block's index below them (the lower block wins a tie)."""
    m1, i1, m2, i2, m3, maxima, bound = lanes
    block_max = tl.max(x2, axis=0)
    if (block_max >= bound) | (block_max != block_max):  # (a NaN row is read again at the end)
        if PACKED:
            key = key16(z, 0xFFFF - start // BLOCK_V)
            if MASKED:
                key = tl.where(start + tl.arange(0, BLOCK_V) < V, key, KEY16_MIN)
            m2 = tl.maximum(m2, tl.max(tl.reshape(tl.minimum(m1, key), [BLOCK_V // REST_GROUP, REST_GROUP]), axis=1))
            m1 = tl.maximum(m1, key)
        else:
            cols = start + tl.arange(0, BLOCK_V)
            gt1 = x2 > m1
            gt2 = x2 > m2
            if K > LANE_TOP1_K:
                m3 = tl.where(gt2, m2, tl.maximum(m3, x2))
                i2 = tl.where(gt1, i1, tl.where(gt2, cols, i2))
            m2 = tl.where(gt1, m1, tl.where(gt2, x2, m2))
            m1 = tl.where(gt1, x2, m1)
            i1 = tl.where(gt1, cols, i1)
        least = tl.min(maxima, axis=0)
        if block_max > least:  # into the K largest block maxima
            t = tl.arange(0, BLOCK_T)
            at = tl.min(tl.where(maxima == least, t, BLOCK_T), axis=0)
            maxima = tl.where(t == at, block_max, maxima)
            bound = tl.min(maxima, axis=0)
    return m1, i1, m2, i2, m3, maxima, bound


@triton.jit
def _unpacked(key, lane, first, S, dtype: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
    """The int64 keys (:func:`key_of`) of packed keys held at lanes ``lane`` (KEY_MIN where none is held)."""
    x2, _ = transform(raw16(key, dtype).to(tl.float32), S, HAS_SOFTCAP)
    ids = (0xFFFF - (key & 0xFFFF)) * BLOCK_V + lane + first
    return tl.where(key == KEY16_MIN, KEY_MIN, key_of(x2, ids))


@triton.jit
def _lanes_packed(m1, m2, first, S, dtype: tl.constexpr, HAS_SOFTCAP: tl.constexpr, K: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """(keys, rest, after) of packed lanes: the int64 keys of the K largest lanes by raw value (a tie to the
    lower lane), the value of the largest key16 they dropped (-inf: none) and the int64 key of the next
    lane in that order: it ranks above the k-th only where the transform made two raw values one."""
    t = tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_V)
    picked = tl.full([BLOCK_T], KEY16_MIN, tl.int32)
    at = tl.zeros([BLOCK_T], tl.int32)
    for j in tl.static_range(K + 1):  # the largest key16, taken out (one lane), K + 1 times
        best = tl.max(m1, axis=0)
        where = tl.min(tl.where(m1 == best, lane, BLOCK_V), axis=0)
        m1 = tl.where(lane == where, KEY16_MIN, m1)
        if j < K:
            picked = tl.where(t == j, best, picked)
            at = tl.where(t == j, where, at)
        else:
            after = _unpacked(best, where, first, S, dtype, HAS_SOFTCAP, BLOCK_V)
    keys = tl.where(t < K, _unpacked(picked, at, first, S, dtype, HAS_SOFTCAP, BLOCK_V), KEY_MAX)
    rest_key = tl.max(m2, axis=0)
    rest, _ = transform(raw16(rest_key, dtype).to(tl.float32), S, HAS_SOFTCAP)
    return keys, tl.where(rest_key == KEY16_MIN, float("-inf"), rest), after


@triton.jit
def lanes_finish(lanes, first, clean, S, dtype: tl.constexpr, HAS_SOFTCAP: tl.constexpr, K: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, PACKED: tl.constexpr):
    """The lanes merged: (the running top-k as :func:`topk_block` keeps it, exact), where exact is False
    when some lane may have held more of the top k than it kept (its next value at or above the k-th), the
    k-th is -inf (a lane's column is then not its logit's), or the row is not ``clean`` (a NaN or +inf,
    which the lanes' comparisons do not rank): then the row must be read again. Ids from ``first`` on.
    Packed lanes are merged by their raw values: also read again where the next lane in that order ranks
    above the k-th by the transformed value and id (a tie the transform made of two raw values)."""
    m1, i1, m2, i2, m3, maxima, bound = lanes
    t = tl.arange(0, BLOCK_T)
    after = KEY_MIN
    if K <= LANE_TOP1_K:
        if PACKED:
            keys, rest, after = _lanes_packed(m1, m2, first, S, dtype, HAS_SOFTCAP, K, BLOCK_V, BLOCK_T)
        else:
            cand = key_of(m1, i1 + first)
            rest = tl.max(m2, axis=0)
            keys = tl.full([BLOCK_T], KEY_MAX, tl.int64)
            for j in tl.static_range(K):  # the largest key, taken out, K times
                best = tl.max(cand, axis=0)
                keys = tl.where(t == j, best, keys)
                cand = tl.where(cand == best, KEY_MIN, cand)
    else:
        cand = tl.reshape(tl.join(key_of(m1, i1 + first), key_of(m2, i2 + first)), [2 * BLOCK_V])
        rest = tl.max(m3, axis=0)
        keys = tl.where(t < K, tl.topk(cand, BLOCK_T), KEY_MAX)
    thr = tl.min(keys, axis=0)
    kth = value_of(thr)
    exact = (rest < kth) & (after < thr) & (kth > float("-inf")) & clean
    return (keys, thr), exact


@triton.jit
def topk_finish(top, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """The running top-k in order, largest first: (x2, ids) of each of the K entries (past K: -inf, -1)."""
    keys, thr = top
    t = tl.arange(0, BLOCK_T)
    keys = tl.sort(tl.where(t < K, keys, KEY_MIN), descending=True)
    x2 = value_of(keys)
    ids = LOW_WORD - (keys & LOW_WORD)
    return tl.where(t < K, x2, float("-inf")), tl.where(t < K, ids, -1)


@triton.jit
def topk_shard_store(out, top, counted, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """A vocab-parallel shard's top-k keys (its global ids) as 2 x BLOCK_T fp32 columns (each key's low word,
    then its high word, as torch views int64 as fp32), past K and at a row that is not scored the least key:
    the merge takes the top BLOCK_T of every shard's (kernels.shard.launch_merge)."""
    keys, thr = top
    t = tl.arange(0, BLOCK_T)
    keys = tl.where((t < K) & counted, keys, KEY_MIN)
    tl.store(out + 2 * t, (keys & LOW_WORD).to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True))
    tl.store(out + 2 * t + 1, (keys >> 32).to(tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def topk_merged(at, BLOCK_T: tl.constexpr):
    """A vocab-parallel row's merged top-k keys, read from its statistics at ``at``: (keys, a threshold)."""
    t = tl.arange(0, BLOCK_T)
    low = tl.load(at + 2 * t).to(tl.int32, bitcast=True).to(tl.int64) & LOW_WORD
    high = tl.load(at + 2 * t + 1).to(tl.int32, bitcast=True).to(tl.int64)
    return (high << 32) | low, tl.full([], KEY_MIN, tl.int64)


@triton.jit
def topk_store(row_out, top, lse2, C: tl.constexpr, F: tl.constexpr, BLOCK_T: tl.constexpr):
    """A row's top-k log-probs and ids (int32 bits) in their columns."""
    x2, ids = topk_finish(top, F.STUDENT_TOPK, BLOCK_T)
    t = tl.arange(0, BLOCK_T)
    inside = t < F.STUDENT_TOPK
    tl.store(row_out + C.topk_logprobs + t, (x2 - lse2) * LN2, mask=inside)
    tl.store(row_out + C.topk_ids + t, ids.to(tl.int32).to(tl.float32, bitcast=True), mask=inside)


@triton.jit
def topk_zero(row_out, C: tl.constexpr, F: tl.constexpr, BLOCK_T: tl.constexpr):
    """A row that is not scored: log-probs 0, ids -1."""
    t = tl.arange(0, BLOCK_T)
    inside = t < F.STUDENT_TOPK
    tl.store(row_out + C.topk_logprobs + t, tl.zeros([BLOCK_T], tl.float32), mask=inside)
    tl.store(row_out + C.topk_ids + t, tl.full([BLOCK_T], -1, tl.int32).to(tl.float32, bitcast=True), mask=inside)


@triton.jit
def topk_overlap(row_out, ids, given, x2, lq, lse2, S, F: tl.constexpr, C: tl.constexpr):
    """verl's overlap diagnostics of a row with a top-k teacher (its entries: ``ids``, ``given``, the student's
    x2 there, their log-probs ``lq``), from the student's top-k ids the row stored (the caller's barrier
    orders the two): the fraction of the student's k ids among the teacher's, and the mean of
    -q (log q - log p) over the teacher's entries in the student's top-k (0 where none is)."""
    hit = given & (ids != ids)
    for j in range(0, F.STUDENT_TOPK):
        mine = tl.load(row_out + C.topk_ids + j).to(tl.int32, bitcast=True).to(tl.int64)
        hit = hit | (given & (ids == mine))
    count = tl.sum(hit.to(tl.float32), axis=0)
    lps = (x2 - lse2) * LN2
    lq_c = lq
    if F.TOPK_CLAMP:
        lq_c = tl.maximum(lq, S.topk_min_logprob)
        lps = tl.maximum(lps, S.topk_min_logprob)
    token_kl = tl.exp(lq_c) * (lq_c - lps)
    advantage = tl.sum(tl.where(hit, -token_kl, 0.0), axis=0) / tl.maximum(count, 1.0)
    tl.store(row_out + C.overlap, count / F.STUDENT_TOPK)
    tl.store(row_out + C.overlap_advantage, advantage)
