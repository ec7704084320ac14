"""Sparse teachers for the distillation term: ``Distillation(teacher="topk")`` (the teacher's top-k ids and
log-probs, in verl's, a renormalised or a rest-of-the-vocabulary convention) and ``Distillation(teacher="token")``
(the teacher's log-prob of each target token, verl's ``kl_penalty`` estimators).

Everything is held to the fp64 oracles below (plain torch autograd in float64, row by row, sharing no code with
headloss), which are first held to verl 0.9.1's own functions (the installed package):

* topk "verl"  transcribes ``verl/trainer/distillation/fsdp/losses.py`` (``compute_forward_kl_topk``, lines
  122-130, and ``kl_divergence``, lines 66-72) and the registered loss's ``distillation_losses.clamp_min(0.0)``
  (``verl/trainer/distillation/losses.py`` line 365): per row, lps_k = x[id_k] - lse(x),
  student_mass = sum exp(lps_k), teacher_mass = sum exp(lq_k) (both before the clamp), then with
  ``log_prob_min_clamp`` c both lps and lq clamped below at c, value = max(sum exp(lq_k) (lq_k - lps_k), 0).
* topk "renormalized" and "rest"  TRL 1.16's server distillation (tests/trl_oracle.py, transcribed from
  its source and held to its own functions in tests/test_topk_edges.py): both sides renormalised over the
  present ids, or K + 1 outcomes, the present ids and TRL's tail bucket (1 - the mass, its log clamped at
  -1e-7); forward KL(q || p), reverse KL(p || q), jsd(beta) = beta KL(q || M) + (1 - beta) KL(p || M),
  M = beta q + (1 - beta) p, jsd at beta 0 / 1 the forward / reverse KL.
* token  transcribes ``verl/trainer/ppo/core_algos.py`` ``kl_penalty`` (lines 2188-2213) and
  ``kl_penalty_forward`` (lines 2216-2251), with d = logp - lq: k1 = d, k2 = d^2 / 2, abs = |d|,
  k3 = exp(-d) + d - 1; ``estimator_clamp`` is low_var_kl's clamp of -d to [-20, 20] and of the result to
  [-10, 10]; ``estimator_grad="k2"`` the "+" straight-through: k2 - sg(k2) + sg(estimator).

A row counts when its target is not ignore_index (every row without targets); a -1 id, or a -inf log-prob,
is no entry at all (a -1 id's log-prob is garbage here: 0.0). The loss is the mean over counted rows of
weight * value (+ the CE term); the metrics are means over counted rows.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import trl_oracle
from conftest import assert_close_norm, generator, make_logits, make_targets, needs_kernel, seed_of
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from strategies import CI

import headloss
from headloss import LossSpec, head_loss
from headloss.spec import CrossEntropy, Distillation

F32, BF16 = torch.float32, torch.bfloat16
TOPK_METRICS = ("distill/divergence", "distill/student_mass", "distill/teacher_mass", "distill/top1_agreement")
CE_WEIGHT = 0.5
DISTILL_WEIGHT = 0.8
CLAMP = -4.0  # log_prob_min_clamp: clamps part of the entries at V = 37..300 (student and teacher)

# topk: name -> the Distillation fields of the convention (and divergence)
TOPK_MODES = {
    "verl": dict(topk="verl"),
    "verl_clamp": dict(topk="verl", log_prob_min_clamp=CLAMP),
    "renorm_fwd": dict(topk="renormalized", divergence="forward_kl"),
    "renorm_rev": dict(topk="renormalized", divergence="reverse_kl"),
    "renorm_jsd": dict(topk="renormalized", divergence="jsd", beta=0.3),
    "rest_fwd": dict(topk="rest", divergence="forward_kl"),
    "rest_rev": dict(topk="rest", divergence="reverse_kl"),
    "rest_jsd": dict(topk="rest", divergence="jsd", beta=0.7),
}
# token: name -> the Distillation fields of the estimator
TOKEN_MODES = {
    "k1": dict(estimator="k1"),
    "k2": dict(estimator="k2"),
    "abs": dict(estimator="abs"),
    "k3": dict(estimator="k3"),
    "k3_clamp": dict(estimator="k3", estimator_clamp=True),  # verl's "low_var_kl" / "k3"
    "k3_plus": dict(estimator="k3", estimator_clamp=True, estimator_grad="k2"),  # verl's "k3+"
    "k1_plus": dict(estimator="k1", estimator_grad="k2"),  # verl's "k1+"
}
# verl's kl_penalty names -> ours
VERL_ESTIMATORS = {
    "kl": dict(estimator="k1"),
    "k1": dict(estimator="k1"),
    "abs": dict(estimator="abs"),
    "mse": dict(estimator="k2"),
    "k2": dict(estimator="k2"),
    "low_var_kl": dict(estimator="k3", estimator_clamp=True),
    "k3": dict(estimator="k3", estimator_clamp=True),
    "k3+": dict(estimator="k3", estimator_clamp=True, estimator_grad="k2"),
    "k1+": dict(estimator="k1", estimator_grad="k2"),
    "abs+": dict(estimator="abs", estimator_grad="k2"),
    "low_var_kl+": dict(estimator="k3", estimator_clamp=True, estimator_grad="k2"),
    "k2+": dict(estimator="k2", estimator_grad="k2"),
}

# (value rtol, gradient rtol) by the logits' dtype: values are computed in fp32 from the stored logits; the
# gradient is stored in the logits' dtype
TOLS = {F32: (1e-4, 1e-4), BF16: (1e-2, 2e-2)}
GRAD_ATOL = {F32: 2e-7, BF16: 1e-4}


# --- the fp64 oracles ---------------------------------------------------------------------------------


def _first_argmax(values: torch.Tensor) -> int:
    best = 0
    for i in range(1, values.numel()):
        if float(values[i]) > float(values[best]):
            best = i
    return best


def oracle_topk_row(x: torch.Tensor, ids: torch.Tensor, lq: torch.Tensor, mode: dict) -> dict:
    """One row: x [V] fp64 (in the graph), ids [K] (-1: no entry), lq [K] (upcast here; -inf: no entry).
    Returns the value (a graph tensor) and the three other metrics (floats)."""
    present = (ids >= 0) & (lq.detach().double() > float("-inf"))
    idx = ids[present].long()
    lq_present = lq.detach().double()[present]
    assert idx.numel() > 0, "the oracle takes rows with at least one entry"
    lps = x[idx] - torch.logsumexp(x, 0)
    convention = mode["topk"]
    if convention == "verl":
        # fsdp/losses.py 125-130 (masses before the clamp), losses.py 365 (clamp_min(0))
        clamp = mode.get("log_prob_min_clamp")
        ls, lt = (lps, lq_present) if clamp is None else (lps.clamp_min(clamp), lq_present.clamp_min(clamp))
        value = (lt.exp() * (lt - ls)).sum().clamp_min(0.0)
    else:
        beta = trl_oracle.beta_of(mode.get("divergence", "forward_kl"), mode.get("beta", 0.5))
        value = trl_oracle.token_divergence(x[None], ids[None], lq[None], convention, beta)[0]
    top1 = float(_first_argmax(x.detach()) == int(idx[_first_argmax(lq_present)]))
    return {"value": value, "distill/student_mass": float(lps.detach().exp().sum()),
            "distill/teacher_mass": float(lq_present.exp().sum()), "distill/top1_agreement": top1}


def _counted(targets: torch.Tensor | None, rows: int, ignore_index: int = -100) -> list[int]:
    if targets is None:
        return list(range(rows))
    flat = targets.reshape(-1).tolist()
    return [r for r in range(rows) if flat[r] != ignore_index]


def _ce(x: torch.Tensor, target: int) -> torch.Tensor:
    return torch.logsumexp(x, 0) - x[target]


def oracle_topk(x: torch.Tensor, targets: torch.Tensor | None, ids: torch.Tensor, lq: torch.Tensor, mode: dict, *,
                weight: float = DISTILL_WEIGHT, ce_weight: float | None = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of a top-k teacher on rows x [N, V] fp64 (gradients flow to x): the mean over counted
    rows of weight * value (+ ce_weight * CE), and the four metrics' means over counted rows."""
    n, vocab = x.shape
    ids, lq = ids.reshape(n, -1), lq.reshape(n, -1)
    counted = _counted(targets, n)
    assert counted, "the oracle takes calls with a counted row"
    flat_targets = targets.reshape(-1).tolist() if targets is not None else None
    tokens, sums = [], dict.fromkeys(TOPK_METRICS, 0.0)
    for r in counted:
        row = oracle_topk_row(x[r], ids[r], lq[r], mode)
        token = weight * row["value"]
        if ce_weight is not None and flat_targets is not None:
            token = token + ce_weight * _ce(x[r], flat_targets[r])
        tokens.append(token)
        sums["distill/divergence"] += float(row["value"].detach())
        for name in TOPK_METRICS[1:]:
            sums[name] += row[name]
    loss = torch.stack(tokens).mean()
    return loss, {name: value / len(counted) for name, value in sums.items()}


