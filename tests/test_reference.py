"""``reference_head_loss`` against an independent oracle: the spec's formulas in plain Python floats.

The oracle below uses only ``math`` on Python floats (fsum for every sum) and the closed-form
gradients of each term; it shares no code with the reference (log_softmax, F.cross_entropy,
autograd). The reference is then the fp64 oracle for the kernel tests.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ALL_OUTPUTS, make_logits, make_targets, seed_of, with_

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss
from headloss.reference import reference_head_loss


def oracle(logits: torch.Tensor, targets, spec: LossSpec, num_items=None, upstream=None) -> dict:
    """Values and d objective / d logits from the formulas, row by row in Python floats.

    ``upstream`` maps "loss" to a float (or per-token list for reduction none) and optionally
    "logprobs"/"entropy"/"lse"/"token_loss" to per-token lists: the objective is
    sum(upstream[name] * value[name]).
    """
    vocab = logits.shape[-1]
    rows = logits.detach().double().reshape(-1, vocab).tolist()
    n = len(rows)
    ys = targets.reshape(-1).tolist() if targets is not None else [None] * n
    t = spec.transform
    ce_term, z_term, h_term = spec.cross_entropy, spec.z_loss, spec.entropy
    eps = ce_term.label_smoothing if ce_term else 0.0
    w_ce = ce_term.weight if ce_term else 0.0
    w_z = z_term.weight if z_term else 0.0
    w_h = h_term.weight if h_term else 0.0

    def transform(z):
        u = t.logit_scale * z
        if t.softcap is not None:
            u = t.softcap * math.tanh(u / t.softcap)
        return u / t.temperature

    def slope(z):
        if t.softcap is None:
            return t.logit_scale / t.temperature
        return t.logit_scale * (1.0 - math.tanh(t.logit_scale * z / t.softcap) ** 2) / t.temperature

    out = {name: [] for name in ("valid", "lse", "logprobs", "ce", "z", "entropy", "token_loss", "pred")}
    row_grads = []  # per row: d value / d z for each value, as lists over the vocabulary
    for zs, y in zip(rows, ys):
        valid = y is None or y != spec.ignore_index
        x = [transform(z) for z in zs]
        m = max(x)
        lse = m + math.log(math.fsum(math.exp(xi - m) for xi in x))
        p = [math.exp(xi - lse) for xi in x]
        entropy = -math.fsum(pi * (xi - lse) for pi, xi in zip(p, x) if pi > 0)
        pred = x.index(m)
        yy = y if (y is not None and valid) else None
        logp = x[yy] - lse if yy is not None else 0.0
        ce = 0.0
        if ce_term and yy is not None:
            ce = lse - x[yy]
            if eps > 0:
                ce = (1 - eps) * ce + eps * (lse - math.fsum(x) / vocab)
        token_loss = w_ce * ce + w_z * lse**2 + w_h * entropy
        onehot = [1.0 if i == yy else 0.0 for i in range(vocab)]
        chain = [slope(z) for z in zs]
        d_ce = [pi - (1 - eps) * oi - eps / vocab for pi, oi in zip(p, onehot)]
        d_lse = list(p)
        d_h = [-pi * (xi - lse + entropy) if pi > 0 else 0.0 for pi, xi in zip(p, x)]
        d_logp = [oi - pi for oi, pi in zip(onehot, p)]
        d_tl = [w_ce * a + w_z * 2 * lse * b + w_h * c for a, b, c in zip(d_ce, d_lse, d_h)]
        grads = {
            "token_loss": d_tl, "logprobs": d_logp, "entropy": d_h, "lse": d_lse,
        }
        row_grads.append({k: [g * c for g, c in zip(v, chain)] if valid else [0.0] * vocab
                          for k, v in grads.items()})
        out["valid"].append(valid)
        out["lse"].append(lse if valid else 0.0)
        out["logprobs"].append(logp)
        out["ce"].append(ce if valid else 0.0)
        out["z"].append(lse**2 if valid else 0.0)
        out["entropy"].append(entropy if valid else 0.0)
        out["token_loss"].append(token_loss if valid else 0.0)
        out["pred"].append(pred if valid else -1)

    n_valid = sum(out["valid"])
    count = max(n_valid, 1)
    total = math.fsum(out["token_loss"])
    if spec.reduction == "none":
        loss = list(out["token_loss"])
        d_token = list((upstream or {}).get("loss", [1.0] * n))
    else:
        denom = 1.0 if spec.reduction == "sum" else (float(num_items) if num_items is not None else count)
        loss = total / denom
        d_token = [(upstream or {}).get("loss", 1.0) / denom] * n
    metrics = {"loss": math.fsum(loss) if spec.reduction == "none" else loss, "n_tokens": n_valid}
    if ce_term:
        metrics["ce"] = math.fsum(out["ce"]) / count
        if eps > 0:
            metrics["nll"] = -math.fsum(out["logprobs"]) / count
    if z_term:
        metrics["z_loss"] = math.fsum(out["z"]) / count
    if h_term:
        metrics["entropy"] = math.fsum(out["entropy"]) / count
    if spec.token_accuracy:
        hits = [v and p == y for v, p, y in zip(out["valid"], out["pred"], ys)]
        metrics["token_accuracy"] = sum(hits) / count

    grad = []
    for r in range(n):
        g = [d_token[r] * v for v in row_grads[r]["token_loss"]]
        for name in ("logprobs", "entropy", "lse", "token_loss"):
            if upstream and name in upstream:
                g = [a + upstream[name][r] * b for a, b in zip(g, row_grads[r][name])]
        grad.append(g)
    return {
        "loss": loss, "metrics": metrics, "grad": grad,
        "predicted_tokens": out["pred"], "logprobs": out["logprobs"], "lse": out["lse"],
        "token_loss": out["token_loss"], "entropy": out["entropy"],
    }


SPECS = {
    "plain_ce": LossSpec(),
    "ce_smoothing": LossSpec(cross_entropy=CrossEntropy(weight=0.7, label_smoothing=0.15)),
    "full_smoothing": LossSpec(cross_entropy=CrossEntropy(label_smoothing=1.0)),
    "z_loss_and_entropy_regulariser": LossSpec(z_loss=ZLoss(weight=0.1), entropy=Entropy(weight=0.4)),
    "entropy_bonus": LossSpec(entropy=Entropy(weight=-0.25), token_accuracy=True),
    "softcap_temperature_logit_scale": LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.1),
        z_loss=ZLoss(weight=0.01),
        entropy=Entropy(weight=0.0),
        transform=LogitTransform(logit_scale=1.5, softcap=2.0, temperature=0.7),
    ),
    "sum_reduction": LossSpec(z_loss=ZLoss(weight=0.02), reduction="sum"),
    "none_reduction": LossSpec(entropy=Entropy(weight=0.3), reduction="none"),
    "ignore_index_zero": LossSpec(ignore_index=0, token_accuracy=True),
    "no_cross_entropy": LossSpec(cross_entropy=None, z_loss=ZLoss(weight=1.0), entropy=Entropy(weight=0.5)),
}


def _inputs(case, shape=(2, 3, 9), ignore_frac=0.3, ignore_index=-100):
    seed = seed_of("torch", case)
    logits = make_logits(shape, torch.float64, seed=seed, scale=2.0)
    targets = make_targets(shape[:-1], shape[-1], seed, ignore_frac, ignore_index)
    return logits, targets


def _close(got, want, name, tol=1e-10):
    got = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
    want = torch.as_tensor(want, dtype=torch.float64).reshape(-1)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def _assert_matches_oracle(out, want, spec, tol=1e-10):
    _close(out.loss.detach(), want["loss"], "loss", tol)
    assert set(out.metrics) == set(want["metrics"])
    for name, value in want["metrics"].items():
        _close(out.metrics[name], value, f"metrics[{name}]", tol)
    for name in ALL_OUTPUTS:
        value = getattr(out, name)
        if name in spec.outputs:
            _close(value.detach(), want[name], name, tol)
        else:
            assert value is None


@pytest.mark.parametrize("case", list(SPECS))
def test_reference_values_and_loss_gradient_match_the_formula_oracle(case):
    spec = with_(SPECS[case], outputs=ALL_OUTPUTS)
    logits, targets = _inputs(case, ignore_index=spec.ignore_index)
    leaf = logits.clone().requires_grad_()
    out = reference_head_loss(leaf, targets, spec)
    want = oracle(logits, targets, spec, upstream={"loss": [1.0] * 6} if spec.reduction == "none" else None)
    _assert_matches_oracle(out, want, spec)
    out.loss.sum().backward()
    _close(leaf.grad, want["grad"], "grad")
    assert float(leaf.grad.norm()) > 0 and abs(float(out.loss.detach().sum())) > 0


@pytest.mark.parametrize("case", ["ce_smoothing", "softcap_temperature_logit_scale", "none_reduction"])
def test_reference_differentiable_outputs_gradient_matches_the_formula_oracle(case):
    spec = with_(SPECS[case], outputs=ALL_OUTPUTS, differentiable_outputs=True)
    logits, targets = _inputs(case, shape=(5, 8))
    gen = torch.Generator().manual_seed(seed_of("upstream", case))
    up = {name: (torch.randn(5, generator=gen, dtype=torch.float64)).tolist()
          for name in ("logprobs", "entropy", "lse", "token_loss")}
    up["loss"] = torch.randn(5, generator=gen, dtype=torch.float64).tolist() if spec.reduction == "none" else 0.6
    leaf = logits.clone().requires_grad_()
    out = reference_head_loss(leaf, targets, spec)
    objective = (out.loss * torch.tensor(up["loss"], dtype=torch.float64)).sum()
    for name in ("logprobs", "entropy", "lse", "token_loss"):
        objective = objective + (getattr(out, name) * torch.tensor(up[name], dtype=torch.float64)).sum()
    objective.backward()
    want = oracle(logits, targets, spec, upstream=up)
    _assert_matches_oracle(out, want, spec)
    _close(leaf.grad, want["grad"], "grad")
    assert float(leaf.grad.norm()) > 0


def test_oracle_gradient_matches_central_finite_differences():
    spec = LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.2),
        z_loss=ZLoss(weight=0.1),
        entropy=Entropy(weight=-0.3),
        transform=LogitTransform(logit_scale=1.3, softcap=2.5, temperature=0.8),
    )
    logits, targets = _inputs("finite_differences", shape=(3, 6), ignore_frac=0.3)
    analytic = torch.tensor(oracle(logits, targets, spec)["grad"], dtype=torch.float64)
    numeric = torch.zeros_like(logits)
    h = 1e-6
    for r in range(logits.shape[0]):
        for c in range(logits.shape[1]):
            plus, minus = logits.clone(), logits.clone()
            plus[r, c] += h
            minus[r, c] -= h
            numeric[r, c] = (oracle(plus, targets, spec)["loss"] - oracle(minus, targets, spec)["loss"]) / (2 * h)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)
    assert float(analytic.norm()) > 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_gradients_pass_gradcheck(reduction):
    spec = LossSpec(
        cross_entropy=CrossEntropy(label_smoothing=0.1),
        z_loss=ZLoss(weight=0.05),
        entropy=Entropy(weight=0.2),
        transform=LogitTransform(logit_scale=1.2, softcap=3.0, temperature=0.9),
        outputs=("logprobs", "lse", "token_loss", "entropy"),
        differentiable_outputs=True,
        reduction=reduction,
    )
    logits, targets = _inputs("gradcheck", shape=(4, 7), ignore_frac=0.3)

    def fn(x):
        out = reference_head_loss(x, targets, spec)
        return out.loss, out.logprobs, out.lse, out.token_loss, out.entropy

    assert torch.autograd.gradcheck(fn, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-7)


def test_reference_targets_none_counts_every_row():
    spec = LossSpec(cross_entropy=None, entropy=Entropy(weight=0.5), outputs=("entropy", "predicted_tokens"))
    logits, _ = _inputs("no_targets", shape=(3, 2, 9))
    out = reference_head_loss(logits, None, spec)
    want = oracle(logits, None, spec)
    _assert_matches_oracle(out, want, spec)
    assert int(out.metrics["n_tokens"]) == 6


@pytest.mark.parametrize("num_items", [11, torch.tensor(11), 2.5])
def test_reference_num_items_in_batch_replaces_the_token_count(num_items):
    spec = LossSpec(z_loss=ZLoss(weight=0.1))
    logits, targets = _inputs("num_items")
    out = reference_head_loss(logits, targets, spec, num_items_in_batch=num_items)
    want = oracle(logits, targets, spec, num_items=float(num_items))
    _assert_matches_oracle(out, want, spec)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_reference_mean_cross_entropy_equals_torch_cross_entropy(smoothing):
    logits, targets = _inputs("torch_ce", shape=(12, 15), ignore_frac=0.3)
    spec = LossSpec(cross_entropy=CrossEntropy(label_smoothing=smoothing))
    got = reference_head_loss(logits, targets, spec).loss
    want = F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=smoothing)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reference_predicted_tokens_first_index_on_ties_and_minus_one_at_ignored():
    logits = make_logits((4, 6), torch.float64, seed=3)
    logits[0, 1] = logits[0, 4] = 9.0
    logits[1] = 1.0
    targets = torch.tensor([0, 2, -100, 5])
    out = reference_head_loss(logits, targets, LossSpec(outputs=("predicted_tokens",)))
    assert out.predicted_tokens.tolist() == [1, 0, -1, int(logits[3].argmax())]


def test_reference_masked_columns_give_finite_values_and_zero_grad():
    spec = LossSpec(z_loss=ZLoss(weight=0.1), entropy=Entropy(weight=0.3), outputs=ALL_OUTPUTS)
    logits, targets = _inputs("masked", shape=(6, 10), ignore_frac=0.3)
    targets = torch.where((targets == 4) | (targets == 7), 5, targets)
    logits[:, [4, 7]] = float("-inf")
    leaf = logits.clone().requires_grad_()
    out = reference_head_loss(leaf, targets, spec)
    _assert_matches_oracle(out, oracle(logits, targets, spec), spec)
    out.loss.backward()
    assert torch.isfinite(leaf.grad).all()
    assert torch.all(leaf.grad[:, [4, 7]] == 0)


def test_reference_masked_column_zero_with_ignored_rows_is_finite():
    # ignored rows must not evaluate the loss at a placeholder column that may be masked
    spec = LossSpec(z_loss=ZLoss(weight=0.1), entropy=Entropy(weight=0.2), outputs=ALL_OUTPUTS)
    logits = make_logits((3, 10), torch.float64, seed=4)
    logits[:, 0] = float("-inf")
    targets = torch.tensor([1, -100, 5])
    leaf = logits.clone().requires_grad_()
    out = reference_head_loss(leaf, targets, spec)
    _assert_matches_oracle(out, oracle(logits, targets, spec), spec)
    out.loss.backward()
    assert torch.isfinite(leaf.grad).all() and torch.all(leaf.grad[1] == 0)


def test_reference_all_ignored_batch_gives_zero_loss_and_zero_grad():
    spec = LossSpec(z_loss=ZLoss(), entropy=Entropy(weight=0.1), token_accuracy=True)
    leaf = make_logits((4, 9), torch.float64, seed=5).requires_grad_()
    out = reference_head_loss(leaf, torch.full((4,), -100), spec)
    assert float(out.loss.detach()) == 0.0
    assert all(float(v) == 0.0 for v in out.metrics.values())
    out.loss.backward()
    assert torch.all(leaf.grad == 0)


@pytest.mark.parametrize(
    "dtype,expected",
    [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
     (torch.float16, torch.float32)],
)
def test_reference_computes_in_fp32_for_low_precision_and_fp64_for_fp64(dtype, expected):
    spec = LossSpec(entropy=Entropy(), outputs=("logprobs", "entropy"))
    logits, targets = _inputs("dtypes", shape=(5, 12))
    low = logits.to(dtype)
    out = reference_head_loss(low, targets, spec)
    assert out.loss.dtype == expected and out.logprobs.dtype == expected
    assert out.metrics["ce"].dtype == expected
    want = oracle(low, targets, spec)
    _assert_matches_oracle(out, want, spec, tol=1e-10 if expected == torch.float64 else 1e-5)
    upcast = reference_head_loss(low, targets, spec, compute_dtype=torch.float64)
    assert upcast.loss.dtype == torch.float64
    _assert_matches_oracle(upcast, want, spec)
