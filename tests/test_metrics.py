"""MetricsAccumulator: token-weighted step metrics over uneven micro-batches and gloo ranks."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import make_logits, make_targets, spawn_ranks
from hypothesis import given
from hypothesis import strategies as st
from strategies import CI

from headloss import Entropy, LossSpec, ZLoss, head_loss
from headloss.metrics import TRL_NAMES, MetricsAccumulator

SPEC = LossSpec(z_loss=ZLoss(weight=1e-3), entropy=Entropy(), token_accuracy=True)
GRPO = LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04, "eps_high": 0.28})


def micro_batches(seed: int, sizes=(3, 8, 5), vocab=37, ignore=0.3):
    """Micro-batches of uneven rows and uneven ignored fractions."""
    out = []
    for i, n in enumerate(sizes):
        logits = make_logits((n, vocab), seed=seed * 10 + i)
        targets = make_targets((n,), vocab, seed * 10 + i, ignore_frac=ignore * (i % 2))
        out.append((logits, targets))
    return out


def test_token_weighted_means_equal_one_call_over_all_tokens():
    batches = micro_batches(1)
    whole = head_loss(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), SPEC,
                      backend="torch")
    total = int(whole.metrics["n_tokens"])
    acc = MetricsAccumulator()
    naive = []
    for logits, targets in batches:
        out = head_loss(logits, targets, SPEC, num_items_in_batch=total, backend="torch")
        acc.update(out, num_items_in_batch=total)
        naive.append(float(out.metrics["ce"]))
    values = acc.compute()
    for name in ("ce", "z_loss", "entropy", "token_accuracy"):
        assert values[name] == pytest.approx(float(whole.metrics[name]), rel=1e-6), name
    assert values["loss"] == pytest.approx(float(whole.loss), rel=1e-6)
    assert values["n_tokens"] == total
    assert values["ce"] != pytest.approx(sum(naive) / len(naive), rel=1e-4)  # micro-batch means would differ
    assert acc.compute() == {}  # compute() resets


def test_loss_without_num_items_and_with_sum_reduction():
    batches = micro_batches(2)
    whole = head_loss(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), SPEC,
                      backend="torch")
    acc = MetricsAccumulator()
    for logits, targets in batches:
        acc.update(head_loss(logits, targets, SPEC, backend="torch"))
    assert acc.compute()["loss"] == pytest.approx(float(whole.loss), rel=1e-6)
    summed = LossSpec.model_validate({**dict(SPEC), "reduction": "sum"})
    acc = MetricsAccumulator(names=TRL_NAMES, prefix="train/")
    for logits, targets in batches:
        acc.update(head_loss(logits, targets, summed, backend="torch"), reduction="sum")
    values = acc.compute()
    assert values["train/loss"] == pytest.approx(float(whole.loss), rel=1e-6)
    assert "train/mean_token_accuracy" in values and "train/num_tokens" in values


def test_min_and_max_metrics_reduce_by_min_and_max_and_skip_empty_calls():
    acc = MetricsAccumulator()
    gen = torch.Generator().manual_seed(3)
    seen_min, seen_max = [], []
    for b, length in ((2, 6), (3, 4)):
        logits = torch.randn(b, length, 23, generator=gen)
        ids = torch.randint(0, 23, (b, length), generator=gen)
        old = -torch.rand(b, length, generator=gen) * 3
        out = head_loss(logits, ids, GRPO, advantages=torch.randn(b, generator=gen), old_logprobs=old,
                        ref_logprobs=old, backend="torch")
        acc.update(out)
        seen_min.append(float(out.metrics["ratio/min"]))
        seen_max.append(float(out.metrics["ratio/max"]))
    empty = head_loss(torch.randn(1, 3, 23), torch.full((1, 3), -100), GRPO, advantages=torch.ones(1),
                      old_logprobs=torch.zeros(1, 3), ref_logprobs=torch.zeros(1, 3), backend="torch")
    acc.update(empty)  # no tokens: its ratio/min of 1 must not count
    values = acc.compute()
    assert values["ratio/min"] == pytest.approx(min(seen_min))
    assert values["ratio/max"] == pytest.approx(max(seen_max))


def test_tensor_num_items_and_token_counts_beyond_fp32_stay_exact():
    """n_tokens is int64 and may pass 2**24 (where fp32 stops counting by one); a tensor num_items_in_batch
    weighs the loss as a number does; a metric with a gradient is read, not differentiated."""
    n = 2**25 + 1
    ce = torch.tensor(0.75, requires_grad=True)
    acc = MetricsAccumulator()
    acc.update({"loss": torch.tensor(0.5), "ce": ce * 1, "n_tokens": torch.tensor(n)},
               num_items_in_batch=torch.tensor(4.0))
    acc.update({"loss": torch.tensor([0.25]), "ce": torch.tensor([1.5]), "n_tokens": torch.tensor([3])},
               num_items_in_batch=2)
    values = acc.compute()
    assert values["n_tokens"] == n + 3
    assert values["loss"] == (0.5 * 4 + 0.25 * 2) / (n + 3)
    assert values["ce"] == pytest.approx((0.75 * n + 1.5 * 3) / (n + 3), rel=1e-12)


@pytest.mark.parametrize("num_items", [None, 4, "tensor"], ids=["own-tokens", "number", "tensor"])
def test_a_compiled_update_accumulates_as_an_eager_one(num_items):
    """Under torch.compile (aot_eager) the running values take every call's in-place add (a view of one buffer,
    or a 0-d fp64 sum of an fp32 loss, kept only the first call's)."""
    def calls(acc, update):
        for i in range(3):
            n = torch.tensor(4.0) if num_items == "tensor" else num_items
            update(acc, {"loss": torch.tensor(1.0 + i), "ce": torch.tensor(0.5 * (i + 1)),
                         "ratio/min": torch.tensor(0.1 * i), "ratio/max": torch.tensor(2.0 - i),
                         "n_tokens": torch.tensor(3 + i)}, n)
        return acc.compute()

    def update(acc, metrics, n):
        acc.update(metrics, num_items_in_batch=n)

    eager = calls(MetricsAccumulator(), update)
    torch._dynamo.reset()
    compiled = calls(MetricsAccumulator(), torch.compile(update, backend="aot_eager"))
    assert compiled == pytest.approx(eager, rel=1e-12) and eager["n_tokens"] == 12


