"""How the fused lm_head cuts its rows into chunks, and the GEMMs of a chunk.

Per chunk: ``logits_c = h_c @ W.T`` into one reused buffer, the head kernel in place on it, then
``dh_c = g_c @ W`` and ``dW (+)= g_c.T @ h_c``. The chunk size comes from a byte budget for one
chunk's logits (:func:`cut`); chunks/sizes measured against the GEMM floor are in docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .batch import Teacher
from .dw_gemm import add_dw
from .plan import KernelPlan
from .policy.tokens import PolicyTokens
from .spec import Policy

DEFAULT_CHUNK_BYTES = 256 << 20
"""Logits per chunk: 256 MiB = 1024 rows of a 128256-word bf16 vocabulary. Every chunk re-reads and
re-writes dW, and cuBLAS runs the gradient GEMMs well under their large-K speed below ~1024 rows:
the smallest chunk within 1.1x of the 3 GEMMs (docs/performance.md). ``chunk_bytes=128 << 20``
where memory matters more than time."""

ROW_TILE = 128
"""Chunks of 256 rows or more are cut to a multiple of this: cuBLAS tiles the chunk's rows by 128 (or
256), and a partial last tile costs a whole one. From 1024 rows up, to a multiple of twice this: at an odd
count of tiles cuBLAS picked a slow kernel for the dh GEMM (1664 rows of 151936 words on an H200: 33.4 ms
over 16384 rows against 28.7 at 768; the whole call 1.104x the 3 GEMMs against 1.055x at 1536 rows;
docs/performance.md, "Time against memory")."""

TEACHER_SHARE = 0.25
"""With a computed teacher (its hidden states and weight), the share of the budget its logits buffer
takes: the student's chunk (the rows of the gradient GEMMs) gets the rest, and the teacher's logits
are computed in parts of the chunk -- larger gradient GEMMs in the same memory."""


class LmHead(NamedTuple):
    """The lm_head's operands: every row's hidden states [N, H], the weight [V, H] (and bias), every row's
    targets [N]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor | None


class ChunkCut(NamedTuple):
    """How a call's rows are cut: ``rows`` per chunk; a computed teacher's logits in parts of
    ``teacher_rows`` (0: the whole chunk); ``seq_len`` rows per sequence when chunks hold whole
    sequences (else 0)."""

    rows: int
    teacher_rows: int = 0
    seq_len: int = 0


class ChunkLoop:
    """What the fused lm_head's chunk loop does on a route: how it cuts the rows, whether the gradient is
    computed in forward, its steps between and after the chunks, and the metrics it adds. headloss.routes
    gives each route one (headloss.linear_policy holds the others); this one runs plain chunks of rows
    under the byte budget, a computed teacher's logits in parts of a chunk."""

    name = "rows"
    compacts = True  # ignored rows may be skipped (LinearOptions.compact)
    kernel_writes_grad = True  # fused mode's gradient: written by the head kernel over each chunk's logits
    takes_policy = False  # reads the call's policy inputs itself (LinearRun.policy)
    corrects = False  # runs the base objective (KernelPlan.base) and corrects rows after (LinearRun.objective)

    def __repr__(self) -> str:
        return f"<chunk loop {self.name}>"

    def grads_in_forward(self, plan: KernelPlan) -> bool:
        """The gradient is computed in forward and scaled by d loss in backward (3 GEMMs), not recomputed."""
        return plan.mode == "fused"

    def cut(self, chunk_bytes: int, width: int, elem_bytes: int, computed_teacher: bool, seq_len: int,
            sharded: bool) -> ChunkCut:
        """The chunks (``width``: the whole vocabulary, so that every rank of a vocab-parallel call cuts the
        same chunks; ``seq_len``: rows per sequence of [B, T] rows)."""
        if computed_teacher and not sharded:  # the teacher's share in parts of a chunk
            return ChunkCut(chunk_rows_for(int(chunk_bytes * (1.0 - TEACHER_SHARE)), width, elem_bytes),
                            chunk_rows_for(int(chunk_bytes * TEACHER_SHARE), width, elem_bytes))
        return ChunkCut(budget_rows(chunk_bytes, width, elem_bytes, computed_teacher))

    def metric_names(self, policy: Policy | None) -> tuple[str, ...]:
        """The metrics this loop adds after the plan's means (in this order), for the spec's ``policy``."""
        return ()

    def metrics(self, means: torch.Tensor, plan: KernelPlan, policy: Policy | None) -> dict[str, torch.Tensor]:
        """The metrics this loop added, read from the room after ``plan``'s means."""
        return {name: means[plan.means_size + i] for i, name in enumerate(self.metric_names(policy))}

    def start(self, loop, computed: int, device) -> None:
        """Before the chunks: state of the loop's own on ``loop`` (headloss.linear's forward loop)."""

    def part_policy(self, loop, block, start: int, stop: int):
        """The policy rows the head kernel reads for the rows start:stop of ``block`` (a Block)."""
        return block.policy

    def after_part(self, loop, block, start: int, stop: int) -> None:
        """After the head kernel on the rows start:stop (``block``), before the chunk's gradient GEMMs."""

    def after_finish(self, loop, head: LmHead, rows: torch.Tensor) -> None:
        """After the finish (the loss and the means written): ``rows`` every row's values (skipped rows 0)."""


