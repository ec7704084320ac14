"""Every per-call check and flattening, for the logits and the hidden-state entry points alike.

Shapes, dtypes and devices are checked on the host, before anything is launched, and an error
names the argument; the values (targets in range, the normaliser, sequence ids) are checked on the
device by the call's first kernel (headloss.validation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from .batch import CallInputs, Teacher
from .kernels.launch import KERNEL_DTYPES, Geometry, row_strides
from .kernels.sparse import SparseRows
from .layouts import TEACHER_KEY
from .policy.inputs import policy_inputs
from .policy.weights import weigh_tokens
from .row_inputs import float_input
from .spec import LossSpec
from .validation import MASS_TOLERANCE, CheckContext, Normaliser, Validate, normaliser, raise_teacher, validation_mode

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def teacher_precision(teacher_logits, student):
    """float64 teacher logits with a lower-precision student, as float32: the precision the kernels
    (and the reference, for such a student) compute the divergence in."""
    if isinstance(teacher_logits, torch.Tensor) and teacher_logits.dtype == torch.float64 and \
            isinstance(student, torch.Tensor) and student.dtype != torch.float64:
        return teacher_logits.float()
    return teacher_logits


def _floating(value: Any, name: str, dtypes: str = "") -> None:
    """``value`` is a floating-point tensor (errors name it)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating dtype{dtypes}, got {value.dtype}")


def check_logits(logits: Any) -> None:
    _floating(logits, "logits", " (float32, bfloat16, float16)")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: the vocabulary dimension V is 0")
    if logits.stride(-1) != 1 and logits.shape[-1] > 1:
        raise ValueError(
            f"logits: the vocabulary dimension must have stride 1, got strides {logits.stride()}; "
            "pass logits.contiguous()"
        )


def check_targets(targets: Any, token_shape: tuple[int, ...], spec: LossSpec, device: torch.device,
                  shift: bool, source: str = "logits") -> None:
    """targets: an integer tensor shaped like the rows (or, with shift, one of the two conventions).
    A spec that needs targets has already failed without them, when its plan was made."""
    if targets is None:
        if shift:
            raise ValueError("targets: shift=True needs targets")
        return
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets: expected a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in INT_DTYPES:
        raise TypeError(f"targets: expected an integer dtype, got {targets.dtype}")
    if targets.device != device:
        raise ValueError(f"targets: on {targets.device}, {source} on {device}")
    if shift:
        if len(token_shape) != 2 or targets.dim() != 2:
            raise ValueError(
                f"shift: needs {source} [B, T, ...] and targets [B, T] or [B, T - 1]; got {source} rows "
                f"{tuple(token_shape)} and targets {tuple(targets.shape)}"
            )
        batch, seq = token_shape
        if targets.shape[0] != batch or targets.shape[1] not in (seq, seq - 1):
            raise ValueError(
                f"targets: shape {tuple(targets.shape)} fits neither shift convention for {source} rows "
                f"{tuple(token_shape)}: labels [B, T] = {(batch, seq)} (row t scores labels[:, t + 1]) or "
                f"completion ids [B, T - 1] = {(batch, seq - 1)} (row t scores ids[:, t])"
            )
    elif tuple(targets.shape) != tuple(token_shape):
        raise ValueError(
            f"targets: shape {tuple(targets.shape)} does not match {source} rows {tuple(token_shape)} "
            f"(expected {tuple(token_shape)}; shift=True scores next-token labels)"
        )


_NO_DISTILLATION = "given, but the spec has no distillation term, the only one that reads it: drop it or add one"


def check_teacher(logits_shape: tuple[int, ...], device: torch.device, teacher_logits: Any, spec: LossSpec,
                  kernel: bool) -> None:
    """teacher_logits must come with a distillation term, and look like the student's logits (a top-k or
    per-token teacher's inputs are :func:`sparse_teacher`'s to check, teacher_logits given beside them too)."""
    if spec.distillation is None:
        if teacher_logits is not None:
            raise ValueError(f"teacher_logits: {_NO_DISTILLATION}")
        return
    form = spec.distillation.teacher  # (the dense forms, spelt out: torch.compile traces this)
    if form != "logits" and form != "probs":
        return
    name = "teacher_probs" if form == "probs" else "teacher_logits"
    if teacher_logits is None:
        raise ValueError(f"{name}: required by distillation but not given")
    if not isinstance(teacher_logits, torch.Tensor) or not teacher_logits.is_floating_point():
        got = getattr(teacher_logits, "dtype", type(teacher_logits).__name__)
        raise TypeError(f"{name}: expected a floating-point tensor, got {got}")
    if tuple(teacher_logits.shape) != tuple(logits_shape):
        raise ValueError(
            f"{name}: shape {tuple(teacher_logits.shape)} does not match logits {tuple(logits_shape)}"
        )
    if teacher_logits.device != device:
        raise ValueError(f"{name}: on {teacher_logits.device}, logits on {device}")
    if teacher_logits.stride(-1) != 1 and teacher_logits.shape[-1] > 1:
        raise ValueError(f"{name}: the vocabulary dimension must have stride 1; pass .contiguous()")
    if kernel and teacher_logits.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name}: the kernel takes float32, bfloat16, float16 (or float64, as a float32 "
                        f"copy), got {teacher_logits.dtype}")


