"""Named layouts of every packed tensor that the kernels and Python share.

Each layout is one NamedTuple of positions, written once here. Python reads it by name
(``SCRATCH.counted``); a kernel reads the same positions through :func:`kernel_view`, a module of
``tl.constexpr`` copies (``SCRATCH_AT.counted``), because a ``@triton.jit`` function can read a
global only as a constexpr or through a module. There is no second list to keep in step.

The per-row buffer's columns are the terms' (headloss.registry: ROW_COLUMNS, Columns): which of them a
call stores depends on its spec, and the plan's Columns value crosses into the kernels as a constexpr
argument.
"""

from __future__ import annotations

import hashlib
import types
from typing import NamedTuple

import triton.language as tl

_VIEWED: dict[str, NamedTuple] = {}


def kernel_view(layout: NamedTuple, name: str) -> types.ModuleType:
    """``layout``'s positions as ``tl.constexpr`` attributes of a module, readable inside kernels."""
    view = types.ModuleType(f"{__name__}.{name}", f"kernel view of {type(layout).__name__}")
    for field, value in layout._asdict().items():
        setattr(view, field, tl.constexpr(value))
    _VIEWED[name] = layout
    return view


def views_fingerprint() -> str:
    """Every kernel view's positions, hashed. Triton keys a compiled kernel by its source and the
    constexpr globals it reads by name, not by what it reads through a module's attributes: a kernel
    reading ``SCRATCH_AT.done`` would find a binary built with an older position in Triton's on-disk
    cache. kernels.launch adds this to each kernel's key, so a changed layout recompiles."""
    return hashlib.sha256(repr(sorted(_VIEWED.items())).encode()).hexdigest()


class Scratch(NamedTuple):
    """int64 scratch of one call. With a token-level policy term over [B, K] sequences, the ratio's
    extremes and ``SequenceCounters.N`` counters per sequence follow (see :func:`scratch_size`)."""

    counted: int = 0  # rows that are scored (prepare)
    done: int = 1  # programs finished: the last one reduces the rows
    ticket: int = 2  # an in-kernel prepare's election: the first program to swap in the call's nonce prepares
    weight_sum: int = 3  # the counted rows' summed token weights, as fp32 bits (prepare; with token weights)
    ratio_min: int = 4  # smallest ratio over counted tokens, as fp32 bits (a ratio >= 0 orders like its bits)
    ratio_max: int = 5  # largest
    sequences: int = 6  # first per-sequence counter
    N: int = 4  # entries of a call without the policy counters


class SequenceCounters(NamedTuple):
    """Counters of one sequence in scratch (row programs add to them with integer atomics: exact, in
    any order), so the last program reads B x N values instead of the B x K rows."""

    tokens: int = 0
    low: int = 1  # tokens clipped low
    high: int = 2  # tokens clipped high
    N: int = 3


SCRATCH = Scratch()
SEQUENCE_COUNTERS = SequenceCounters()


def scratch_size(n_seq: int) -> int:
    """Scratch entries of a call with ``n_seq`` sequences of per-sequence policy metrics (0: none)."""
    return SCRATCH.sequences + SEQUENCE_COUNTERS.N * n_seq if n_seq else SCRATCH.N


class Verdict(NamedTuple):
    """A verdict slot: int64 host memory the device writes through unified addressing, only when
    something is bad (headloss.validation)."""

    flag: int = 0  # set to 1 last, once the fields below are written
    where: int = 1  # first bad target's flat index (-1: none)
    value: int = 2  # its value
    bad_items: int = 3  # 1 when num_items_in_batch is not a positive finite number
    bad_ids: int = 4  # 1 when a sequence id lies outside [0, n_out)
    items: int = 5  # num_items_in_batch as the device read it (its fp32 bits), for the error message
    teacher: int = 6  # a sparse teacher's first bad entry: TEACHER_MARK - its key (TeacherKeys), or 0
    temperature: int = 7  # 1 + the first slot whose per-row temperature is not a positive finite number, or 0
    weights: int = 8  # 1 + the first slot whose token weight is negative, NaN or infinite, or 0
    selected: int = 9  # the selected ids' first entry outside [0, V) and not -1: TEACHER_MARK - its flat index, or 0
    N: int = 10


VERDICT = Verdict()
TEACHER_MARK = 2**62
"""Verdict.teacher holds TEACHER_MARK minus the first bad entry's key (a maximum over the device's
programs finds the first entry; 0 is none)."""


class TeacherKeys(NamedTuple):
    """A sparse teacher's bad entry as one key, N x its flat index + its kind: the least key is the first
    bad entry, and of one entry's faults its id's first."""

    id: int = 0  # its id lies outside [0, V) and is not -1
    logprob: int = 1  # its log-prob is above 0 or NaN
    repeat: int = 2  # its id is an earlier entry's of the same row
    mass: int = 3  # a teacher given as probabilities: its row does not sum to 1 (within MASS_TOLERANCE)
    N: int = 4


TEACHER_KEY = TeacherKeys()