def oracle_estimator(logp: torch.Tensor, lq: torch.Tensor, estimator: str, clamp: bool = False,
                     grad: str = "estimator") -> tuple[torch.Tensor, torch.Tensor]:
    """(the graph's value, its detached value) of core_algos.kl_penalty{,_forward} for logp (graph) and lq."""
    lq = lq.detach().double()
    if estimator == "k1":
        value = logp - lq
    elif estimator == "k2":
        value = 0.5 * (logp - lq).square()
    elif estimator == "abs":
        value = (logp - lq).abs()
    elif estimator == "k3":
        kl = lq - logp
        if clamp:
            kl = torch.clamp(kl, min=-20, max=20)
        value = kl.exp() - kl - 1
        if clamp:
            value = torch.clamp(value, min=-10, max=10)
    else:
        raise AssertionError(estimator)
    if grad == "k2":
        k2 = 0.5 * (logp - lq).square()
        value = k2 - k2.detach() + value.detach()
    return value, value.detach()


def oracle_token(x: torch.Tensor, targets: torch.Tensor, lq: torch.Tensor, mode: dict, *,
                 weight: float = DISTILL_WEIGHT, ce_weight: float | None = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of a per-token teacher on rows x [N, V] fp64 against targets [N], lq [N]."""
    n = x.shape[0]
    counted = torch.tensor(_counted(targets, n), dtype=torch.long)
    assert counted.numel(), "the oracle takes calls with a counted row"
    y = targets.reshape(-1)[counted].long()
    rows = x[counted]
    logp = torch.log_softmax(rows, -1).gather(-1, y[:, None])[:, 0]
    value, plain = oracle_estimator(logp, lq.reshape(-1)[counted], mode["estimator"],
                                    mode.get("estimator_clamp", False), mode.get("estimator_grad", "estimator"))
    tokens = weight * value
    if ce_weight is not None:
        tokens = tokens - ce_weight * logp
    return tokens.mean(), {"distill/divergence": float(plain.mean())}


# --- inputs ---------------------------------------------------------------------------------------------


def make_topk(student: torch.Tensor, k: int, seed: int, *, lp_dtype=F32, id_dtype=torch.int64, pad: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher_ids [..., K], teacher_logprobs [..., K]) for the rows of ``student`` [..., V]: the log_softmax
    of random teacher logits (correlated with the student: top-1 agreement is neither 0 nor 1) at K distinct
    ids -- the teacher's own top-K in shuffled order for even rows, torch.randperm ids for odd ones. Some rows
    (``pad``, K > 1) have 1..K-1 entries set to -1 (log-prob 0.0, garbage). Kept away from the conventions'
    edges: the student's mass on a row's ids is <= 0.99 where a few draws allow (p_rest not tiny), the
    teacher's <= 0.95 (its log-probs lowered if needed: q_rest > 0 after rounding to ``lp_dtype``)."""
    gen = generator(seed + 4049)
    shape, vocab = student.shape[:-1], student.shape[-1]
    s64 = student.detach().double().reshape(-1, vocab)
    rows = s64.shape[0]
    teacher = 0.4 * s64 + 1.2 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    lq_full = torch.log_softmax(teacher, -1)
    p_full = torch.softmax(s64, -1)
    ids = torch.empty(rows, k, dtype=torch.long)
    for r in range(rows):
        for attempt in range(30):
            if attempt == 0 and r % 2 == 0:
                row = lq_full[r].topk(k).indices[torch.randperm(k, generator=gen)]
            else:
                row = torch.randperm(vocab, generator=gen)[:k]
            if float(p_full[r, row].sum()) <= 0.99:
                break
        ids[r] = row
    lq = lq_full.gather(-1, ids)
    mass = lq.exp().sum(-1, keepdim=True)
    lq = torch.where(mass > 0.95, lq + torch.log(0.95 / mass), lq)
    if pad and k > 1:
        for r in range(rows):
            if float(torch.rand((), generator=gen)) < 0.5:
                n_pad = int(torch.randint(1, k, (), generator=gen))
                where = torch.randperm(k, generator=gen)[:n_pad]
                ids[r, where] = -1
                lq[r, where] = 0.0
    lq = lq.to(lp_dtype)
    kept = torch.where(ids >= 0, lq.double().exp(), 0.0).sum(-1)
    assert float(kept.max()) <= 0.97 and bool((lq <= 0).all())
    return ids.to(id_dtype).reshape(*shape, k), lq.reshape(*shape, k)


def make_token_logprobs(student: torch.Tensor, targets: torch.Tensor, seed: int, *, lp_dtype=F32) -> torch.Tensor:
    """teacher_logprobs shaped like ``targets``: a random teacher's log-prob of each target, where ``student``
    [*targets.shape, V] holds the rows that score them; -7.0 at ignored targets (garbage, never read)."""
    gen = generator(seed + 7001)
    vocab = student.shape[-1]
    s64 = student.detach().double().reshape(-1, vocab)
    teacher = 0.5 * s64 + 1.5 * torch.randn(s64.shape, generator=gen, dtype=torch.float64)
    flat = targets.reshape(-1)
    lq = torch.log_softmax(teacher, -1).gather(-1, flat.clamp(min=0)[:, None])[:, 0]
    lq = torch.where(flat == -100, -7.0, lq)
    return lq.reshape(targets.shape).to(lp_dtype)


def topk_spec(mode: str, *, ce: bool = True, weight: float = DISTILL_WEIGHT) -> LossSpec:
    return LossSpec(cross_entropy=CrossEntropy(weight=CE_WEIGHT) if ce else None,
                    distillation=Distillation(teacher="topk", weight=weight, **TOPK_MODES[mode]))


def token_spec(mode: str, *, ce: bool = True, weight: float = DISTILL_WEIGHT) -> LossSpec:
    return LossSpec(cross_entropy=CrossEntropy(weight=CE_WEIGHT) if ce else None,
                    distillation=Distillation(teacher="token", weight=weight, **TOKEN_MODES[mode]))


# --- comparisons ------------------------------------------------------------------------------------------


def assert_value(got, want: float, rtol: float, name: str) -> None:
    got = float(got)
    atol = rtol * 1e-2
    assert math.isfinite(got), f"{name}: {got}"
    assert abs(got - want) <= rtol * abs(want) + atol, f"{name}: {got!r} != {want!r} (rtol {rtol})"


def assert_matches_oracle(out, want_loss: torch.Tensor, want_metrics: dict, grads: list, dtype) -> None:
    """out.loss, each oracle metric and each (name, got, want) gradient pair."""
    value_rtol, grad_rtol = TOLS[dtype]
    assert out.loss.dim() == 0
    assert_value(out.loss.detach(), float(want_loss.detach()), value_rtol, "loss")
    for name, want in want_metrics.items():
        assert name in out.metrics, f"metric {name} missing from {sorted(out.metrics)}"
        if name == "distill/top1_agreement":
            assert abs(float(out.metrics[name]) - want) <= 1e-6, f"{name}: {float(out.metrics[name])} != {want}"
        else:
            assert_value(out.metrics[name], want, value_rtol, f"metrics[{name}]")
    for name, got, want in grads:
        assert got is not None, f"no gradient reached {name}"
        assert got.shape == want.shape
        assert_close_norm(got, want, rtol=grad_rtol, atol=GRAD_ATOL[dtype], name=f"d loss / d {name}")


def run_logits(backend: str, logits: torch.Tensor, targets, **kwargs):
    """head_loss on a fresh leaf copy of ``logits``; (out, d loss / d logits)."""
    leaf = logits.detach().clone().requires_grad_()
    out = head_loss(leaf, targets, backend=backend, **kwargs)
    out.loss.backward()
    return out, leaf.grad


def oracle_grad(logits: torch.Tensor, fn) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """fn(x64 leaf) -> (loss, metrics); returns them with d loss / d x64."""
    x64 = logits.detach().double().requires_grad_()
    loss, metrics = fn(x64)
    loss.backward()
    return loss, metrics, x64.grad


# --- parametrisation: every (backend, mode) in the fast tier, a pairwise cover of the rest slow ---------


def _pairs(case: tuple) -> set:
    return {(a, case[a], b, case[b]) for a, b in itertools.combinations(range(len(case)), 2)}


def covering(axes: list[list], fast: list[tuple], ids: list[list[str]]) -> list:
    """pytest.params: the ``fast`` index tuples unmarked, then a greedy pairwise cover of the axes'
    product (beyond the pairs ``fast`` covers) marked slow; the triton backend (axis 0) needs the kernel."""
    grid = list(itertools.product(*(range(len(axis)) for axis in axes)))
    pairs = {case: _pairs(case) for case in grid}
    uncovered = set().union(*pairs.values())
    for case in fast:
        uncovered -= pairs[case]
    slow = []
    while uncovered:
        best = max(grid, key=lambda case: len(pairs[case] & uncovered))
        slow.append(best)
        uncovered -= pairs[best]
    params = []
    for case in [*fast, *slow]:
        values = [axes[a][i] for a, i in enumerate(case)]
        marks = ([needs_kernel] if values[0] == "triton" else []) + ([pytest.mark.slow] if case not in fast else [])
        params.append(pytest.param(*values, id="-".join(ids[a][i] for a, i in enumerate(case)), marks=marks))
    return params


BACKENDS = ["torch", "triton"]
# (V, rows, K): an orthogonal array of V x rows x K (every pair of values once)
SHAPES = [(v, n, (1, 4, 8)[(i + j) % 3]) for i, v in enumerate((37, 130, 300)) for j, n in enumerate((1, 5, 17))]
DTYPE_PAIRS = [(F32, F32), (BF16, F32), (F32, BF16), (BF16, BF16)]  # (logits, teacher_logprobs)
DTYPE_IDS = ["fp32", "bf16", "fp32-lp_bf16", "bf16-lp_bf16"]


def _topk_params():
    modes = list(TOPK_MODES)
    axes = [BACKENDS, modes, SHAPES, DTYPE_PAIRS, [True, False], [torch.int64, torch.int32]]
    ids = [BACKENDS, modes, [f"V{v}-N{n}-K{k}" for v, n, k in SHAPES], DTYPE_IDS, ["ce", "no_ce"],
           ["i64", "i32"]]
    fast = [(b, m, (3 * m + 4 * b + 1) % 9, (m + 2 * b) % 4, (m + b) % 2, (m // 2 + b) % 2)
            for b in range(2) for m in range(len(modes))]
    return covering(axes, fast, ids)


def _token_params():
    modes = list(TOKEN_MODES)
    shapes = [(37, 5), (130, 17), (300, 1), (300, 9)]
    axes = [BACKENDS, modes, shapes, DTYPE_PAIRS, [True, False]]
    ids = [BACKENDS, modes, [f"V{v}-N{n}" for v, n in shapes], DTYPE_IDS, ["ce", "no_ce"]]
    fast = [(b, m, (m + b) % 4, (m + 2 * b) % 4, (m + b + 1) % 2) for b in range(2) for m in range(len(modes))]
    return covering(axes, fast, ids)


# --- spec -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, name", [
    (dict(teacher="topk", temperature=2.0), "temperature"),
    (dict(teacher="token", temperature=0.5), "temperature"),
    (dict(teacher="topk", topk="verl", divergence="reverse_kl"), "divergence"),
    (dict(teacher="topk", divergence="jsd"), "divergence"),  # topk defaults to "verl"
    (dict(teacher="topk", topk="renormalized", log_prob_min_clamp=-5.0), "log_prob_min_clamp"),
    (dict(teacher="topk", topk="rest", log_prob_min_clamp=-5.0), "log_prob_min_clamp"),
    (dict(teacher="token", log_prob_min_clamp=-5.0), "log_prob_min_clamp"),
    (dict(teacher="logits", log_prob_min_clamp=-5.0), "log_prob_min_clamp"),
    (dict(teacher="token", divergence="reverse_kl"), "divergence"),
    (dict(teacher="token", divergence="jsd"), "divergence"),
])
def test_inconsistent_sparse_teacher_spec_is_a_validation_error_naming_the_field(fields, name):
    with pytest.raises(ValidationError, match=name):
        Distillation(**fields)
    with pytest.raises(ValueError, match=name):
        LossSpec.model_validate({"distillation": fields})


def test_sparse_teacher_specs_validate_and_round_trip():
    for fields in [*TOPK_MODES.values(), *TOKEN_MODES.values()]:
        teacher = "topk" if "topk" in fields else "token"
        spec = LossSpec(cross_entropy=None, distillation=Distillation(teacher=teacher, **fields))
        assert LossSpec.model_validate(spec.to_dict()) == spec
    assert Distillation().teacher == "logits"


# --- the oracles against verl 0.9.1 ---------------------------------------------------------------------


def _verl_own() -> dict:
    """verl's own top-k step, taken when this module is collected: headloss.integrations.verl.install()
    (which another test of the session may have run) puts headloss's in its place."""
    try:
        from verl.trainer.distillation.fsdp import losses
    except ImportError:
        return {}
    return {"compute_forward_kl_topk": losses.compute_forward_kl_topk}


VERL_OWN = _verl_own()


def _verl_topk_case(k: int, seed: int):
    """Rows [1, 7, 37] (sequences of 3 and 4 rows, verl's thd layout), K distinct ids per row, the teacher's
    log-probs; row 0 a sharp teacher's top-k where the student is low (verl's value > 0 whatever the clamp),
    row 1's teacher below the student on its ids (verl's value < 0 before clamp_min(0))."""
    gen = generator(seed)
    vocab, rows = 37, 7
    x = torch.randn(1, rows, vocab, generator=gen, dtype=torch.float64) * 3
    teacher = 0.4 * x[0] + 1.2 * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    teacher[0] *= 4.0
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(rows)])
    ids[0] = torch.log_softmax(teacher[0], -1).topk(k).indices
    x[0, 0, ids[0]] -= 4.0
    lq = torch.log_softmax(teacher, -1).gather(-1, ids)
    lq[1] = torch.log_softmax(x[0, 1], -1)[ids[1]] - 0.5
    return x, ids, lq