ROWS = ChunkLoop()


@dataclass(frozen=True, kw_only=True)
class LinearRun:
    """Everything but tensors that a linear_head_loss call runs with (by keyword)."""

    plan: KernelPlan  # the variant the chunks run: the call's, or its base objective's (corrected routes)
    chunk_rows: int
    fp32_weight_grad: bool
    compact: bool  # skip ignored rows (one host sync for their count)
    validate: str
    token_shape: tuple[int, ...]
    ignore_index: int
    norm: float
    loop: ChunkLoop = ROWS  # the route's
    traced: bool = False  # under torch.compile (the route's)
    shard: Any = None  # vocab-parallel: a headloss.parallel.VocabShard (the weight's rows)
    seq_len: int = 0  # sequences: rows per sequence (each chunk holds whole sequences)
    policy: PolicyTokens | None = None  # sequences and the corrected routes: the call's policy inputs
    objective: Policy | None = None  # the corrected routes: the spec's policy (``plan`` runs its base)
    reduce_hidden_grad: bool = True  # vocab-parallel: dh summed over the group (else this rank's share)
    teacher_rows: int = 0  # a computed teacher's logits in parts of this many rows of a chunk (0: whole chunks)
    main_grad: tuple | None = field(default=None, compare=False)  # (weight, its main_grad): dW added there in
    # backward, by each chunk (deferred mode) or at once times d loss (gradients in forward); headloss.main_grad
    ahead: Any = field(default=None, compare=False)  # compact: a headloss.scored.ScoredRows (the count without a sync)

    @property
    def grads_in_forward(self) -> bool:
        """The gradient is computed in forward (fused, or sequence-chunked) and scaled in backward."""
        return self.loop.grads_in_forward(self.plan)


