"""The student's top-k (``student_topk``): a bound from the stats pass, then a second read of only what can
hold the top k.

Each element of a row is ranked by one int64 key, its transformed logit's fp32 bits made order-preserving as
signed int32 in the high word and 0xFFFFFFFF - its id in the low word: a larger key is a larger logit, or the
same logit at a lower id (torch.topk's order on ties, which torch does not promise but gives on a stable sort).

The stats pass keeps two running maxima (:func:`bound_block`, no per-logit work beyond one in-thread maximum per
GROUP adjacent logits): each block's, and each group's of GROUP adjacent lanes of the block walked down the row. At
the row's end b, the k-th largest group maximum, bounds the top k from below: k groups hold a logit at least b, so
no logit below it is among the k largest (:func:`bound_finish`). The logits at least b lie in the cells (GROUP
adjacent logits) where a block whose maximum is at least b crosses a group whose maximum is at least b: at k 64, in
a 128256-wide row in random order, about 42 of its 63 blocks and 70 of its 256 groups, about 2900 of its 16000
cells. Those blocks and groups are listed in a small buffer of the row, their crossings read again, a block's width
of cells a step in one gather (:func:`_crossings`), and the keys at least b (about k) go to the same buffer, each
step's cells taking their slots by one scan of their counts and storing lane by lane (:func:`collect_cells`); the
buffer's top k, by ``tl.topk``, are the row's, largest first (:func:`topk_reread`). Exact on every row: the second
read transforms each logit by the same code as the stats pass (to_x2), so a logit at b is at b again; a row with
more keys at least b than the buffer holds (ties at b, or one group holding many), a NaN or +inf row (whose maxima
rank nothing), a row of fewer groups than k and a row of more than MAX_BLOCKS blocks take the running insertion
(:func:`insert_block`) over the blocks at least b read again whole (every block of a row past MAX_BLOCKS). Measured
against the designs before it (the lanes kept through the pass, a compaction, the insertion through the pass, the
insertion after the bound): docs/performance.md ("What the student's top-k costs").

With a top-k teacher the row also gets verl's overlap diagnostics (verl/trainer/distillation/fsdp/losses.py):
how many of the teacher's ids are among the student's top-k, and the mean over them of
-q_k (log q_k - log p_k) (verl's token KL of the entry, its ``log_prob_min_clamp`` applied), 0 where none is.
"""

import torch
import triton
import triton.language as tl

from .primitives import LN2, to_x2

KEY_MIN = tl.constexpr(-(2**63))
KEY_MAX = tl.constexpr(2**63 - 1)
LOW_WORD = tl.constexpr(0xFFFFFFFF)
_GROUP = 8
GROUP = tl.constexpr(_GROUP)
"""Adjacent lanes of a block per running group maximum (one 16-byte load of 16-bit logits: inside a thread)."""
MAX_BLOCKS = 256
"""The blocks a row's bound keeps one maximum each for (2 registers a thread at 4 warps); a longer row (a
vocabulary past 512K at 2048 columns a block) takes the running insertion over every block
(:func:`topk_reread`)."""
_MAX_BLOCKS = tl.constexpr(MAX_BLOCKS)