def resolved_teacher(call: CallInputs, spec: LossSpec) -> CallInputs:
    """A teacher given as probabilities (teacher 'probs') travels as the dense teacher's rows, which the
    kernels read as log q (plan flag TEACHER_PROBS); a top-k teacher's probabilities [.., K] become its
    log-probs (:func:`topk_logprobs`), kept beside them so errors name them; ``teacher_probs`` with another
    teacher, or the logits with this one, are refused naming the argument."""
    teacher = call.teacher
    form = None if spec.distillation is None else spec.distillation.teacher
    probs_teacher = form == "probs"
    if form == "topk" and teacher.probs is not None:  # their log: the log-probs, the probabilities kept to name
        if teacher.logprobs is not None:
            raise ValueError("teacher_probs: give the top-k teacher's probabilities or their log, not both")
        probs = float_input(teacher.probs, "teacher_probs", "teacher 'topk'",  # (its device: sparse_teacher's)
                             getattr(teacher.probs, "device", None))
        return replace(call, teacher=replace(teacher, logprobs=topk_logprobs(probs.detach())))
    if (teacher.probs is None and not probs_teacher) or form == "topk":
        return call
    if not probs_teacher:
        form = "no distillation term" if spec.distillation is None else \
            f"a {spec.distillation.teacher!r} teacher"
        raise ValueError(f"teacher_probs: given, but the spec has {form}; teacher_probs [.., V] needs "
                         "distillation.teacher 'probs', [.., K] with teacher_ids teacher 'topk'")
    for name, value in (("teacher_logits", teacher.logits), ("teacher_hidden", teacher.hidden),
                        ("teacher_ids", teacher.ids), ("teacher_logprobs", teacher.logprobs)):
        if value is not None:
            raise ValueError(f"{name}: the spec's distillation takes a 'probs' teacher (teacher_probs [.., V]); "
                             "drop it")
    if teacher.probs is None:
        raise ValueError("teacher_probs: required by distillation (teacher 'probs') but not given")
    return replace(call, teacher=replace(teacher, logits=teacher.probs, probs=None))


def flat_targets(targets: torch.Tensor | None) -> torch.Tensor | None:
    """Targets as the kernels read them: a dense int32/int64 vector (narrow ints cannot hold
    ignore_index=-100: uint8 wraps it to 156)."""
    if targets is None:
        return None
    if targets.dtype not in (torch.int64, torch.int32):
        targets = targets.long()
    return targets.reshape(-1).contiguous()


# --- the logits entry point ------------------------------------------------------------------------


@dataclass
class LogitsCall:
    """One head_loss call, checked and flattened: what the engine launches on."""

    logits: torch.Tensor  # [N, V] or [B, T, V], as given (strided rows allowed)
    targets: torch.Tensor | None  # flat [B * K (+ shift)] dense ints
    teacher: torch.Tensor | None  # like logits
    policy: Any  # headloss.policy.PolicyTokens or None
    norm: Normaliser
    geo: Geometry  # gradient strides for a fresh contiguous buffer (engine swaps them in place)
    token_shape: tuple[int, ...]  # shape of the per-token outputs: the targets' (or the rows')
    validate: str  # async, sync, off
    targets_shape: tuple[int, ...]  # for error messages
    sparse: SparseRows | None = None  # a top-k or per-token teacher, per slot


def geometry(logits_shape: tuple[int, ...], logits_strides: tuple[int, int], slots_per_seq: int, shift: int,
             teacher: torch.Tensor | None, ignore_index: int, norm: Normaliser) -> Geometry:
    """Sizes and strides of a [N, V] (one sequence) or [B, T, V] launch; the gradient buffer is a
    fresh contiguous tensor of the logits' shape."""
    vocab = logits_shape[-1]
    if len(logits_shape) == 2:
        batch, seq = 1, logits_shape[0]
    else:
        batch, seq = logits_shape[0], logits_shape[1]
    t_b, t_t = row_strides(teacher)
    return Geometry(
        n_rows=batch * seq, n_out=batch * slots_per_seq, V=vocab, T=seq, K=slots_per_seq,
        shift=shift, stride_b=logits_strides[0], stride_t=logits_strides[1],
        g_stride_b=seq * vocab if len(logits_shape) == 3 else 0, g_stride_t=vocab,
        t_stride_b=t_b, t_stride_t=t_t, ignore_index=ignore_index, norm=norm.value,
    )