def test_a_refused_update_changes_nothing_and_inference_mode_mixes():
    acc = MetricsAccumulator()
    one = {"loss": torch.tensor(2.0), "ce": torch.tensor(1.0), "n_tokens": torch.tensor(3)}
    with torch.inference_mode():
        acc.update(one)  # (the running values are ordinary tensors, which a later update may add into)
    for bad, error in ((torch.tensor([4.0, 4.0]), ValueError), ("4", TypeError), (True, TypeError)):
        with pytest.raises(error, match="num_items_in_batch"):
            acc.update(one, num_items_in_batch=bad)
    acc.update(one)
    assert acc.compute() == {"loss": 2.0, "ce": 1.0, "n_tokens": 6}


@st.composite
def _calls(draw):
    """A run of calls of one metric set: tokens (0 and past 2**24 included), fp32 values, and each call's loss
    weight (its tokens, a number, a tensor; or a summed loss)."""
    reduction = draw(st.sampled_from(["mean", "sum"]))
    names = draw(st.lists(st.sampled_from(["ce", "entropy", "kl", "ratio/min", "clip_ratio/low_min", "ratio/max"]),
                          unique=True))
    value = st.floats(-1e3, 1e3, allow_nan=False, width=32)
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        tokens = draw(st.sampled_from([0, 1, 7, 2**24 + 1, 3 * 2**25]) | st.integers(0, 10**6))
        denom = None if reduction == "sum" else draw(st.none() | st.integers(1, 10**6) | st.floats(0.5, 1e6))
        as_tensor = draw(st.booleans())
        calls.append((tokens, draw(value), {n: draw(value) for n in names}, denom, as_tensor))
    return reduction, names, calls


@CI
@given(_calls())
def test_the_step_values_equal_an_exact_sum_over_the_calls(case):
    """compute() against the step's values summed in Python floats (fp64) from the same fp32 numbers: token
    means weighted by tokens, the loss times its weight over all tokens, min / max over calls with tokens."""
    reduction, names, calls = case
    acc = MetricsAccumulator()
    for tokens, loss, values, denom, as_tensor in calls:
        metrics = {"loss": torch.tensor(loss), "n_tokens": torch.tensor(tokens),
                   **{n: torch.tensor(v) for n, v in values.items()}}
        acc.update(metrics, num_items_in_batch=torch.tensor(denom) if as_tensor and denom is not None else denom,
                   reduction=reduction)
    got = acc.compute()
    f32 = lambda v: float(torch.tensor(v))  # noqa: E731 -- the fp32 value the call held
    total = sum(t for t, *_ in calls)
    assert got["n_tokens"] == total
    weight = lambda t, d, as_tensor: (1.0 if reduction == "sum" else t if d is None  # noqa: E731
                                      else float(torch.tensor(d)) if as_tensor else float(d))
    loss_sum = sum(f32(loss) * weight(t, d, a) for t, loss, _, d, a in calls)
    assert got["loss"] == (pytest.approx(loss_sum / total, rel=1e-12, abs=1e-300) if total else _nan())
    for name in names:
        seen = [f32(v[name]) for t, _, v, _, _ in calls if t > 0]
        if name.endswith("min") or name.endswith("max"):
            want = (min(seen) if name.endswith("min") else max(seen)) if seen else None
        else:
            want = sum(f32(v[name]) * t for t, _, v, _, _ in calls) / total if total else None
        assert (got[name] != got[name]) if want is None else got[name] == pytest.approx(want, rel=1e-12), name