def chunk_rows_for(budget_bytes: int, vocab: int, elem_bytes: int) -> int:
    """Rows per chunk so that one [rows, vocab] logits buffer fits ``budget_bytes`` (at least 1),
    cut to a multiple of ROW_TILE from 2 * ROW_TILE rows up, of 2 * ROW_TILE from 8 * ROW_TILE up."""
    rows = max(1, budget_bytes // max(1, vocab * elem_bytes))
    if rows < 2 * ROW_TILE:
        return rows
    tile = 2 * ROW_TILE if rows >= 8 * ROW_TILE else ROW_TILE
    return rows - rows % tile


def budget_rows(chunk_bytes: int, width: int, elem_bytes: int, computed_teacher: bool) -> int:
    """Rows per chunk of plain row chunks: a computed teacher's logits share the budget."""
    return chunk_rows_for(chunk_bytes, width, elem_bytes * (2 if computed_teacher else 1))


@dataclass
class Grads:
    dh: torch.Tensor | None  # (N, H) in the hidden dtype; rows never computed stay 0
    dw: torch.Tensor | None  # (V, H) in the weight dtype, or fp32 while accumulating, or the caller's main_grad
    db: torch.Tensor | None  # (V,) fp32 while accumulating
    dw_into: bool = False  # dw is the caller's main_grad: every chunk adds into it, and it is not returned


def rows_of(t: torch.Tensor | None, index: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    if t is None:
        return None
    return t[start:stop] if index is None else t.index_select(0, index[start:stop])


def linear_into(out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_t: torch.Tensor | None = None) -> torch.Tensor:
    """``h @ weight.T (+ bias)`` into ``out``; ``weight_t``: ``weight.t()`` made once for many calls."""
    weight_t = weight.t() if weight_t is None else weight_t
    if bias is None:
        return torch.mm(h, weight_t, out=out)
    return torch.addmm(bias, h, weight_t, out=out)


def chunks_of(hidden, weight, bias, index, teacher: Teacher, computed: int, chunk_rows: int,
            teacher_rows: int = 0):
    """Yield (start, stop, h_c, parts, logits_c) over the computed rows; logits_c reuses one buffer.
    ``parts`` yields (a, b, teacher rows a:b of the chunk) -- the head kernel's launches over the chunk:
    one, or with a computed teacher one per ``teacher_rows`` rows of it (0: the chunk's), each part's
    teacher logits computed into one buffer of that many rows (:func:`teacher_parts`)."""
    size = min(chunk_rows, max(computed, 1))
    buffer = torch.empty(size, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    t_buffer = None
    if teacher.hidden is not None:
        t_size = size if teacher_rows <= 0 else min(teacher_rows, size)
        t_buffer = torch.empty(t_size, weight.shape[0], dtype=teacher.hidden.dtype, device=hidden.device)
    weight_t = weight.t()  # (views made once: each costs the host a dispatch per chunk)
    for start in range(0, computed, size):
        stop = min(start + size, computed)
        h_c = rows_of(hidden, index, start, stop)
        logits = linear_into(buffer if stop - start == size else buffer[: stop - start], h_c, weight, bias, weight_t)
        yield start, stop, h_c, teacher_parts(teacher, index, start, stop, t_buffer), logits


def teacher_parts(teacher: Teacher, index, start: int, stop: int, t_buffer: torch.Tensor | None):
    """(a, b, teacher logits of rows start + a : start + b or None) covering one chunk: given teacher
    logits (or none) in one part; a computed teacher in parts of ``t_buffer``'s rows, each computed into
    it. A teacher buffer smaller than the student's chunk keeps the chunk (the rows its gradient GEMMs
    take) large under the same memory: the weight-gradient GEMM re-reads and re-writes dW once per
    chunk (benchmarks/bench_compile.py --profile-distill)."""
    if teacher.hidden is None:
        yield 0, stop - start, rows_of(teacher.logits, index, start, stop)
        return
    step = t_buffer.shape[0]
    for lo in range(start, stop, step):
        hi = min(lo + step, stop)
        th = rows_of(teacher.hidden, index, lo, hi)
        yield lo - start, hi - start, linear_into(t_buffer[: hi - lo], th, teacher.weight, teacher.bias)


def new_grads(hidden, weight, bias, wants, fp32_weight_grad: bool, index, computed: int,
              main_grad: torch.Tensor | None = None) -> Grads:
    """Gradient buffers, uninitialised where a chunk overwrites them: the first chunk writes dW and
    db (no memset, no read), and dh rows are each written once unless ignored rows are skipped
    (then those stay 0). With no row to compute, dW and db are zeros. ``main_grad``: dW is added into
    it instead (headloss.main_grad), from the first chunk on."""
    want_h, want_w, want_b = wants
    fp32_w = fp32_weight_grad and weight.dtype != torch.float32
    alloc = torch.empty if computed > 0 else torch.zeros
    into = want_w and main_grad is not None
    return Grads(
        dh=(torch.empty_like(hidden) if index is None else torch.zeros_like(hidden)) if want_h else None,
        dw=main_grad if into else alloc(weight.shape, dtype=torch.float32 if fp32_w else weight.dtype,
                                        device=weight.device) if want_w else None,
        db=alloc(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b and bias is not None else None,
        dw_into=into,
    )


def accumulate(grads: Grads, g, h_c, weight, index, start: int, stop: int) -> None:
    """dh rows, dW and db contributions of one chunk's logits gradient ``g`` [C, V]."""
    if grads.dh is not None:
        if index is None:
            torch.mm(g, weight, out=grads.dh[start:stop])
        else:
            grads.dh.index_copy_(0, index[start:stop], torch.mm(g, weight))
    first = start == 0  # the first chunk overwrites dW (not the caller's main_grad) and db
    if grads.dw is not None:
        add_dw(grads.dw, g, h_c, beta=0.0 if first and not grads.dw_into else 1.0)  # beta = 0: cuBLAS reads no dw
    if grads.db is not None:
        if first:
            torch.sum(g, dim=0, dtype=torch.float32, out=grads.db)
        else:
            grads.db += g.sum(dim=0, dtype=torch.float32)


def finish_grads(grads: Grads, weight, bias, keep_fp32: bool = False) -> tuple:
    """(dh, dW, db) as autograd takes them (dW None where it went into the caller's main_grad). ``keep_fp32``:
    an fp32 dW (``fp32_weight_grad``) stays fp32, for backward to add into a main_grad unrounded."""
    dw = None if grads.dw_into else grads.dw
    dw = dw.to(weight.dtype) if dw is not None and dw.dtype != weight.dtype and not keep_fp32 else dw
    db = grads.db.to(bias.dtype) if grads.db is not None else None
    return grads.dh, dw, db


def spread(t: torch.Tensor, index: torch.Tensor | None, rows: int, fill: float | torch.Tensor) -> torch.Tensor:
    """Per-row values over the computed rows -> over all rows (the others hold ``fill``: a value, or a row)."""
    if index is None:
        return t
    return fill.expand(rows, *t.shape[1:]).clone().index_copy_(0, index, t) if isinstance(fill, torch.Tensor) else \
        torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device).index_copy_(0, index, t)
