"""Which way a call runs: :func:`routes_for` decides, and the route it returns runs the call.

A route names the whole path of one call, from its inputs to its gradient. Every choice a call
makes beyond its plan -- the backend, where the policy objective runs, how the lm_head cuts its
rows and what runs between its chunks -- is made here, once, from the plan and the facts of the call
(:class:`Facts`). A :class:`Route` carries the objects that run those choices: its policy term
(objective.PolicyTerm: where the objective runs besides the head kernel, what it adds to the output)
and, on the lm_head, its chunk loop (chunks.ChunkLoop: the cut, the steps between and after the
chunks, the metrics they add); nothing downstream asks which route it is.

:func:`routes_for` lists every route that can run a call, the default first;
``head_loss(..., route=NAME)`` / ``linear_head_loss(..., route=NAME)`` takes another one of them
(testing, A/B), ``out.route`` says which ran, ``python -m headloss explain`` prints them and
``HEADLOSS_LOG_ROUTES=1`` logs each call's.

=============================  ===================================================================
route                          how it runs
=============================  ===================================================================
``torch``                      plain torch, term by term (headloss.reference): the CPU path
``fused``                      one launch: stats, the row epilogue (every term's value and share of
                               the gradient, a token-level policy objective too) and the gradient
                               pass; backward scales it by d loss
``deferred``                   stats in forward, the gradient pass in backward (reduction "none",
                               differentiable per-token outputs)
``deferred+kernels``           deferred, the policy objective by two launches over [B, T]
                               sequences (kernels/policy.py), inside the head's autograd node
``deferred+torch``             deferred, the policy objective by torch ops (policy.objectives)
``lm_head:fused``              chunks of hidden x weight, the fused kernel in place on each: 3 GEMMs
``lm_head:deferred``           chunks, the gradient pass in backward over recomputed logits: 4 GEMMs
``lm_head:deferred+kernels``   ... its policy objective by the sequence kernels
``lm_head:deferred+torch``     ... its policy objective by torch ops
``lm_head:sequences+kernels``  chunks of whole sequences: each chunk's sequence statistics, its
                               d loss / d rows (one launch) and its gradient pass in forward: 3 GEMMs
``lm_head:sequences+torch``    the same, d loss / d rows by autograd over torch ops
``lm_head:covariance``         clip_cov / kl_cov: the base objective fused, then the selected rows
                               corrected (a GEMM over those rows; one host read)
``lm_head:entropy-guess``      a row-local objective under the top-entropy mask: fused under a mask
                               guessed chunk by chunk, the rows guessed wrong corrected
=============================  ===================================================================
"""

from __future__ import annotations

import enum
import math
from typing import Literal, NamedTuple

import torch

from . import env
from .bounded import BoundedDict, cache
from .chunks import ROWS, ChunkLoop
from .kernels.launch import KERNEL_DTYPES
from .linear_policy import LOOPS
from .objective import EPILOGUE, KERNELS, KERNELS_IN_HEAD, NO_POLICY, TORCH, PolicyTerm
from .plan import KernelPlan
from .policy_tables import IMPORTANCE_SAMPLING, OBJECTIVES
from .spec import separate_kl_entropy


class Mode(str, enum.Enum):
    """How the head kernel runs on a route."""

    TORCH = "torch"  # no kernel: plain torch, term by term
    FUSED = "fused"  # one launch: stats, epilogue, gradient
    DEFERRED = "deferred"  # stats in forward, the gradient pass in backward


class RouteKind(NamedTuple):
    """A row of the route table: everything a route's name stands for."""

    name: str
    mode: Mode
    term: PolicyTerm  # where a policy term runs besides the head kernel, when the call has one
    loop: ChunkLoop | None  # the lm_head's chunk loop (None on the logits entry point)
    description: str