def check_student_topk(spec: LossSpec, vocab: int) -> None:
    """The student's top-k fits the vocabulary."""
    if spec.student_topk is not None and spec.student_topk > vocab:
        raise ValueError(f"student_topk: {spec.student_topk} ids per row, but the vocabulary holds {vocab}")


def check_head(logits: Any, targets: Any, spec: LossSpec, teacher_logits: Any, shift: bool, kernel: bool
               ) -> tuple[int, ...]:
    """Check head_loss's tensors on the host (errors name the argument); returns the token shape:
    the targets' with ``shift``, else the logits' rows."""
    check_logits(logits)
    token_rows = tuple(logits.shape[:-1])
    check_targets(targets, token_rows, spec, logits.device, shift)
    check_teacher(tuple(logits.shape), logits.device, teacher_logits, spec, kernel)
    return tuple(targets.shape) if shift else token_rows


def head_call(logits: torch.Tensor, targets: torch.Tensor | None, spec: LossSpec, token_shape: tuple[int, ...],
              inputs: CallInputs, *, validate: Validate, raw_policy: bool = False, vocab_total: int | None = None
              ) -> LogitsCall:
    """head_loss's inputs, checked by :func:`check_head`, flattened for the kernels (the policy
    inputs' checks and the normaliser's raise here, naming the argument). ``inputs``: the call's
    teacher, policy inputs, shift and normaliser (its rows unpacked already); ``raw_policy``: the
    route's kernels read the policy inputs as given (policy.inputs.policy_inputs)."""
    teacher, shift, num_items_in_batch = inputs.teacher, inputs.layout.shift, inputs.num_items_in_batch
    policy_given = inputs.batch.by_name()
    norm = normaliser(num_items_in_batch, spec, logits.device)
    mode = validation_mode(validate)
    shift_by = 1 if shift and targets.shape[1] == logits.shape[1] else 0
    if spec.policy is not None and shift_by:
        # per-token policy inputs are row-aligned [B, T]: give the kernels row-aligned targets
        targets = pad_shifted(targets, logits.shape[1], spec.ignore_index)
        shift_by = 0
    policy, targets = policy_inputs(spec.policy, targets, spec.ignore_index, norm.as_torch(),
                                    mode, policy_given, raw=raw_policy)
    weigh_tokens(policy, spec, inputs.token_weights)
    sparse_rows = sparse_teacher(spec, teacher, tuple(logits.shape[:-1]), token_shape, logits.device,
                                 vocab_total or logits.shape[-1], mode, align="shift" if shift else "rows")
    teacher_logits = teacher.logits.detach() if teacher.logits is not None else None
    slots = token_shape[-1] if len(token_shape) == 2 else (token_shape[0] if token_shape else 0)
    geo = geometry(tuple(logits.shape), row_strides(logits), slots, shift_by, teacher_logits, spec.ignore_index,
                   norm)
    return LogitsCall(
        logits=logits, targets=flat_targets(targets), teacher=teacher_logits, policy=policy, norm=norm, geo=geo,
        token_shape=token_shape, validate=mode,
        targets_shape=tuple(targets.shape) if isinstance(targets, torch.Tensor) else (), sparse=sparse_rows,
    )


def pad_shifted(targets: torch.Tensor, rows_per_seq: int, ignore_index: int) -> torch.Tensor:
    """Row-aligned targets [B, T] of a shifted call: labels [B, T] -> labels[:, 1:] + one ignored;
    completion ids [B, T - 1] -> ids + one ignored. Narrow ints are read as int64 first (as flat_targets
    reads them: a uint8 cannot hold ignore_index=-100)."""
    if targets.dtype not in (torch.int64, torch.int32):
        targets = targets.long()
    shift = 1 if targets.shape[1] == rows_per_seq else 0
    return F.pad(targets[:, shift:], (0, 1), value=ignore_index)