@pytest.mark.parametrize("chunked", [False, True], ids=["log_softmax", "chunked"])
@pytest.mark.parametrize("clamp", [None, -4.0, -2.0])
@pytest.mark.parametrize("k", [1, 5])
def test_verl_topk_oracle_matches_verl_compute_forward_kl_topk(k, clamp, chunked):
    """oracle_topk_row (convention "verl") against verl's fsdp compute_forward_kl_topk (+ the registered
    loss's clamp_min(0)) and kl_divergence on the gathered log-softmax values: value, masses, gradient."""
    pytest.importorskip("verl")
    from types import SimpleNamespace

    fsdp = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    compute_forward_kl_topk = VERL_OWN.get("compute_forward_kl_topk", fsdp.compute_forward_kl_topk)

    x, ids, lq = _verl_topk_case(k, seed_of("verl-topk", k, clamp))
    weights = torch.rand(7, generator=generator(3), dtype=torch.float64) + 0.5
    # verl: nested (jagged) teacher tensors, a config with only what compute_forward_kl_topk reads
    leaf = x.clone().requires_grad_()
    config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=chunked,
                                                               chunked_topk_chunk_size=3))
    nested = [torch.nested.nested_tensor([t[:3], t[3:]], layout=torch.jagged) for t in (lq, ids)]
    out = compute_forward_kl_topk(leaf, nested[0], nested[1], config, "thd")
    verl_values = out["distillation_losses"][0].clamp_min(0.0)  # trainer/distillation/losses.py:365
    (verl_values.double() * weights).sum().backward()
    # the same from kl_divergence on gathered log-softmax values (fsdp/losses.py:122-130)
    leaf2 = x.clone().requires_grad_()
    lps = torch.log_softmax(leaf2[0], -1).gather(-1, ids)
    lps_c, lq_c = (lps, lq) if clamp is None else (lps.clamp_min(clamp), lq.clamp_min(clamp))
    kl_values = fsdp.kl_divergence(log_q=lps_c, log_p=lq_c).clamp_min(0.0)
    # the oracle
    x64 = x[0].clone().requires_grad_()
    mode = dict(topk="verl", log_prob_min_clamp=clamp)
    rows = [oracle_topk_row(x64[r], ids[r], lq[r], mode) for r in range(7)]
    want = torch.stack([row["value"] for row in rows])
    (want * weights).sum().backward()

    for got in (verl_values, kl_values):
        torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["student_mass"][0].double(),
                               torch.tensor([row["distill/student_mass"] for row in rows], dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["teacher_mass"][0].double(),
                               torch.tensor([row["distill/teacher_mass"] for row in rows], dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    assert_close_norm(leaf.grad[0], x64.grad, rtol=1e-5, atol=1e-8, name="grad")
    assert float(want[1].detach()) == 0.0 and float(want[0].detach()) > 0  # clamp_min(0) engaged in row 1 only
    assert float(x64.grad[1].abs().max()) == 0.0


def test_verl_topk_oracle_without_padding_entries_is_verl_on_the_present_entries():
    """A -1 entry takes no part: the oracle on a padded row is verl's kl_divergence on the present entries."""
    fsdp = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    x, ids, lq = _verl_topk_case(5, seed=17)
    padded_ids, padded_lq = ids.clone(), lq.clone()
    padded_ids[:, 1::2], padded_lq[:, 1::2] = -1, 0.0
    for r in range(7):
        keep = padded_ids[r] >= 0
        lps = torch.log_softmax(x[0, r], -1)[ids[r, keep]]
        want = fsdp.kl_divergence(log_q=lps, log_p=lq[r, keep]).clamp_min(0.0)
        got = oracle_topk_row(x[0, r], padded_ids[r], padded_lq[r], dict(topk="verl"))["value"]
        assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)


def test_verl_token_oracle_matches_verl_kl_penalty_value_and_gradient():
    """oracle_estimator against core_algos.kl_penalty for each verl name (mapped to estimator,
    estimator_clamp, estimator_grad), on rows whose lq - logp spans both low_var_kl clamps."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    gen = generator(seed_of("verl-token"))
    deltas = torch.tensor([33.0, 25.0, 5.0, 2.7, 1.0, 0.1, -0.5, -3.0, -15.0, -25.0], dtype=torch.float64)
    rows, vocab = deltas.numel(), 37
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, vocab, (rows,), generator=gen)
    x[:2, :].scatter_(1, y[:2, None], -40.0)  # logp ~ -45 there: lq = logp + 33 / + 25 stays a log-prob
    logp0 = torch.log_softmax(x, -1).gather(-1, y[:, None])[:, 0]
    lq = logp0 + deltas  # lq - logp = delta
    weights = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.5
    for name, mode in VERL_ESTIMATORS.items():
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got_verl = core_algos.kl_penalty(torch.log_softmax(a, -1).gather(-1, y[:, None])[:, 0], lq, name)
        (got_verl * weights).sum().backward()
        value, plain = oracle_estimator(torch.log_softmax(b, -1).gather(-1, y[:, None])[:, 0], lq,
                                        mode["estimator"], mode.get("estimator_clamp", False),
                                        mode.get("estimator_grad", "estimator"))
        (value * weights).sum().backward()
        torch.testing.assert_close(got_verl.detach(), plain, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name} grad: {m}")
    # verl's k3 is always low_var_kl's clamped form; ours without estimator_clamp is not
    unclamped, _ = oracle_estimator(logp0, lq, "k3")
    assert float(unclamped[0]) > 1e10 and float(core_algos.kl_penalty(logp0, lq, "k3")[0]) == 10.0


# --- head_loss against the oracles --------------------------------------------------------------------------


@pytest.mark.parametrize("backend, mode, shape, dtypes, ce, id_dtype", _topk_params())
def test_topk_teacher_matches_oracle(backend, mode, shape, dtypes, ce, id_dtype):
    vocab, rows, k = shape
    dtype, lp_dtype = dtypes
    seed = seed_of("topk", backend, mode, shape, dtypes, ce, id_dtype)
    logits = make_logits((rows, vocab), dtype, seed=seed)
    targets = make_targets((rows,), vocab, seed=seed, ignore_frac=0.3)
    ids, lq = make_topk(logits, k, seed, lp_dtype=lp_dtype, id_dtype=id_dtype)
    spec = topk_spec(mode, ce=ce)
    out, grad = run_logits(backend, logits, targets, spec=spec, teacher_ids=ids, teacher_logprobs=lq)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_topk(
        x, targets, ids, lq, TOPK_MODES[mode], ce_weight=CE_WEIGHT if ce else None))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], dtype)
    assert grad.dtype == dtype
    ignored = targets == -100
    assert bool((grad[ignored] == 0).all()), "an ignored row has a gradient"


@pytest.mark.parametrize("backend, mode, shape, dtypes, ce", _token_params())
def test_token_teacher_matches_oracle(backend, mode, shape, dtypes, ce):
    vocab, rows = shape
    dtype, lp_dtype = dtypes
    seed = seed_of("token", backend, mode, shape, dtypes, ce)
    logits = make_logits((rows, vocab), dtype, seed=seed)
    targets = make_targets((rows,), vocab, seed=seed, ignore_frac=0.3)
    lq = make_token_logprobs(logits, targets, seed, lp_dtype=lp_dtype)
    spec = token_spec(mode, ce=ce)
    out, grad = run_logits(backend, logits, targets, spec=spec, teacher_logprobs=lq)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_token(
        x, targets, lq, TOKEN_MODES[mode], ce_weight=CE_WEIGHT if ce else None))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], dtype)
    assert bool((grad[targets == -100] == 0).all()), "an ignored row has a gradient"


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_token_estimator_clamps_and_straight_through_gradient(backend):
    """Rows where low_var_kl's clamps bite (lq - logp > 20, k3 > 10): with estimator_clamp the value is 10 and
    the gradient 0 there; k3+ keeps that value with k2's gradient; without the clamp k3 is exp(lq - logp)."""
    vocab = 37
    logits = make_logits((4, vocab), F32, seed=5)
    targets = torch.tensor([3, 7, 11, 20])
    logits[0, 3] = logits[1, 7] = -25.0  # logp ~ -30
    logp = torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None])[:, 0]
    lq = torch.stack([logp[0] + 22.0, logp[1] + 4.0, logp[2] - 0.3, logp[3] + 0.2]).clamp(max=0.0).float()
    for mode in ("k3", "k3_clamp", "k3_plus"):
        spec = token_spec(mode, ce=False, weight=1.0)
        out, grad = run_logits(backend, logits, targets, spec=spec, teacher_logprobs=lq)
        loss, metrics, want_grad = oracle_grad(logits, lambda x, m=mode: oracle_token(x, targets, lq, TOKEN_MODES[m],
                                                                                   weight=1.0))
        assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], F32)
        if mode == "k3_clamp":
            assert float(grad[:2].abs().max()) == 0.0  # both clamped at 10: no gradient
        if mode == "k3_plus":
            assert float(grad[:2].abs().max()) > 0.0