def bound_blocks(vocab: int, block_v: int) -> int:
    """The blocks of a row of ``vocab`` the bound keeps maxima for: a power of two, at most MAX_BLOCKS."""
    return min(1 << (max(-(-vocab // block_v), 1) - 1).bit_length(), MAX_BLOCKS)


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
def bound_start(BLOCK_V: tl.constexpr, NB: tl.constexpr):
    """The empty bound: the running maxima of each group of GROUP adjacent lanes, and of each of NB blocks."""
    tl.static_assert(NB <= _MAX_BLOCKS, "the bound keeps one maximum a block for at most MAX_BLOCKS blocks")
    return tl.full([BLOCK_V // GROUP], float("-inf"), tl.float32), tl.full([NB], float("-inf"), tl.float32)


@triton.jit
def bound_block(x2, start, bound, BLOCK_V: tl.constexpr, NB: tl.constexpr):
    """One block's x2 (its columns from ``start``; padding -inf) into the bound: its groups' maxima (a reduction
    inside a thread) and the block's maximum (the stats pass's own, the same reduction)."""
    gmax, bmax = bound
    gmax = tl.maximum(gmax, tl.max(tl.reshape(x2, [BLOCK_V // GROUP, GROUP]), axis=1))
    bmax = tl.where(tl.arange(0, NB) == start // BLOCK_V, tl.max(x2, axis=0), bmax)
    return gmax, bmax


@triton.jit
def bound_finish(bound, clean, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, NB: tl.constexpr):
    """What :func:`topk_reread` starts from: (the empty running top-k whose threshold ``thr`` is just below
    b, the K-th largest group maximum (K groups hold an element at least that, so no logit below it is in the
    top k); whether each block's maximum is at least b, and each group's (int32 flags)). Every element at
    least b is in one of those blocks and one of those groups. b is -inf (every block and group) where the
    row is not ``clean`` or there are fewer groups than BLOCK_T."""
    gmax, bmax = bound
    t = tl.arange(0, BLOCK_T)
    b = tl.full([], float("-inf"), tl.float32)
    if BLOCK_T == 1:
        b = tl.max(gmax, axis=0)
    elif BLOCK_V // GROUP >= BLOCK_T:
        largest = tl.topk(gmax, BLOCK_T)
        b = tl.min(tl.where(t < K, largest, float("inf")), axis=0)
    b = tl.where(clean & (b == b), b, float("-inf"))
    thr = (_high(b).to(tl.int64) << 32) - 1
    every = b == float("-inf")  # (a NaN's maximum is no number)
    block_on = tl.where(every, 1, (bmax >= b).to(tl.int32))
    group_on = tl.where(every, 1, (gmax >= b).to(tl.int32))
    return tl.where(t < K, thr, KEY_MAX), thr, block_on, group_on


@triton.constexpr_function
def collect_cap(block_t):
    """The keys a row's buffer holds for the top ``block_t`` (a power of two): twice as many, at least 16 (a
    row with more keys at least b takes the running insertion)."""
    return max(2 * block_t, 16)


@triton.constexpr_function
def collect_words(block_t, block_v, nb):
    """int64 words of a row's buffer (the head and shard launches allocate them): collect_cap(block_t) keys,
    then the indices of the row's ``nb`` blocks and ``block_v // GROUP`` groups at least b, listed."""
    return collect_cap(block_t) + nb + block_v // _GROUP


def row_buffers(n_rows: int, block_t: int, block_v: int, nb: int, device: torch.device) -> torch.Tensor | None:
    """The rows' buffers of the student's top-k (:func:`topk_reread`), or None for a launch that keeps no bound
    (``nb`` 0: no top-k, or a vocab-parallel head whose rows' top-k come merged)."""
    if not nb:
        return None
    return torch.empty(n_rows, collect_words(block_t, block_v, nb), dtype=torch.int64, device=device)


@triton.jit
def _lane(x, lane, cell, first, thr, at, taken, CAP: tl.constexpr, buf):
    """Lane ``lane`` of each cell (``x``: its x2; ``cell``: the cell's first column) into the buffer at slot
    ``at`` + ``taken`` where its key is above ``thr`` and the slot is below CAP: the keys the cell has
    taken after it."""
    key = key_of(x, cell + lane + first)
    keep = key > thr
    tl.store(buf + at + taken, key, mask=keep & (at + taken < CAP))
    return taken + keep.to(tl.int32)


@triton.jit
def collect_cells(x2, cell, first, thr, at, CAP: tl.constexpr, buf):
    """The keys above ``thr`` of cells of GROUP adjacent values x2 ([C, GROUP], a cell inside a thread;
    ``cell`` [C]: its first column, ids from ``first``) into the row's buffer ``buf``, each cell's from its
    slot ``at`` on, lane by lane (no per-lane state beyond the cell's count); slots past CAP are not
    stored."""
    C: tl.constexpr = x2.shape[0]
    even, odd = tl.split(tl.reshape(x2, [C, 4, 2]))
    e0, e1 = tl.split(tl.reshape(even, [C, 2, 2]))
    o0, o1 = tl.split(tl.reshape(odd, [C, 2, 2]))
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    taken = tl.zeros([C], tl.int32)
    taken = _lane(c0, 0, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c1, 1, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c2, 2, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c3, 3, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c4, 4, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c5, 5, cell, first, thr, at, taken, CAP, buf)
    taken = _lane(c6, 6, cell, first, thr, at, taken, CAP, buf)
    _lane(c7, 7, cell, first, thr, at, taken, CAP, buf)


@triton.jit
def _crossings(row_ptr, V, S, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, first, thr, b, lists, n_blocks,
               n_groups, buf, CAP: tl.constexpr, NB: tl.constexpr):
    """Every cell where a listed block crosses a listed group (``lists``: the blocks', then the groups'
    indices), BLOCK_V // GROUP cells a step read again in one gather, their keys above ``thr`` into the
    buffer in turn (a step's cells take their slots by one scan of their counts): the count of keys."""
    C: tl.constexpr = BLOCK_V // GROUP
    n_cells = n_blocks * n_groups
    count = tl.zeros([], tl.int32)
    for c0 in range(0, n_cells, C):
        c = c0 + tl.arange(0, C)
        inside = c < n_cells
        p = c // n_groups
        block = tl.load(lists + p, mask=inside, other=0).to(tl.int32)
        group = tl.load(lists + NB + c - p * n_groups, mask=inside, other=0).to(tl.int32)
        cell = block * BLOCK_V + group * GROUP
        cols = cell[:, None] + tl.arange(0, GROUP)[None, :]
        read = inside[:, None] & (cols < V)
        z = tl.load(row_ptr + cols, mask=read, other=0.0)
        x2, _ = to_x2(z, cols, V, S, HAS_SOFTCAP, False)
        x2 = tl.where(read, x2, float("-inf"))
        n = tl.sum((x2 >= b).to(tl.int32), axis=1)
        collect_cells(x2, cell.to(tl.int64), first, thr, count + tl.cumsum(n, axis=0) - n, CAP, buf)
        count += tl.sum(n, axis=0)
    return count


@triton.jit
def topk_reread(row_ptr, V, S, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, first, BLOCK_T: tl.constexpr,
                NB: tl.constexpr, top, buf):
    """The row's top-k (keys, thr; ids from ``first`` on) from what ``top`` (:func:`bound_finish`) says may hold it:
    the blocks and the groups at least b are listed in the row's buffer ``buf``, the cells where they cross read
    again (:func:`_crossings`) and their keys at least b collected there, whose top BLOCK_T are the row's. A row
    with more such keys than the buffer holds (ties at b, or one group holding many), a NaN or +inf row or one of
    fewer groups than k (b -inf), or a row of more than NB blocks takes the running insertion (:func:`insert_block`)
    over its blocks at least b read again whole (every block of a row of more than NB)."""
    keys, thr, block_on, group_on = top
    CAP: tl.constexpr = collect_cap(BLOCK_T)
    G: tl.constexpr = BLOCK_V // GROUP
    lists = buf + CAP
    n_blocks = tl.sum(block_on, axis=0)
    n_groups = tl.sum(group_on, axis=0)
    tl.store(lists + tl.cumsum(block_on, axis=0) - 1, tl.arange(0, NB).to(tl.int64), mask=block_on != 0)
    tl.store(lists + NB + tl.cumsum(group_on, axis=0) - 1, tl.arange(0, G).to(tl.int64), mask=group_on != 0)
    tl.debug_barrier()
    b = value_of(thr + 1)  # (a key is above thr where its x2 is at least b)
    count = tl.full([], CAP + 1, tl.int32)
    if (b > float("-inf")) & (V <= NB * BLOCK_V):
        count = _crossings(row_ptr, V, S, HAS_SOFTCAP, BLOCK_V, first, thr, b, lists, n_blocks, n_groups, buf, CAP,
                           NB)
    if count <= CAP:
        tl.debug_barrier()
        t = tl.arange(0, CAP)
        found = tl.load(buf + t, mask=t < count, other=KEY_MIN, cache_modifier=".cg")
        if BLOCK_T == 1:
            keys = tl.full([1], 0, tl.int64) + tl.max(found, axis=0)
        else:
            keys = tl.topk(found, BLOCK_T)
    else:
        offs = tl.arange(0, BLOCK_V)
        n_read = tl.where(V > NB * BLOCK_V, tl.cdiv(V, BLOCK_V), n_blocks)
        for i in range(0, n_read):
            block = i
            if V <= NB * BLOCK_V:
                block = tl.load(lists + i, cache_modifier=".cg").to(tl.int32)
            cols = block * BLOCK_V + offs
            z = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
            x2, _ = to_x2(z, cols, V, S, HAS_SOFTCAP, True)
            keys, thr = insert_block(x2, cols, V, keys, thr, first, BLOCK_T)
        keys = tl.sort(tl.where(keys == KEY_MAX, KEY_MIN, keys), descending=True)  # (past k: KEY_MAX)
    return keys, thr


@triton.jit
def topk_block(x2, cols, V, top, first, BLOCK_T: tl.constexpr):
    """One block of x2 (its columns ``cols`` of the row, whose ids start at ``first``: a vocab-parallel shard's
    vocab_start; columns >= V are padding) into the running top-k ``top``, skipped where its largest logit is
    below the threshold: the insertion through a whole row, which benchmarks/bench_topk_stream.py measures
    (the kernels insert only what the bound leaves: :func:`topk_reread`)."""
    keys, thr = top
    block_max = tl.max(x2, axis=0)
    if _high(block_max).to(tl.int64) >= (thr >> 32):
        keys, thr = insert_block(x2, cols, V, keys, thr, first, BLOCK_T)
    return keys, thr


@triton.jit
def insert_block(x2, cols, V, keys, thr, first, BLOCK_T: tl.constexpr):
    """The block's keys above the threshold into the running top-k (keys, thr): each into the slot of the
    smallest, so the keys are in no order (:func:`topk_reread` sorts them after its last block)."""
    t = tl.arange(0, BLOCK_T)
    key = key_of(x2, cols.to(tl.int64) + first)
    key = tl.where(cols < V, key, KEY_MIN)
    best = tl.max(tl.where(key > thr, key, KEY_MIN), axis=0)
    while best > thr:
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
def _filled(keys):
    """Which slots of a running top-k hold a logit's key: a slot :func:`bound_finish` left empty holds a key
    below every logit's (where a shard's row has fewer columns than k)."""
    return keys >= (_high(tl.full([], float("-inf"), tl.float32)).to(tl.int64) << 32)


@triton.jit
def topk_finish(top, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """The running top-k, kept largest first (:func:`topk_reread`; a vocab-parallel row's merged by torch's
    topk): (x2, ids) of each of the K entries (past K: -inf, -1)."""
    keys, thr = top
    t = tl.arange(0, BLOCK_T)
    x2 = value_of(keys)
    ids = LOW_WORD - (keys & LOW_WORD)
    real = (t < K) & _filled(keys)
    return tl.where(real, x2, float("-inf")), tl.where(real, ids, -1)


@triton.jit
def topk_shard_store(out, top, counted, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """A vocab-parallel shard's top-k keys (its global ids) as 2 x BLOCK_T fp32 columns (each key's low word,
    then its high word, as torch views int64 as fp32), past K and at a row that is not scored the least key:
    the merge takes the top BLOCK_T of every shard's (kernels.shard.launch_merge)."""
    keys, thr = top
    t = tl.arange(0, BLOCK_T)
    keys = tl.where((t < K) & counted & _filled(keys), keys, KEY_MIN)
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