def check_linear_inputs(hidden, weight, bias) -> None:
    _floating(hidden, "hidden")
    _floating(weight, "weight")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: expected [V, H] with H = {hidden.shape[-1]} (hidden's last dim), got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight: the vocabulary dimension V is 0")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {getattr(bias, 'shape', bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias: expected {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")


def teacher_source(spec, token_rows, hidden, weight, teacher: Teacher) -> Teacher:
    """The lm_head's teacher, checked (errors name the argument): detached, its rows flat."""
    logits, t_hidden, t_weight, t_bias = teacher.logits, teacher.hidden, teacher.weight, teacher.bias
    logits = teacher_precision(logits, hidden)  # (hidden: in the autocast dtype)
    if t_hidden is None and (t_weight is not None or t_bias is not None):
        raise ValueError("teacher_hidden: required with teacher_weight / teacher_bias")
    if t_hidden is not None:
        if logits is not None:
            raise ValueError("teacher_logits: give either teacher_logits or teacher_hidden + teacher_weight, not both")
        if t_weight is None:
            raise ValueError("teacher_weight: required with teacher_hidden")
        if spec.distillation is None:
            raise ValueError(f"teacher_hidden: {_NO_DISTILLATION}")
        if tuple(t_hidden.shape[:-1]) != tuple(token_rows) or t_hidden.device != hidden.device:
            raise ValueError(f"teacher_hidden: expected {tuple(token_rows)} + (Ht,) on {hidden.device}, "
                             f"got {tuple(t_hidden.shape)} on {t_hidden.device}")
        if t_weight.dim() != 2 or tuple(t_weight.shape) != (weight.shape[0], t_hidden.shape[-1]):
            raise ValueError(f"teacher_weight: expected [V, Ht] = {(weight.shape[0], t_hidden.shape[-1])}, "
                             f"got {tuple(t_weight.shape)}")
        if t_weight.dtype != t_hidden.dtype or (t_bias is not None and tuple(t_bias.shape) != (t_weight.shape[0],)):
            raise ValueError("teacher_weight: dtype must match teacher_hidden, teacher_bias shape must be [V]")
        rows = math.prod(token_rows)
        return Teacher(None, t_hidden.detach().reshape(rows, -1), t_weight.detach(),
                       None if t_bias is None else t_bias.detach())
    check_teacher(tuple(token_rows) + (weight.shape[0],), hidden.device, logits, spec,
                  kernel=hidden.dtype in KERNEL_DTYPES)
    if logits is None:
        return Teacher()
    return Teacher(logits.detach().reshape(-1, logits.shape[-1]))


# --- a sparse teacher: its top-k, or its log-prob at each target -------------------------------------

MAX_TOPK = 1024
"""The largest K the kernels take (one row's K entries live in registers)."""

_DENSE_ONLY = ("given, but the spec's distillation takes teacher logits (teacher: 'logits'); set "
               "distillation.teacher to 'topk' or 'token' for a sparse teacher")


def topk_logprobs(probs: torch.Tensor) -> torch.Tensor:
    """A top-k teacher's probabilities as log-probs (fp32): 0 gives -inf (no entry), above 1 by at most
    MASS_TOLERANCE (rounding) 0; a negative, NaN or larger one fails the check, which names teacher_probs."""
    log = probs.float().log()
    return torch.where(probs <= 1.0 + MASS_TOLERANCE, log.clamp(max=0.0), log)


def sparse_teacher(spec: LossSpec, teacher: Teacher, rows_shape: tuple[int, ...], token_shape: tuple[int, ...],
                   device: torch.device, vocab: int, mode: str, align: str = "rows") -> SparseRows | None:
    """A top-k or per-token teacher, checked (errors name the argument) and laid out per slot as the
    kernels read it (:class:`~headloss.kernels.sparse.SparseRows`); None without one. ``rows_shape``:
    the logits' rows, ``token_shape`` the slots' (the targets'). Values (ids in [0, V) or -1, each
    once per row; log-probs <= 0, not NaN) are read on the host with ``mode`` "sync". ``align``: how
    the slots sit on the rows -- "rows" one per row; "shift" (a shifted call) the first
    ``token_shape[1]`` rows of each sequence; "pad_last" the lm_head's rows [B, T] of completion ids
    [B, T - 1], a per-token teacher padded with the unscored last row."""
    dist = spec.distillation
    form = None if dist is None else dist.teacher
    ids, lp = teacher.ids, teacher.logprobs
    if form not in ("topk", "token"):
        for name, value in (("teacher_ids", ids), ("teacher_logprobs", lp)):
            if value is not None:
                raise ValueError(f"{name}: {_NO_DISTILLATION if dist is None else _DENSE_ONLY}")
        return None
    if teacher.logits is not None or teacher.hidden is not None:
        name = "teacher_logits" if teacher.logits is not None else "teacher_hidden"
        raise ValueError(f"{name}: the spec's distillation takes a {form!r} teacher (teacher_ids / teacher_logprobs); "
                         "give one teacher")
    if form == "token":
        if ids is not None:
            raise ValueError("teacher_ids: a 'token' teacher is its log-prob at each target (teacher_logprobs) only")
        lp = float_input(lp, "teacher_logprobs", "distillation (teacher 'token')", device)
        if tuple(lp.shape) != tuple(token_shape):
            raise ValueError(f"teacher_logprobs: shape {tuple(lp.shape)} does not match the targets "
                             f"{tuple(token_shape)} (teacher 'token': one log-prob per target)")
        rows = SparseRows(None, lp.detach().reshape(-1).contiguous(), 1)
    else:
        if ids is None:
            raise ValueError("teacher_ids: required by distillation (teacher 'topk') but not given")
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = getattr(ids, "dtype", type(ids).__name__)
            raise TypeError(f"teacher_ids: expected an int64 or int32 tensor, got {got}")
        given = "teacher_logprobs" if teacher.probs is None else "teacher_probs"  # (lp: their log, resolved_teacher's)
        lp = float_input(lp, given, "distillation (teacher 'topk')", device)
        if ids.device != device:
            raise ValueError(f"teacher_ids: on {ids.device}, logits on {device}")
        if ids.dim() != len(rows_shape) + 1 or tuple(ids.shape[:-1]) != tuple(rows_shape):
            raise ValueError(f"teacher_ids: shape {tuple(ids.shape)} does not match the rows {tuple(rows_shape)} "
                             "+ (K,)")
        if tuple(lp.shape) != tuple(ids.shape):
            raise ValueError(f"{given}: shape {tuple(lp.shape)} does not match teacher_ids {tuple(ids.shape)} (one "
                             f"{'log-prob' if teacher.probs is None else 'probability'} per id)")
        k = ids.shape[-1]
        if not 1 <= k <= MAX_TOPK:
            raise ValueError(f"teacher_ids: K = {k} entries per row; the kernels take 1 to {MAX_TOPK}")
        if align == "shift" and len(token_shape) == 2:  # the scored rows: the first K of each sequence
            ids, lp = ids[:, :token_shape[1]], lp[:, :token_shape[1]]
        rows = SparseRows(ids.detach().reshape(-1, k).contiguous(), lp.detach().reshape(-1, k).contiguous(), k,
                          None if teacher.probs is None else teacher.probs.detach())
    if mode == "sync":
        check_sparse_values(rows, vocab, token_shape)
    if align == "pad_last" and rows.ids is None:
        rows = rows._replace(logprobs=F.pad(rows.logprobs.reshape(token_shape), (0, 1)).reshape(-1))
    return rows


def check_sparse_values(rows: SparseRows, vocab: int, token_shape: tuple[int, ...]) -> None:
    """The sparse teacher's values, read on the host (one sync), with the promises and the error of the
    kernels' check (kernels.sparse.check_teacher_kernel): ids in [0, V) or -1, log-probs <= 0 and not NaN
    where an id is given, no id twice among a row's entries (an entry with id -1 or log-prob -inf is
    no entry); the first bad entry by position is the one named."""
    lp = rows.logprobs.float()
    none = torch.iinfo(torch.int64).max
    at = torch.arange(lp.numel(), device=lp.device).view(lp.shape) * TEACHER_KEY.N
    if rows.ids is None:
        keys = torch.where(~(lp <= 0.0), at + TEACHER_KEY.logprob, none)
        value = None
    else:
        ids = rows.ids.long()
        has_id = ids != -1
        bad_id = has_id & ((ids < 0) | (ids >= vocab))
        entry = has_id & ~bad_id & (lp != float("-inf"))
        # an entry repeats when a stable sort by id puts an entry of the same id before it
        slots = torch.arange(ids.shape[1], device=ids.device)
        ordered, order = torch.where(entry, ids, vocab + 1 + slots).sort(dim=-1, stable=True)
        repeat = torch.zeros_like(entry)
        repeat.scatter_(-1, order[:, 1:], ordered[:, 1:] == ordered[:, :-1])
        keys = torch.stack([torch.where(bad_id, at + TEACHER_KEY.id, none),
                            torch.where(has_id & ~(lp <= 0.0), at + TEACHER_KEY.logprob, none),
                            torch.where(repeat, at + TEACHER_KEY.repeat, none)]).amin(0)
        value = ids.reshape(-1)
    first = int(keys.min()) if keys.numel() else none
    if first < none:
        raise_teacher(first, CheckContext.of(token_shape, vocab, -100, rows),
                      entry_id=None if value is None else int(value[first // TEACHER_KEY.N]))