@pytest.mark.parametrize("backend, convention", [
    ("torch", "renormalized"), ("torch", "rest"), pytest.param("triton", "rest", marks=needs_kernel),
    pytest.param("triton", "renormalized", marks=[needs_kernel, pytest.mark.slow])])
def test_topk_jsd_at_beta_0_and_1_is_the_forward_and_reverse_kl(backend, convention):
    logits = make_logits((5, 37), F32, seed=9)
    targets = make_targets((5,), 37, seed=9, ignore_frac=0.3)
    ids, lq = make_topk(logits, 4, seed=9)

    def loss(divergence, beta):
        spec = LossSpec(cross_entropy=None, distillation=Distillation(teacher="topk", topk=convention,
                                                                      divergence=divergence, beta=beta))
        return float(head_loss(logits, targets, spec, teacher_ids=ids, teacher_logprobs=lq, backend=backend).loss)

    forward, reverse = loss("forward_kl", 0.5), loss("reverse_kl", 0.5)
    assert loss("jsd", 0.0) == pytest.approx(forward, rel=1e-6, abs=1e-7)
    assert loss("jsd", 1.0) == pytest.approx(reverse, rel=1e-6, abs=1e-7)
    assert forward != pytest.approx(reverse, rel=1e-3)
    want, _ = oracle_topk(logits.double(), targets, ids, lq, dict(topk=convention, divergence="forward_kl"),
                          weight=1.0)
    assert forward == pytest.approx(float(want), rel=1e-4)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_topk_without_targets_counts_every_row(backend):
    logits = make_logits((6, 41), F32, seed=13)
    ids, lq = make_topk(logits, 3, seed=13)
    spec = topk_spec("rest_jsd", ce=False)
    out, grad = run_logits(backend, logits, None, spec=spec, teacher_ids=ids, teacher_logprobs=lq)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_topk(x, None, ids, lq, TOPK_MODES["rest_jsd"]))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], F32)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_padding_entries_and_ignored_rows_take_no_part(backend):
    """Changing a -1 entry's log-prob, or anything of the teacher at an ignored row, changes nothing; the
    teacher_logprobs get no gradient."""
    vocab = 53
    logits = make_logits((5, vocab), F32, seed=21)
    targets = torch.tensor([4, -100, 9, 30, -100])
    ids, lq = make_topk(logits, 6, seed=21, pad=False)
    ids[0, 1] = ids[2, 4] = ids[3, 0] = -1
    lq[0, 1] = lq[2, 4] = lq[3, 0] = 0.0
    lq = lq.requires_grad_()
    other_ids, other_lq = ids.clone(), lq.detach().clone()
    other_lq[0, 1], other_lq[2, 4], other_lq[3, 0] = -0.01, -3.0, -50.0
    other_ids[1] = torch.arange(6)
    other_lq[1] = torch.log_softmax(torch.zeros(vocab), 0)[:6]
    other_lq[4] = -20.0
    for mode in ("verl_clamp", "renorm_jsd", "rest_rev"):
        spec = topk_spec(mode)
        a, grad_a = run_logits(backend, logits, targets, spec=spec, teacher_ids=ids, teacher_logprobs=lq)
        b, grad_b = run_logits(backend, logits, targets, spec=spec, teacher_ids=other_ids, teacher_logprobs=other_lq)
        assert torch.equal(a.loss.detach(), b.loss.detach()), mode
        for name in TOPK_METRICS:
            assert float(a.metrics[name]) == float(b.metrics[name]), (mode, name)
        assert torch.equal(grad_a, grad_b), mode
        assert lq.grad is None
        loss, metrics, want_grad = oracle_grad(logits, lambda x, m=mode: oracle_topk(
            x, targets, ids, lq, TOPK_MODES[m], ce_weight=CE_WEIGHT))
        assert_matches_oracle(a, loss, metrics, [("logits", grad_a, want_grad)], F32)


