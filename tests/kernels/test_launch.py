"""The launch fast path: after a variant's first launch, later launches reuse its compiled
launcher, keyed by a Python key of what Triton specialises on (spec_key). If that key merged two
variants Triton tells apart, a kernel compiled for 16-byte aligned pointers could run on unaligned
ones: these tests compare it with the specialisation Triton's binder computes, on this machine (no
GPU needed), and check that binder (Triton's private API) is there, and that launches without it
give the same results. Then head_loss's per-signature recipes and the two routes of prepare's work."""

from __future__ import annotations

import itertools
import types

import pytest
import torch
from conftest import assert_matches_reference, assert_nontrivial, make_logits, make_targets, needs_kernel, run_pair
from triton.backends.compiler import BaseBackend

import headloss
from headloss import LossSpec, head_loss
from headloss import logits as logits_module
from headloss.kernels import launch as launch_module
from headloss.kernels.head import PolicyRows, Prepare, next_nonce
from headloss.kernels.launch import Geometry, spec_key, triton_specialisation
from headloss.plan import compile_plan
from headloss.registry import Scalars


def one_call(args: tuple):
    found = triton_specialisation(BaseBackend, args)
    assert found is not None, "Triton's private binder is missing or changed (see the next test)"
    return found


def per_argument(args: tuple):
    """What Triton's binder computes: one specialisation per runtime argument."""
    return tuple(one_call(a) for a in args)


def test_the_fast_path_finds_triton_s_private_binder_on_this_triton():
    """launch()'s fast path keys compiled variants by triton._C.libtriton.native_specialize_impl, called
    as Triton's own binder calls it. A Triton that moves or changes it still launches (Triton's path,
    slower): this test is what fails then."""
    t = torch.empty(64)
    assert launch_module._native_specialize is not None, "triton._C.libtriton.native_specialize_impl is gone"
    found = triton_specialisation(BaseBackend, (t, t[1:], None, 7, 1, 2.5))
    assert found == (("*fp32", "*fp32", "constexpr", "i32", "constexpr", "fp32"), ("D", "", None, "", 1, None))