_TABLE = (
    RouteKind("torch", Mode.TORCH, TORCH, None, "plain torch, term by term (headloss.reference)"),
    RouteKind("fused", Mode.FUSED, EPILOGUE, None, "one launch: stats, row epilogue, gradient"),
    RouteKind("deferred", Mode.DEFERRED, NO_POLICY, None, "stats in forward, the gradient pass in backward"),
    RouteKind("deferred+kernels", Mode.DEFERRED, KERNELS_IN_HEAD, None,
              "deferred; the policy objective by two launches over [B, T] sequences"),
    RouteKind("deferred+torch", Mode.DEFERRED, TORCH, None, "deferred; the policy objective by torch ops"),
    RouteKind("lm_head:fused", Mode.FUSED, EPILOGUE, ROWS,
              "chunks of hidden x weight, the fused kernel in place on each (3 GEMMs)"),
    RouteKind("lm_head:deferred", Mode.DEFERRED, NO_POLICY, ROWS,
              "chunks; the gradient pass in backward over recomputed logits (4 GEMMs)"),
    RouteKind("lm_head:deferred+kernels", Mode.DEFERRED, KERNELS, ROWS,
              "lm_head:deferred; the policy objective by the sequence kernels"),
    RouteKind("lm_head:deferred+torch", Mode.DEFERRED, TORCH, ROWS,
              "lm_head:deferred; the policy objective by torch ops"),
    RouteKind("lm_head:sequences+kernels", Mode.DEFERRED, KERNELS, LOOPS["sequences+kernels"],
              "chunks of whole sequences, each one's objective by one launch (3 GEMMs)"),
    RouteKind("lm_head:sequences+torch", Mode.DEFERRED, TORCH, LOOPS["sequences+torch"],
              "chunks of whole sequences, each one's objective by autograd over torch (3 GEMMs)"),
    RouteKind("lm_head:covariance", Mode.FUSED, EPILOGUE, LOOPS["covariance"],
              "the base objective fused, then the covariance-selected rows corrected"),
    RouteKind("lm_head:entropy-guess", Mode.FUSED, EPILOGUE, LOOPS["entropy-guess"],
              "fused under a guessed top-entropy mask, then the rows guessed wrong corrected"),
)
KINDS: dict[str, RouteKind] = {kind.name: kind for kind in _TABLE}
ROUTES: dict[str, str] = {kind.name: kind.description for kind in _TABLE}
"""Every route by name, with what it does (explain and the docs print these)."""

SEQUENCE_CHUNK_SLACK = 4
"""The lm_head cuts chunks of whole sequences when one sequence's logits fit this many chunk budgets."""


class Facts(NamedTuple):
    """What a route depends on, besides the plan: read once per call from its arguments."""

    entry: Literal["logits", "hidden"]
    backend: Literal["triton", "torch"]
    token_shape: tuple[int, ...]  # the rows' shape: [B, T] sequences, or [N]
    sequence_ids: bool  # [N] rows name their sequences
    sharded: bool  # vocab-parallel
    traced: bool  # under torch.compile
    capturing: bool  # under CUDA-graph capture
    inputs_want_grad: bool  # a policy input requires a gradient (the kernels give the rows' only)
    sequence_fits: bool = False  # lm_head: one sequence's logits fit SEQUENCE_CHUNK_SLACK chunk budgets


class Route(NamedTuple):
    """One way to run a call: a row of the table (``name``, ``mode``, ``term``, ``loop``) for one plan."""

    name: str
    mode: Mode
    plan: KernelPlan  # the variant the head kernel runs: the call's, or the base objective's (corrected routes)
    term: PolicyTerm  # where the policy objective runs besides the head kernel (NO_POLICY: no policy term)
    loop: ChunkLoop | None  # the lm_head's chunk loop (None on logits)
    sequence_kernels: bool  # the policy's per-sequence metrics may launch kernels/policy.py ([B, T] rows)
    raw_inputs: bool  # the kernels read the policy inputs as given (no fp32 copies)
    traced: bool  # under torch.compile (the engine calls the torch.library ops)

    def epilogue_policy(self, pol):
        """``pol`` (the call's policy inputs) where the head kernel's epilogue reads them, else None."""
        return pol if self.term.epilogue else None

    def policy_share(self, plan: KernelPlan, out, scratch, pol, reduced: bool = False) -> tuple:
        """The policy term's share outside the head kernel: (the head's outputs with the loss that has it,
        its metrics); ``out``: the head's outputs (output.HeadOutputs); ``reduced``: the head kernel's last
        program reduced the per-sequence metrics."""
        return self.term.share(plan, out, scratch, pol, self.sequence_kernels, reduced)


BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, name: str = "logits") -> str:
    """'triton' or 'torch' (plain torch) for tensors on ``device`` of ``dtype``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch":
        return backend
    on_kernel_device = device.type == "cuda" or env.INTERPRETER
    if backend == "triton" and not on_kernel_device:
        raise ValueError("backend: 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if not on_kernel_device:
        return "torch"
    if dtype not in KERNEL_DTYPES:
        if backend == "triton":
            raise TypeError(f"{name}: the Triton kernel takes float32, bfloat16 or float16, got {dtype}")
        return "torch"
    return "triton"


def facts_of(entry: Literal["logits", "hidden"], backend: str, device: torch.device, token_shape: tuple[int, ...],
             given: dict, sharded: bool, sequence_bytes: int = 0, chunk_bytes: int = 0) -> Facts:
    """The Facts of a call (``backend`` resolved; ``given``: its policy inputs by name; the lm_head's
    ``sequence_bytes``: one sequence's logits, against its ``chunk_bytes``)."""
    traced = torch.compiler.is_compiling()
    tensors = [t for t in given.values() if isinstance(t, torch.Tensor)]
    return Facts(
        entry=entry, backend=backend, token_shape=tuple(token_shape),
        sequence_ids=given.get("sequence_ids") is not None, sharded=sharded, traced=traced,
        capturing=not traced and device.type == "cuda" and torch.cuda.is_current_stream_capturing(),
        inputs_want_grad=torch.is_grad_enabled() and any(t.requires_grad for t in tensors),
        sequence_fits=0 < sequence_bytes <= SEQUENCE_CHUNK_SLACK * chunk_bytes,
    )


def routes_for(plan: KernelPlan, facts: Facts) -> tuple[Route, ...]:
    """Every route that can run a call of ``plan`` with ``facts``, the default first (cached; not while
    torch.compile traces, where the plan is a constant of the graph and a lookup keyed by it would
    be guarded)."""
    if facts.traced:
        return _routes(plan, facts)
    key = (plan.key, facts)
    found = _ROUTES.get(key)
    if found is None:
        found = _ROUTES[key] = _routes(plan, facts)
    return found


def choose(plan: KernelPlan, facts: Facts, requested: str | None = None) -> Route:
    """The default route, or the ``requested`` one (an error naming ``route`` when the call cannot
    take it)."""
    options = routes_for(plan, facts)
    if requested is None:
        return options[0]
    if not isinstance(requested, str) or requested not in ROUTES:
        raise ValueError(f"route: expected one of {', '.join(ROUTES)}, got {requested!r}")
    for route in options:
        if route.name == requested:
            return route
    raise ValueError(f"route: {requested!r} cannot run this call; it can run {', '.join(r.name for r in options)}")


_ROUTES: BoundedDict[tuple, tuple[Route, ...]] = cache("routes", 1024, "routes_for's answers by (plan key, facts)")


def _routes(plan: KernelPlan, facts: Facts) -> tuple[Route, ...]:
    pol = plan.spec.policy
    sequences = len(facts.token_shape) == 2 and not facts.sequence_ids and math.prod(facts.token_shape) > 0
    lm_head = facts.entry == "hidden"

    def route(name: str, raw: bool = False, of: KernelPlan = plan) -> Route:
        kind = KINDS[name if name == "torch" or not lm_head else "lm_head:" + name]
        return Route(kind.name, kind.mode, of, kind.term if pol is not None else NO_POLICY, kind.loop,
                     sequences and kind.mode is not Mode.TORCH, raw, facts.traced)

    if facts.backend == "torch":
        return (route("torch"),)
    if plan.mode == "fused":
        return (route("fused", raw=pol is not None and not lm_head),)
    if pol is None:
        return (route("deferred"),)
    # a deferred plan with a policy term
    objective = OBJECTIVES[pol.objective]
    by_kernels = (sequences and objective.row_local and pol.top_entropy_quantile == 1.0
                  and not separate_kl_entropy(pol) and not facts.inputs_want_grad)
    options = []
    if lm_head:
        options += _lm_head_routes(plan, facts, by_kernels, route)
    if by_kernels:
        options.append(route("deferred+kernels", raw=not lm_head))
    options.append(route("deferred+torch"))
    return tuple(options)


def _lm_head_routes(plan: KernelPlan, facts: Facts, by_kernels: bool, route) -> list[Route]:
    """The lm_head's routes that compute a deferred plan's policy gradient in forward: three GEMMs
    (where deferred mode recomputes the logits: four). They need one device, a scalar loss and no
    other reason for deferred mode (per-token outputs with gradient)."""
    spec = plan.spec
    pol = spec.policy
    objective = OBJECTIVES[pol.objective]
    if spec.reduction == "none" or spec.differentiable_outputs or facts.sharded:
        return []
    token_mean_bonus = pol.entropy_coef != 0.0 and pol.entropy_aggregation == "token-mean"
    token_ratios = not IMPORTANCE_SAMPLING[pol.importance_sampling].sequence and pol.off_policy_mask is None
    # a batch statistic that changes a few rows: the base objective fused, those rows corrected (a host read:
    # not under CUDA-graph capture or torch.compile)
    if token_ratios and not facts.capturing and not facts.traced:
        if objective.base is not None and plan.base is not None:
            return [route("covariance", of=plan.base)]
        if objective.row_local and pol.top_entropy_quantile < 1.0 and not token_mean_bonus and plan.base is not None:
            return [route("entropy-guess", of=plan.base)]
    # sequence statistics: chunks of whole sequences
    if (pol.top_entropy_quantile == 1.0 and objective.scope != "batch" and not token_mean_bonus
            and len(facts.token_shape) == 2 and not facts.sequence_ids and facts.sequence_fits):
        return ([route("sequences+kernels")] if by_kernels else []) + [route("sequences+torch")]
    return []