# --- the fused lm_head --------------------------------------------------------------------------------------


def _linear_params():
    """(backend, mode, dtype); no clamp with bf16 (the chunk logits rounded to bf16 move entries across it)."""
    fast = [("torch", "renorm_jsd", F32), ("triton", "verl_clamp", F32), ("triton", "token_k3_plus", F32)]
    slow = [("torch", "verl_clamp", F32), ("torch", "rest_rev", BF16), ("triton", "rest_rev", F32),
            ("triton", "rest_fwd", BF16), ("triton", "renorm_jsd", BF16), ("torch", "token_abs", BF16),
            ("triton", "token_abs", F32), ("torch", "token_k3_plus", F32), ("triton", "verl", BF16),
            ("torch", "verl", F32)]
    return [pytest.param(b, m, d, id=f"{b}-{m}-{'fp32' if d == F32 else 'bf16'}",
                         marks=([needs_kernel] if b == "triton" else []) + ([] if (b, m, d) in fast
                                                                           else [pytest.mark.slow]))
            for b, m, d in fast + slow]


@pytest.mark.parametrize("backend, mode, dtype", _linear_params())
def test_linear_head_loss_matches_oracle_on_hidden_times_weight(backend, mode, dtype):
    rows, hidden_size, vocab, k = 7, 16, 130, 5
    seed = seed_of("linear", backend, mode, dtype)
    gen = generator(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * 0.75).to(dtype)
    targets = make_targets((rows,), vocab, seed=seed, ignore_frac=0.3)
    logits64 = hidden.double() @ weight.double().T
    if mode.startswith("token_"):
        token_mode = mode[len("token_"):]
        spec = token_spec(token_mode)
        teacher = dict(teacher_logprobs=make_token_logprobs(logits64, targets, seed))
        oracle = lambda x: oracle_token(x, targets, teacher["teacher_logprobs"], TOKEN_MODES[token_mode],  # noqa: E731
                                        ce_weight=CE_WEIGHT)
    else:
        spec = topk_spec(mode)
        ids, lq = make_topk(logits64, k, seed)
        teacher = dict(teacher_ids=ids, teacher_logprobs=lq)
        oracle = lambda x: oracle_topk(x, targets, ids, lq, TOPK_MODES[mode], ce_weight=CE_WEIGHT)  # noqa: E731
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # 3 rows per chunk: the teacher's rows go with their chunk
    out = headloss.linear_head_loss(h, w, targets, spec, backend=backend, chunk_bytes=3 * vocab * 4, **teacher)
    out.loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss, metrics = oracle(h64 @ w64.T)
    loss.backward()
    value_rtol, grad_rtol = TOLS[dtype]
    if dtype == BF16:  # the chunk logits are rounded to bf16 after the GEMM (tests/test_linear.py's TOLS)
        value_rtol, grad_rtol = 1e-2, 3e-2
    assert_value(out.loss.detach(), float(loss.detach()), value_rtol, "loss")
    for name, want in metrics.items():
        if name == "distill/top1_agreement" and dtype == BF16:  # the argmax of the bf16-rounded chunk logits
            assert 0.0 <= float(out.metrics[name]) <= 1.0
            continue
        assert_value(out.metrics[name], want, value_rtol, f"metrics[{name}]")
    for name, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        assert got is not None and got.dtype == dtype, name
        assert_close_norm(got, want, rtol=grad_rtol, atol=GRAD_ATOL[dtype], name=f"d loss / d {name}")