@pytest.mark.parametrize("broken", ["missing", "another signature"])
def test_without_the_private_binder_there_is_no_specialisation(broken, monkeypatch):
    def changed(backend, args):  # another signature: called as before (five arguments), a TypeError
        return ("specialised",)

    monkeypatch.setattr(launch_module, "_native_specialize", None if broken == "missing" else changed)
    assert triton_specialisation(BaseBackend, (torch.empty(64),)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast path launches compiled kernels on a GPU")
def test_launches_without_the_private_binder_take_triton_s_path_with_the_same_results(monkeypatch):
    logits = make_logits((48, 1000), seed=9).cuda()
    targets = make_targets((48,), 1000, seed=9, ignore_frac=0.2).cuda()

    def step():
        x = logits.clone().requires_grad_()
        out = head_loss(x, targets, SPEC)
        out.loss.backward()
        return out, x.grad

    step()  # a kernel's first launch on a device builds Triton's caches
    step()  # the second compiles the variant (or finds it) and records its launcher
    fast = step()  # the third finds the launcher by spec_key
    assert launch_module._FAST, "the fast path was not taken"
    monkeypatch.setattr(launch_module, "_native_specialize", None)
    launch_module._FAST.clear()
    launch_module._COMPILED.clear()
    for out, grad in (step(), step()):
        assert not launch_module._FAST and not launch_module._COMPILED  # every launch through Triton's path
        assert torch.equal(out.loss, fast[0].loss) and torch.equal(grad, fast[1])
        assert all(torch.equal(out.metrics[name], value) for name, value in fast[0].metrics.items())


def _geo(**changes):
    base = dict(n_rows=8, n_out=8, V=32000, T=8, K=8, shift=0, stride_b=0, stride_t=32000, g_stride_b=0,
                g_stride_t=32000, t_stride_b=0, t_stride_t=0, ignore_index=-100, norm=0.0)
    return Geometry(**{**base, **changes})


def test_one_call_key_separates_exactly_what_the_binder_separates():
    t = torch.empty(64)
    candidates = [
        (t, None, _geo()),
        (t[1:], None, _geo()),  # unaligned pointer
        (t[4:], None, _geo()),  # 16-byte aligned again
        (t, t, _geo()),  # an optional input present
        (t, None, _geo(T=1, K=1)),  # ints equal to 1 are constexprs in Triton
        (t, None, _geo(V=32001, stride_t=32001)),  # not a multiple of 16
        (t, None, _geo(stride_b=2**33)),  # needs 64 bits
        (t.to(torch.bfloat16), None, _geo()),
        (t, PolicyRows(t, None, t, None, t), _geo()),
        (t, PolicyRows(t, t, t, None, t), _geo()),
        (t, None, _geo(norm=3.0)),  # floats: by type only
    ]
    for a, b in itertools.combinations(candidates, 2):
        assert (one_call(a) == one_call(b)) == (per_argument(a) == per_argument(b)), (a, b)


def test_the_python_launch_key_never_merges_what_triton_specialises_apart():
    """launch() looks compiled variants up by spec_key (Python, cheap); equal keys must mean equal
    specialisations, or a kernel compiled for aligned pointers or for an int of 1 could run on others."""
    t = torch.empty(64)
    s1 = Scalars(w_ce=1.0)
    candidates = [
        (t, None, _geo(), s1),
        (t[1:], None, _geo(), s1),  # unaligned pointer
        (t[4:], None, _geo(), s1),  # 16-byte aligned again
        (t.to(torch.bfloat16), None, _geo(), s1),
        (t.to(torch.int64), None, _geo(), s1),
        (t, t, _geo(), s1),  # an optional input present
        (t, t[1:], _geo(), s1),
        (t, None, _geo(T=1, K=1), s1),  # ints equal to 1 are constexprs in Triton
        (t, None, _geo(T=16, K=16), s1),
        (t, None, _geo(V=32001, stride_t=32001), s1),  # not a multiple of 16
        (t, None, _geo(stride_b=2**33), s1),  # needs 64 bits
        (t, None, _geo(norm=3.0), s1),  # floats: by type only
        (t, None, _geo(), Scalars(w_ce=2.0, eps_low=0.2)),
        (t, None, _geo(), Scalars(pol_delta=float("inf"))),
        (t, PolicyRows(t, None, t, None, t), _geo(), s1),
        (t, PolicyRows(t, t, t, None, t), _geo(), s1),
        (t, PolicyRows(t, None, t, None, t, 1, 0), _geo(), s1),
        (t, PolicyRows(t, None, t, None, t, 8, 8), _geo(), s1),
        (t, PolicyRows(t[1:], None, t, None, t, 8, 8), _geo(), s1),
        (t, 1, _geo(), s1),
        (t, 2, _geo(), s1),
        (t, True, _geo(), s1),
        (t, False, _geo(), s1),
        (t, 1.0, _geo(), s1),
        (t, 2.5, _geo(), s1),
    ]
    for a, b in itertools.combinations(candidates, 2):
        if spec_key(a) == spec_key(b):
            assert one_call(a) == one_call(b), (a, b)
    # and it is not coarser than needed where calls repeat: the same layout, another num_items_in_batch,
    # another call's nonce (the in-kernel prepare's tag: every call has its own)
    assert spec_key((t, None, _geo(norm=3.0), s1)) == spec_key((t, None, _geo(norm=5.0), s1))
    calls = [(t, Prepare(t, t[:1], next_nonce()), _geo()) for _ in range(3)]
    assert len({spec_key(c) for c in calls}) == 1 and len({one_call(c) for c in calls}) == 1
    assert spec_key(calls[0]) != spec_key((t, Prepare(t, t[:1], None), _geo()))
    assert spec_key(calls[0]) != spec_key((t, Prepare(t[1:], t[:1], next_nonce()), _geo()))
    assert all(isinstance(v, float) for v in compile_plan(LossSpec(z_loss={"weight": 1}), has_targets=True).scalars)


# --- the per-signature recipe of head_loss ----------------------------------------------------------
#
# A call without policy inputs or a group looks its checks' outcome and geometry up by its signature
# (plan; every input's type, shape, strides, dtype and device; shift, inplace_grad, validate and
# HEADLOSS_VALIDATE, backend). A change of any of these must not reuse a recipe made for another.

SPEC = LossSpec(z_loss={"weight": 1e-2}, token_accuracy=True, entropy={"weight": 0.0},
                outputs=("predicted_tokens", "logprobs"))


@needs_kernel
def test_a_repeated_call_reuses_its_recipe_and_every_changed_signature_gets_its_own():
    logits_module._RECIPES.clear()
    wide = make_logits((6, 45), seed=1)
    dense = wide[:, :37].contiguous()
    targets = make_targets((6,), 37, seed=1, ignore_frac=0.3)
    cut = lambda t: t[:, :37]  # noqa: E731  (strided rows, the same shape)
    calls = [
        ("contiguous", dense, lambda t: t, targets, {}),
        ("again", dense, lambda t: t, targets, {}),
        ("strided rows, same shape", wide, cut, targets, {}),
        ("int32 targets", wide, cut, targets.int(), {}),
        ("uint8 targets", wide, cut, targets.clamp(min=0).to(torch.uint8), {}),
        ("strided targets", wide, cut, torch.stack([targets, targets], 1)[:, 0], {}),
        ("num_items 3", wide, cut, targets, {"num_items_in_batch": 3}),
        ("num_items 5", wide, cut, targets, {"num_items_in_batch": 5.0}),
        ("num_items tensor", wide, cut, targets, {"num_items_in_batch": torch.tensor(7)}),
        ("[B, T, V]", wide, lambda t: t[:, :37].reshape(2, 3, 37), targets.reshape(2, 3), {}),
    ]
    sizes = []
    for _name, leaf, view, y, kwargs in calls:
        pair = run_pair(leaf, y, SPEC, view=view, **kwargs)
        assert_matches_reference(pair)
        assert_nontrivial(pair)
        sizes.append(len(logits_module._RECIPES))
    # one recipe per signature: the repeated call and the num_items_in_batch changes add none
    assert sizes == [1, 1, 2, 3, 4, 5, 5, 5, 5, 6], sizes


@needs_kernel
def test_a_cached_signature_still_checks_num_items_and_values_and_rereads_headloss_validate(monkeypatch):
    logits = make_logits((5, 11), seed=2)
    good = make_targets((5,), 11, seed=2)
    head_loss(logits, good, SPEC)
    head_loss(logits, good, SPEC)  # cached now
    with pytest.raises(ValueError, match="num_items_in_batch"):
        head_loss(logits, good, SPEC, num_items_in_batch=0)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        head_loss(logits, good, SPEC, num_items_in_batch=torch.tensor([1, 2]))
    bad = good.clone()
    bad[3] = 11
    with pytest.raises(ValueError, match=r"targets: value 11 at position \(3,\)"):
        head_loss(logits, bad, SPEC)
    monkeypatch.setenv("HEADLOSS_VALIDATE", "0")  # the same signature, validation now off: no error, NaN row
    out = head_loss(logits, bad, SPEC)
    assert torch.isnan(out.loss)
    monkeypatch.setenv("HEADLOSS_VALIDATE", "1")
    with pytest.raises(ValueError, match="targets: value 11"):
        head_loss(logits, bad, SPEC)
    with pytest.raises(ValueError, match="targets: shape"):  # a new signature is checked in full
        head_loss(logits, good[:4], SPEC)


@needs_kernel
@pytest.mark.parametrize("inline", [True, False], ids=["a-program-prepares", "prepare-launch"])
def test_both_prepare_routes_give_the_reference_and_the_same_errors(inline, monkeypatch):
    """Calls up to INLINE_PREPARE_SLOTS slots leave prepare's work (counted rows, target, num_items and
    sequence id checks, the policy term's counters) to one of the head kernel's programs (the first to
    take the call's ticket); above, prepare_kernel runs first."""
    from headloss import head

    monkeypatch.setattr(head, "INLINE_PREPARE_SLOTS", 1 << 14 if inline else 0)
    launched = []
    real = head.prepare
    monkeypatch.setattr(head, "prepare", lambda *a, **k: launched.append(1) or real(*a, **k))
    logits = make_logits((2, 5, 29), seed=3)
    targets = make_targets((2, 5), 29, seed=3, ignore_frac=0.4)
    for spec in (SPEC, SPEC.model_copy(update={"differentiable_outputs": True})):  # fused, deferred
        pair = run_pair(logits, targets, spec, num_items_in_batch=torch.tensor(6.0))
        assert_matches_reference(pair)
        assert_nontrivial(pair)
        pair = run_pair(logits, targets, spec)
        assert_matches_reference(pair)
    # a policy term: the preparing program also zeroes the per-sequence clip counters and ratio extremes
    grpo = LossSpec(cross_entropy=None, entropy={"weight": 0.0}, policy={"loss_type": "grpo", "kl_beta": 0.04})
    gen = torch.Generator().manual_seed(5)
    inputs = dict(advantages=torch.randn(2, generator=gen), old_logprobs=-torch.rand(2, 5, generator=gen) * 3,
                  ref_logprobs=-torch.rand(2, 5, generator=gen) * 3)
    for _ in range(2):  # the second call's scratch may hold the first's counters
        pair = run_pair(logits, targets, grpo, inputs=inputs)
        assert_matches_reference(pair)
        assert_nontrivial(pair)
    assert bool(launched) != inline
    bad = targets.clone()
    bad[1, 2] = -7
    with pytest.raises(ValueError, match=r"targets: value -7 at position \(1, 2\)"):
        head_loss(logits, bad, SPEC)
    with pytest.raises(ValueError, match="num_items_in_batch: expected a positive finite number, got 0.0"):
        head_loss(logits, targets, SPEC, num_items_in_batch=torch.tensor(0.0))


@needs_kernel
def test_a_recipe_call_makes_its_metrics_and_views_on_first_read_and_they_are_the_same():
    """The recipe path returns a HeadLossOutput whose metrics and per-token views are made on first
    access: the same values, read before or after backward, and fields can still be assigned."""
    import dataclasses

    spec = LossSpec(z_loss={"weight": 1e-2}, token_accuracy=True, entropy={"weight": 0.0},
                    outputs=("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"))
    logits = make_logits((2, 3, 17), seed=4)
    targets = make_targets((2, 3), 17, seed=4, ignore_frac=0.3)
    x = logits.clone().requires_grad_()
    late = head_loss(x, targets, spec)
    late.loss.backward()  # read after backward
    early = head_loss(logits, targets, spec)
    ref = head_loss(logits, targets, spec, backend="torch")
    for out in (late, early):
        assert isinstance(out, headloss.HeadLossOutput) and repr(out).startswith("HeadLossOutput(loss=")
        assert sorted(out.metrics) == sorted(ref.metrics)
        for name, value in ref.metrics.items():
            assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-5, atol=1e-6), name
        for name in ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy"):
            got, want = getattr(out, name), getattr(ref, name)
            assert got.shape == want.shape == (2, 3) and not got.requires_grad, name
            assert torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6), name
    assert [f.name for f in dataclasses.fields(late)] == [f.name for f in dataclasses.fields(ref)]
    fresh = head_loss(logits, targets, spec)
    fresh.entropy = None  # assignment before any read
    assert fresh.entropy is None and fresh.logprobs is not None
    swapped = dataclasses.replace(head_loss(logits, targets, spec), loss=torch.tensor(1.0))
    assert float(swapped.loss) == 1.0 and "token_accuracy" in swapped.metrics