def _nan():
    return pytest.approx(float("nan"), nan_ok=True)


def test_update_queues_three_device_ops():
    """A call's update is one stack of its means and two multiply-adds (the loss's and the tokens'), plus one
    more stack, compare, select and min / max per kind where the spec has min / max metrics."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    logits, targets = micro_batches(6)[0]
    out = head_loss(logits, targets, SPEC, backend="torch")
    acc = MetricsAccumulator()
    acc.update(out)  # (the first call also allocates the running values)
    with Ops() as ops:
        acc.update(out)
    assert sorted(ops.names) == ["addcmul_", "addcmul_", "stack"], ops.names


def test_bad_input_is_a_clear_error():
    acc = MetricsAccumulator()
    with pytest.raises(ValueError, match="n_tokens"):
        acc.update({"ce": torch.tensor(1.0)})
    for bad in (torch.tensor(1.0), None, 3.0, [("loss", 1.0)]):
        with pytest.raises(TypeError, match="out: expected a HeadLossOutput or its metrics dict"):
            acc.update(bad)
    with pytest.raises(ValueError, match="out: metric 'loss' is not a one-element tensor"):
        acc.update({"loss": torch.ones(3), "n_tokens": torch.tensor(3)})
    with pytest.raises(ValueError, match="out: metric 'n_tokens' is not a one-element tensor"):
        acc.update({"loss": torch.tensor(1.0), "n_tokens": 3})
    logits, targets = micro_batches(4)[0]
    acc.update(head_loss(logits, targets, SPEC, backend="torch"))
    with pytest.raises(ValueError, match="differ"):
        acc.update(head_loss(logits, targets, LossSpec(), backend="torch"))
    with pytest.raises(ValueError, match="reduction"):
        acc.update(head_loss(logits, targets, SPEC, backend="torch"), reduction="none")



def _rank(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        batches = micro_batches(5)
        mine = batches[rank::world]  # uneven: rank 0 gets two micro-batches, rank 1 one, rank 2 none
        acc = MetricsAccumulator()
        calls = []

        original = dist.all_gather

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        dist.all_gather = counted
        for logits, targets in mine:
            acc.update(head_loss(logits, targets, SPEC, backend="torch"))
        values = acc.compute()
        dist.all_gather = original
        results[rank] = (values, len(calls))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_reduce_with_one_collective(world):
    batches = micro_batches(5)
    whole = head_loss(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), SPEC,
                      backend="torch")
    results = spawn_ranks(_rank, world)
    for rank in range(world):
        values, collectives = results[rank]
        assert collectives == 1
        if rank >= len(batches):  # no call on this rank: it took part and got nothing
            assert values == {}
            continue
        for name in ("ce", "z_loss", "entropy", "token_accuracy", "loss"):
            target = whole.loss if name == "loss" else whole.metrics[name]
            assert values[name] == pytest.approx(float(target), rel=1e-6), (rank, name)
        assert values["n_tokens"] == int(whole.metrics["n_tokens"])


def _rank_mismatch(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        logits, targets = micro_batches(6)[0]
        # as many metrics on both ranks, under different names
        spec = LossSpec(z_loss=ZLoss(weight=1e-3)) if rank == 0 else LossSpec(dft={"weight": 1.0})
        acc = MetricsAccumulator()
        acc.update(head_loss(logits, targets, spec, backend="torch"))
        try:
            acc.compute()
            results[rank] = "ok"
        except RuntimeError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_metric_names_are_an_error_not_a_sum():
    results = spawn_ranks(_rank_mismatch, 2)
    assert all("different metric sets" in results[rank] for rank in (0, 1))