# --- next-token rows: shift=True on [B, T, V] and packed sequences ----------------------------------------


@pytest.mark.parametrize("backend, mode", [
    ("torch", "rest_jsd"), pytest.param("triton", "verl_clamp", marks=needs_kernel),
    *[pytest.param(b, m, marks=[pytest.mark.slow] + ([needs_kernel] if b == "triton" else []))
      for b in BACKENDS for m in TOPK_MODES if (b, m) not in (("torch", "rest_jsd"), ("triton", "verl_clamp"))],
])
def test_shift_topk_rows_are_the_logits_rows(backend, mode):
    """logits [B, T, V], HF labels [B, T]: row t is scored against labels[:, t + 1] with the top-k of row t;
    the last row of each sequence is not scored (gradient 0)."""
    batch, length, vocab, k = 2, 6, 37, 4
    seed = seed_of("shift", backend, mode)
    logits = make_logits((batch, length, vocab), F32, seed=seed)
    labels = make_targets((batch, length), vocab, seed=seed, ignore_frac=0.25)
    ids, lq = make_topk(logits, k, seed)
    out, grad = run_logits(backend, logits, labels, spec=topk_spec(mode), teacher_ids=ids, teacher_logprobs=lq,
                           shift=True)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_topk(
        x[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ids[:, :-1], lq[:, :-1], TOPK_MODES[mode],
        ce_weight=CE_WEIGHT))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], F32)
    assert float(grad[:, -1].abs().max()) == 0.0


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_shift_token_teacher_with_completion_ids(backend):
    """logits [B, T, V], completion ids [B, T - 1] (row t against ids[:, t]), teacher_logprobs shaped like the
    ids: the teacher's log-prob of ids[:, t] (the token row t scores)."""
    batch, length, vocab = 2, 5, 37
    logits = make_logits((batch, length, vocab), F32, seed=31)
    ids = make_targets((batch, length - 1), vocab, seed=31, ignore_frac=0.25)
    lq = make_token_logprobs(logits[:, :-1], ids, seed=31)
    out, grad = run_logits(backend, logits, ids, spec=token_spec("k3_plus"), teacher_logprobs=lq, shift=True)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_token(
        x[:, :-1].reshape(-1, vocab), ids.reshape(-1), lq.reshape(-1), TOKEN_MODES["k3_plus"], ce_weight=CE_WEIGHT))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], F32)
    assert float(grad[:, -1].abs().max()) == 0.0


@pytest.mark.parametrize("backend, mode, offsets", [
    ("torch", "renorm_rev", [0, 3, 7]),
    pytest.param("triton", "rest_fwd", [0, 3, 7], marks=needs_kernel),
    pytest.param("torch", "verl_clamp", [0, 1, 1, 5, 9], marks=pytest.mark.slow),
    pytest.param("triton", "renorm_jsd", [0, 1, 1, 5, 9], marks=[needs_kernel, pytest.mark.slow]),
    pytest.param("triton", "verl", [0, 4, 4, 9], marks=[needs_kernel, pytest.mark.slow]),
])
def test_packed_shift_topk_is_the_oracle_per_sequence(backend, mode, offsets):
    """[N, V] rows holding sequences at cu_seqlens, shift=True: row i of a sequence is scored against
    targets[i + 1] of the same sequence with the top-k of row i; each sequence's last row is not scored."""
    rows, vocab, k = offsets[-1], 37, 4
    seed = seed_of("packed", backend, mode, offsets)
    logits = make_logits((rows, vocab), F32, seed=seed)
    targets = make_targets((rows,), vocab, seed=seed, ignore_frac=0.2)
    ids, lq = make_topk(logits, k, seed)
    cu = torch.tensor(offsets, dtype=torch.int32)
    scored, scored_targets = [], []
    for start, end in zip(offsets[:-1], offsets[1:]):
        for i in range(start, end - 1):
            scored.append(i)
            scored_targets.append(int(targets[i + 1]))
    assert any(t != -100 for t in scored_targets)
    scored_t = torch.tensor(scored)
    out, grad = run_logits(backend, logits, targets, spec=topk_spec(mode), teacher_ids=ids, teacher_logprobs=lq,
                           shift=True, cu_seqlens=cu)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_topk(
        x[scored_t], torch.tensor(scored_targets), ids[scored_t], lq[scored_t], TOPK_MODES[mode],
        ce_weight=CE_WEIGHT))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], F32)
    last = torch.tensor([end - 1 for start, end in zip(offsets[:-1], offsets[1:]) if end > start])
    assert float(grad[last].abs().max()) == 0.0


# --- bad input ---------------------------------------------------------------------------------------------


def _bad_case():
    logits = make_logits((2, 3, 11), F32, seed=0)
    targets = make_targets((2, 3), 11, seed=0)
    ids, lq = make_topk(logits, 4, seed=0, pad=False)
    token_lq = make_token_logprobs(logits, targets, seed=0)
    return logits, targets, ids, lq, token_lq


def _bad_inputs():
    """name -> (the spec's teacher, keyword arguments given a case, the error's pattern)."""
    return {
        "lp_last_dim_differs": ("topk", lambda c: dict(teacher_ids=c["ids"], teacher_logprobs=c["lq"][..., :3]),
                                "teacher_logprobs|teacher_ids"),
        "ids_last_dim_differs": ("topk", lambda c: dict(teacher_ids=c["ids"][..., :3], teacher_logprobs=c["lq"]),
                                 "teacher_logprobs|teacher_ids"),
        "ids_rows_differ": ("topk", lambda c: dict(teacher_ids=c["ids"][:, :2], teacher_logprobs=c["lq"][:, :2]),
                            "teacher_ids"),
        "ids_flat_rows": ("topk", lambda c: dict(teacher_ids=c["ids"].reshape(6, 4),
                                                 teacher_logprobs=c["lq"].reshape(6, 4)), "teacher_ids"),
        "ids_without_k": ("topk", lambda c: dict(teacher_ids=c["ids"][..., 0], teacher_logprobs=c["lq"][..., 0]),
                          "teacher_ids"),
        "teacher_logits_instead": ("topk", lambda c: dict(teacher_logits=c["logits"].clone()),
                                   "teacher_logits|teacher_ids"),
        "teacher_logits_as_well": ("topk", lambda c: dict(teacher_logits=c["logits"].clone(), teacher_ids=c["ids"],
                                                          teacher_logprobs=c["lq"]), "teacher_logits"),
        "no_teacher_ids": ("topk", lambda c: dict(teacher_logprobs=c["lq"]), "teacher_ids"),
        "no_teacher_logprobs": ("topk", lambda c: dict(teacher_ids=c["ids"]), "teacher_logprobs"),
        "no_teacher": ("topk", lambda c: {}, "teacher_ids|teacher_logprobs"),
        "token_with_ids": ("token", lambda c: dict(teacher_ids=c["ids"], teacher_logprobs=c["token_lq"]),
                           "teacher_ids"),
        "token_without_logprobs": ("token", lambda c: {}, "teacher_logprobs"),
        "token_logprobs_shape": ("token", lambda c: dict(teacher_logprobs=c["token_lq"][:, :2]), "teacher_logprobs"),
        "token_teacher_logits": ("token", lambda c: dict(teacher_logprobs=c["token_lq"],
                                                         teacher_logits=c["logits"].clone()), "teacher_logits"),
        "dense_spec_with_ids": ("logits", lambda c: dict(teacher_logits=c["logits"].clone(), teacher_ids=c["ids"],
                                                         teacher_logprobs=c["lq"]), "teacher_ids|teacher_logprobs"),
        "no_distillation_with_ids": (None, lambda c: dict(teacher_ids=c["ids"], teacher_logprobs=c["lq"]),
                                     "teacher_ids|teacher_logprobs"),
    }