class _Built:
    """A compiled variant as _fitted reads it."""

    def __init__(self, n_regs: int, n_spills: int = 0) -> None:
        self.n_regs, self.n_spills = n_regs, n_spills

    def _init_handles(self) -> None:
        pass


class _Kernel:
    """A kernel whose warmup builds the sibling (no maxnreg) or the capped variant."""

    def __init__(self, sibling: int, capped_spills: int = 0, fails: bool = False) -> None:
        self.sibling, self.capped_spills, self.fails, self.caps = sibling, capped_spills, fails, []
        self.fn = types.SimpleNamespace(__name__="head_kernel")

    def warmup(self, grid, num_warps, maxnreg=None, **kwargs):
        if self.fails:
            raise RuntimeError("no driver")
        if maxnreg is None:
            return _Built(self.sibling)
        self.caps.append(maxnreg)
        return _Built(maxnreg, self.capped_spills)


@pytest.mark.parametrize("sibling,spills,want", [(64, 0, "capped"), (64, 4, "own"), (80, 0, "own"), (96, 0, "own")])
def test_a_variant_is_fitted_to_its_siblings_registers_only_where_that_spills_nothing(sibling, spills, want):
    """kernels.launch._fitted: a variant of 80 registers whose sibling takes fewer runs capped at the sibling's
    count when that build spills nothing; otherwise (spills, or a sibling as large) as compiled."""
    kernel, own = _Kernel(sibling, spills), _Built(80)
    got = launch_module._fitted(kernel, 8, 4, {}, {}, own)
    assert (got is own) == (want == "own")
    if want == "capped":
        assert got.n_regs == sibling and kernel.caps == [sibling]


@pytest.mark.parametrize("spills,allowed,want", [(6, 16, "capped"), (16, 16, "capped"), (17, 16, "own"),
                                                 (1, 0, "own")])
def test_a_variant_may_accept_a_few_spills_to_keep_to_its_siblings_registers(spills, allowed, want):
    """kernels.launch._fitted(spills=...): the student's top-k keeps to the registers of the same launch
    without it where that build spills at most FIT_SPILLS (the top-64 head kernel: 10 spills at 63)."""
    kernel, own = _Kernel(64, spills), _Built(96)
    got = launch_module._fitted(kernel, 8, 4, {}, {}, own, allowed)
    assert (got is own) == (want == "own")
    if want == "capped":
        assert got.n_regs == 64 and kernel.caps == [64]


def test_a_register_fit_that_fails_keeps_the_variant_as_compiled():
    own = _Built(80)
    with pytest.warns(RuntimeWarning, match="fitting head_kernel's registers failed"):
        assert launch_module._fitted(_Kernel(64, fails=True), 8, 4, {}, {}, own) is own