class Stats(NamedTuple):
    """Vocab-parallel row statistics (fp32), one row per logits row: what every shard exchanges.
    Global ids travel as fp32: exact below 2**24."""

    m2: int = 0  # max x2 (base-2 units)
    d: int = 1  # sum 2^(x2 - m2)
    sum_x2: int = 2  # sum x2 (label smoothing)
    sum_ex2: int = 3  # sum 2^(x2 - m2) x2 (entropy)
    arg: int = 4  # the argmax as a global id
    x2_y: int = 5  # the target's x2 where the shard holds it, else 0
    owned: int = 6  # 1 where the shard holds the target
    rest: int = 7  # top-k 'rest': the sum 2^(x2 - m2) off the teacher's ids (kernels.sparse.rest_sum), else 0
    t_m2: int = 8  # with a teacher: its max (terms.teacher_block's tstats from here on)
    t_d: int = 9  # its sum of exponentials
    t_sum: int = 10  # its sum e_t t2
    t_cross: int = 11  # the forward-KL cross sum (against the teacher's max)
    s_m2: int = 12  # the student's max at the distillation temperature
    s_d: int = 13  # and its sum
    s_cross: int = 14  # the reverse-KL cross sum
    t_arg: int = 15  # the teacher's argmax as a global id
    N: int = 8  # columns without a teacher
    N_TEACHER: int = 16  # with one


STATS = Stats()


class JsdShares(NamedTuple):
    """A vocab-parallel row's share of the mixture JSD (fp32), summed over the shards."""

    value: int = 0  # the JSD
    kl_s: int = 1  # KL(p_s || M)
    N: int = 2


JSD_SHARES = JsdShares()


class Extremes(NamedTuple):
    """The token-level policy term's metrics that are not token means, in this order: after the loss
    in the head kernel's means (blocks.policy_metrics), and extremes_finish_kernel's output."""

    low_min: int = 0  # smallest per-sequence fraction of tokens clipped low
    high_max: int = 1  # largest per-sequence fraction clipped high
    ratio_min: int = 2
    ratio_max: int = 3
    region_mean: int = 4  # clipped low or high, over counted tokens
    ratio_mean: int = 5  # 1, not 0, when nothing counts
    N: int = 6


EXTREMES = Extremes()
EXTREME_METRICS = ("clip_ratio/low_min", "clip_ratio/high_max", "ratio/min", "ratio/max", "clip_ratio/region_mean",
                   "ratio/mean")
"""The metric name of each :class:`Extremes` position."""


class SequenceExtremes(NamedTuple):
    """sequence_extremes_kernel's fp32 output per sequence, for extremes_finish_kernel's minima."""

    low_frac: int = 0  # inf without a counted token
    neg_high_frac: int = 1  # minus the high fraction (inf without a token): a minimum gives the maximum
    ratio_min: int = 2  # NaN if a counted ratio is NaN
    neg_ratio_max: int = 3
    N: int = 4


SEQUENCE_EXTREMES = SequenceExtremes()


class ObjectivePart(NamedTuple):
    """policy_sequence_kernel's fp32 output per sequence, for policy_objective_finish_kernel."""

    loss: int = 0  # the sequence's share of the loss
    low: int = 1  # sums over its counted tokens: clipped low,
    high: int = 2  # clipped high,
    ratio: int = 3  # the ratio,
    logp: int = 4  # log p(target),
    dual: int = 5  # the dual-clip indicator,
    ppo_kl: int = 6  # old - logp,
    entropy: int = 7  # the entropy,
    kl: int = 8  # and the KL
    tokens: int = 9  # its counted tokens
    low_frac: int = 10  # its low fraction, inf without a token (a minimum over sequences)
    neg_high_frac: int = 11  # minus its high fraction, inf without a token
    ratio_min: int = 12  # its smallest counted ratio (NaN if one is NaN)
    neg_ratio_max: int = 13  # minus its largest
    low_share: int = 14  # its low fraction, 0 without a token (a mean over sequences)
    high_share: int = 15  # its high fraction
    N: int = 16


OBJECTIVE_PART = ObjectivePart()

OBJECTIVE_METRICS = ("loss", "clip_ratio/low_mean", "clip_ratio/high_mean", "ratio/mean", "logprob/mean",
                     "pg_clipfrac_lower", "ppo_kl", "entropy", "kl", "clip_ratio/low_min", "clip_ratio/high_max",
                     "ratio/min", "ratio/max", "clip_ratio/region_mean")
"""What policy_objective_finish_kernel writes into its metric vector, position by position."""

ObjectiveOut = NamedTuple("ObjectiveOut", [(name.replace("/", "_"), int) for name in OBJECTIVE_METRICS]
                          + [("N", int)])
ObjectiveOut.__doc__ = "Position of each of :data:`OBJECTIVE_METRICS` in the objective kernels' metric vector."
OBJECTIVE_OUT = ObjectiveOut(*range(len(OBJECTIVE_METRICS)), len(OBJECTIVE_METRICS))

# the kernels' views
SCRATCH_AT = kernel_view(SCRATCH, "SCRATCH_AT")
SEQUENCE_AT = kernel_view(SEQUENCE_COUNTERS, "SEQUENCE_AT")
VERDICT_AT = kernel_view(VERDICT, "VERDICT_AT")
TEACHER_KEYS = kernel_view(TEACHER_KEY, "TEACHER_KEYS")
STATS_AT = kernel_view(STATS, "STATS_AT")
JSD_AT = kernel_view(JSD_SHARES, "JSD_AT")
EXTREMES_AT = kernel_view(EXTREMES, "EXTREMES_AT")
SEQUENCE_EXTREMES_AT = kernel_view(SEQUENCE_EXTREMES, "SEQUENCE_EXTREMES_AT")
PART_AT = kernel_view(OBJECTIVE_PART, "PART_AT")
OUT_AT = kernel_view(OBJECTIVE_OUT, "OUT_AT")