def _spec_for(teacher: str | None) -> LossSpec:
    if teacher is None:
        return LossSpec()
    if teacher == "topk":
        return topk_spec("rest_jsd")
    if teacher == "token":
        return token_spec("k3")
    return LossSpec(distillation=Distillation())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_teacher_input_is_an_error_naming_the_argument(case, backend):
    logits, targets, ids, lq, token_lq = _bad_case()
    teacher, kwargs, pattern = _bad_inputs()[case]
    given = kwargs(dict(logits=logits, ids=ids, lq=lq, token_lq=token_lq))
    with pytest.raises(ValueError, match=pattern):
        head_loss(logits, targets, _spec_for(teacher), backend=backend, **given)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bool], ids=["float", "int16", "bool"])
def test_teacher_ids_of_a_wrong_dtype_is_an_error_naming_it(dtype, backend):
    logits, targets, ids, lq, _ = _bad_case()
    with pytest.raises((TypeError, ValueError), match="teacher_ids"):
        head_loss(logits, targets, topk_spec("verl"), teacher_ids=ids.to(dtype), teacher_logprobs=lq,
                  backend=backend)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize("teacher", ["topk", "token"])
def test_integer_teacher_logprobs_is_an_error_naming_it(teacher, backend):
    logits, targets, ids, lq, token_lq = _bad_case()
    given = dict(teacher_ids=ids, teacher_logprobs=lq.long()) if teacher == "topk" else \
        dict(teacher_logprobs=token_lq.long())
    with pytest.raises((TypeError, ValueError), match="teacher_logprobs"):
        head_loss(logits, targets, _spec_for(teacher), backend=backend, **given)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
@pytest.mark.parametrize("what, name", [
    ("id_is_V", "teacher_ids"), ("id_below_minus_1", "teacher_ids"), ("id_far_above", "teacher_ids"),
    ("logprob_positive", "teacher_logprobs"), ("logprob_nan", "teacher_logprobs"),
    ("token_logprob_positive", "teacher_logprobs"), ("token_logprob_nan", "teacher_logprobs"),
])
def test_bad_teacher_values_are_an_error_naming_the_argument_with_validate_sync(what, name, backend):
    logits, targets, ids, lq, token_lq = _bad_case()
    ids, lq, token_lq = ids.clone(), lq.clone(), token_lq.clone()
    assert int(targets[0, 0]) != -100  # the bad value sits in a counted row, at a present entry
    edits = {
        "id_is_V": lambda: ids.__setitem__((0, 0, 1), 11),
        "id_below_minus_1": lambda: ids.__setitem__((0, 0, 1), -2),
        "id_far_above": lambda: ids.__setitem__((0, 0, 1), 10_000),
        "logprob_positive": lambda: lq.__setitem__((0, 0, 2), 0.5),
        "logprob_nan": lambda: lq.__setitem__((0, 0, 2), math.nan),
        "token_logprob_positive": lambda: token_lq.__setitem__((0, 0), 0.25),
        "token_logprob_nan": lambda: token_lq.__setitem__((0, 0), math.nan),
    }
    edits[what]()
    if what.startswith("token"):
        spec, given = token_spec("k2"), dict(teacher_logprobs=token_lq)
    else:
        spec, given = topk_spec("verl"), dict(teacher_ids=ids, teacher_logprobs=lq)
    with pytest.raises(ValueError, match=name):
        head_loss(logits, targets, spec, backend=backend, validate="sync", **given)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernel)])
def test_linear_head_loss_bad_teacher_input_names_the_argument(backend):
    gen = generator(1)
    hidden, weight = torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)
    targets = make_targets((6,), 11, seed=1)
    ids, lq = make_topk(hidden @ weight.T, 3, seed=1, pad=False)
    with pytest.raises(ValueError, match="teacher_ids"):
        headloss.linear_head_loss(hidden, weight, targets, topk_spec("verl"), teacher_logprobs=lq, backend=backend)
    with pytest.raises(ValueError, match="teacher_logprobs|teacher_ids"):
        headloss.linear_head_loss(hidden, weight, targets, topk_spec("verl"), teacher_ids=ids,
                                  teacher_logprobs=lq[:, :2], backend=backend)
    with pytest.raises(ValueError, match="teacher_ids"):
        headloss.linear_head_loss(hidden, weight, targets, token_spec("k3"), teacher_ids=ids,
                                  teacher_logprobs=lq[:, 0], backend=backend)


# --- hypothesis: random conventions, divergences, shapes and padding on the torch path ---------------------


@st.composite
def topk_cases(draw):
    convention = draw(st.sampled_from(["verl", "renormalized", "rest"]))
    mode = dict(topk=convention)
    if convention == "verl":
        clamp = draw(st.none() | st.floats(-8.0, -0.5))
        if clamp is not None:
            mode["log_prob_min_clamp"] = clamp
    else:
        mode["divergence"] = draw(st.sampled_from(["forward_kl", "reverse_kl", "jsd"]))
        mode["beta"] = draw(st.sampled_from([0.0, 1.0]) | st.floats(0.05, 0.95))
    k = draw(st.integers(1, 8))
    return dict(
        mode=mode, k=k, vocab=draw(st.integers(2 * k + 4, 300)), rows=draw(st.integers(1, 9)),
        pad=draw(st.booleans()), ignore_frac=draw(st.sampled_from([0.0, 0.4])), ce=draw(st.booleans()),
        weight=draw(st.floats(0.1, 2.0)), dtype=draw(st.sampled_from([F32, BF16])),
        lp_dtype=draw(st.sampled_from([F32, BF16])), scale=draw(st.floats(0.5, 3.0)), seed=draw(st.integers(0, 10_000)),
    )


@CI
@given(case=topk_cases())
def test_random_topk_cases_match_oracle_on_the_torch_path(case):
    logits = make_logits((case["rows"], case["vocab"]), case["dtype"], seed=case["seed"], scale=case["scale"])
    targets = make_targets((case["rows"],), case["vocab"], seed=case["seed"], ignore_frac=case["ignore_frac"])
    ids, lq = make_topk(logits, case["k"], case["seed"], lp_dtype=case["lp_dtype"], pad=case["pad"])
    spec = LossSpec(cross_entropy=CrossEntropy(weight=CE_WEIGHT) if case["ce"] else None,
                    distillation=Distillation(teacher="topk", weight=case["weight"], **case["mode"]))
    out, grad = run_logits("torch", logits, targets, spec=spec, teacher_ids=ids, teacher_logprobs=lq)
    loss, metrics, want_grad = oracle_grad(logits, lambda x: oracle_topk(
        x, targets, ids, lq, case["mode"], weight=case["weight"], ce_weight=CE_WEIGHT if case["ce"] else None))
    assert_matches_oracle(out, loss, metrics, [("logits", grad, want_grad)], case["dtype"])


# --- the alignment of a per-token teacher with HF labels, and repeated ids ------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_teacher_with_hf_labels_is_row_aligned(backend):
    """shift=True with HF labels [B, T]: teacher_logprobs[b, t] belongs to row t, scored against
    labels[b, t + 1] (as the policy inputs are aligned); the same call without shift on the first
    T - 1 rows gives the same loss and gradient there (zero on the last row)."""
    gen = torch.Generator().manual_seed(11)
    b, t, v = 2, 5, 37
    logits = torch.randn(b, t, v, generator=gen) * 2
    labels = torch.randint(0, v, (b, t), generator=gen)
    labels[1, 3] = -100
    lq = -torch.rand(b, t, generator=gen) * 3 - 0.1
    spec = LossSpec(distillation={"teacher": "token", "estimator": "k3"})
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    shifted = head_loss(x1, labels, spec, shift=True, teacher_logprobs=lq, backend=backend)
    sliced = head_loss(x2[:, :-1], labels[:, 1:], spec, teacher_logprobs=lq[:, :-1], backend=backend)
    shifted.loss.backward()
    sliced.loss.backward()
    torch.testing.assert_close(shifted.loss, sliced.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
    assert torch.all(x1.grad[:, -1] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_id_twice_in_a_row_is_refused_with_validate_sync(backend):
    logits = torch.randn(3, 20)
    ids = torch.tensor([[1, 2, 3], [4, 4, -1], [5, 6, 7]])
    lp = -torch.rand(3, 3) - 0.1
    spec = LossSpec(distillation={"teacher": "topk"})
    with pytest.raises(ValueError, match=r"teacher_ids: the id 4 at row 1, entry 1 repeats an earlier entry"):
        head_loss(logits, torch.zeros(3, dtype=torch.long), spec, teacher_ids=ids, teacher_logprobs=lp,
                  backend=backend, validate="sync")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_head_loss_under_autocast_keeps_the_sparse_teacher(backend):
    """Under torch.autocast the lm_head's GEMMs run in the autocast dtype; the top-k teacher is passed
    on as it is (the same call on bf16 operands gives the same loss and gradients)."""
    gen = torch.Generator().manual_seed(12)
    hidden, weight = torch.randn(6, 16, generator=gen), torch.randn(40, 16, generator=gen) / 4
    ids = torch.stack([torch.randperm(40, generator=gen)[:5] for _ in range(6)])
    lp = -torch.rand(6, 5, generator=gen) * 3 - 0.1
    spec = LossSpec(distillation={"teacher": "topk", "topk": "renormalized"})
    targets = torch.randint(0, 40, (6,), generator=gen)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = headloss.linear_head_loss(h1, w1, targets, spec, teacher_ids=ids, teacher_logprobs=lp,
                                        backend=backend)
    got.loss.backward()
    h2, w2 = hidden.to(torch.bfloat16).requires_grad_(), weight.to(torch.bfloat16).requires_grad_()
    want = headloss.linear_head_loss(h2, w2, targets, spec, teacher_ids=ids, teacher_logprobs=lp, backend=backend)
    want.loss.backward()
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(h1.grad, h2.grad.float())
    assert h1.grad.dtype == torch.float32


@pytest.mark.parametrize("entry", ["head_loss", "linear_head_loss"])
@pytest.mark.parametrize("what", ["id", "logprob", "token"])
def test_bad_teacher_values_are_found_on_the_device_with_the_default_validation(entry, what):
    """The kernel path's default (asynchronous) validation checks a sparse teacher's values on the device
    (kernels.sparse.check_teacher_kernel): on CPU tensors the error is raised in the call, naming the
    argument and the entry; a log-prob behind a -1 id is not read."""
    gen = torch.Generator().manual_seed(13)
    x, targets = torch.randn(4, 30, generator=gen), torch.randint(0, 30, (4,), generator=gen)
    ids = torch.tensor([[1, 2, 3], [4, 5, -1], [6, 7, 8], [9, 10, 11]])
    lp = -torch.rand(4, 3, generator=gen)
    lp[1, 2] = float("nan")  # behind a -1: not read
    kwargs = dict(teacher_ids=ids, teacher_logprobs=lp)
    spec = LossSpec(distillation={"teacher": "topk"})
    if what == "id":
        ids[2, 1] = 30
        match = r"teacher_ids: the id at row 2, entry 1 is outside \[0, 30\)"
    elif what == "logprob":
        lp[3, 0] = 0.25
        match = r"teacher_logprobs: the value at row 3, entry 0 is not a log-probability"
    else:
        spec = LossSpec(distillation={"teacher": "token"})
        kwargs = dict(teacher_logprobs=torch.tensor([-1.0, float("nan"), -2.0, -0.5]))
        match = r"teacher_logprobs: the value at position \(1,\) is not a log-probability"
    with pytest.raises(ValueError, match=match):
        if entry == "head_loss":
            head_loss(x, targets, spec, backend="triton", **kwargs)
        else:
            headloss.linear_head_loss(torch.randn(4, 8, generator=gen), torch.randn(30, 8, generator=gen), targets,
                                      spec, backend="triton", **kwargs)
    ids[2, 1], lp[3, 0] = 7, -0.25  # the same call with good values runs
    if what != "token":
        head_loss(x, targets, LossSpec(distillation={"teacher": "topk"}), backend="triton", teacher_ids=ids,
                  teacher_logprobs=lp)


@pytest.mark.parametrize("name,want", [
    ("kl", ("k1", False, "estimator")), ("mse", ("k2", False, "estimator")), ("low_var_kl", ("k3", True, "estimator")),
    ("k3+", ("k3", True, "k2")), ("low_var_kl+", ("k3", True, "k2")), ("abs+", ("abs", False, "k2")),
    ("k3", ("k3", False, "estimator")), ("k2", ("k2", False, "estimator")),
])
def test_the_estimator_takes_verls_names(name, want):
    """verl's kl_penalty names map to headloss's estimator fields (verl's k3 is clamped, so its '+' form
    is too); headloss's own k1, k2, k3, abs keep their meaning."""
    d = Distillation(teacher="token", estimator=name)
    assert (d.estimator, d.estimator_clamp, d.estimator_grad) == want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("teacher", ["topk", "token"])
@pytest.mark.parametrize("importance_sampling", ["token", pytest.param("sequence", marks=pytest.mark.slow)])
def test_a_sparse_teacher_beside_the_policy_term_equals_the_sum_of_the_two(backend, teacher, importance_sampling):
    """On-policy distillation: the policy objective (fused epilogue, or deferred sequence ratios) and a
    sparse teacher's term in one call give the sum of the two calls' losses and gradients."""
    gen = torch.Generator().manual_seed(14)
    b, t, v = 2, 6, 40
    logits = torch.randn(b, t, v, generator=gen) * 2
    ids = torch.randint(0, v, (b, t), generator=gen)
    policy = dict(advantages=torch.randn(b, generator=gen), old_logprobs=-torch.rand(b, t, generator=gen) * 3)
    if teacher == "topk":
        top = torch.log_softmax(torch.randn(b, t, v, generator=gen), -1).topk(5, dim=-1)
        sparse = dict(teacher_ids=top.indices, teacher_logprobs=top.values)
        dist = {"teacher": "topk", "topk": "rest"}
    else:
        sparse = dict(teacher_logprobs=-torch.rand(b, t, generator=gen) * 3)
        dist = {"teacher": "token", "estimator": "k3"}
    pol = {"loss_type": "dapo", "importance_sampling": importance_sampling}
    both = LossSpec(cross_entropy=None, policy=pol, distillation={**dist, "weight": 0.7})
    alone = [LossSpec(cross_entropy=None, policy=pol),
             LossSpec(cross_entropy=None, distillation={**dist, "weight": 0.7})]
    x = logits.clone().requires_grad_()
    out = head_loss(x, ids, both, backend=backend, **policy, **sparse)
    out.loss.backward()
    parts = []
    for spec, kwargs in zip(alone, (policy, sparse)):
        leaf = logits.clone().requires_grad_()
        part = head_loss(leaf, ids, spec, backend=backend, **kwargs)
        part.loss.backward()
        parts.append((part.loss.detach(), leaf.grad))
    torch.testing.assert_close(out.loss.detach(), parts[0][0] + parts[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, parts[0][1] + parts[1][1], rtol=1e-4, atol=1e-6)
