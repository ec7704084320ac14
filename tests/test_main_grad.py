"""``linear_head_loss(weight_grad="main_grad")``: Megatron's gradient accumulation fusion. dW is added into
``weight.main_grad`` on every route and both paths (in deferred mode on the kernels' path by the chunks
themselves), autograd gets Megatron's dummy with ``grad_added_to_main_grad`` set, and a hook written as
Megatron's DDP writes it (add ``param.grad`` unless the flag is set, then drop it) ends with main_grad equal
to what the plain call's dW would have made. The expected dW is the plain call's own (its fp64 oracle is the
rest of the suite's)."""

from __future__ import annotations

import pytest
import torch
from conftest import generator, needs_kernel
from megatron_cases import megatron_ddp_hook

import headloss
from headloss import LossSpec

N, H, V = 9, 8, 37
SPECS = {"deferred": LossSpec(reduction="none", z_loss={"weight": 0.01}),  # a per-token loss: dW in backward
         "fused": LossSpec(entropy={"weight": 0.05})}  # a scalar loss: dW in forward, scaled in backward


def _batch(seed: int, dtype=torch.float32):
    gen = generator(seed)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    y[3] = -100
    return h, w, y


def _backward(out, scale: float) -> None:
    (out.loss.sum() if out.loss.dim() else out.loss).mul(scale).backward()


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("route", list(SPECS))
def test_main_grad_takes_dw_and_megatrons_hook_adds_nothing_more(backend, route):
    h, w, y = _batch(1)
    spec = SPECS[route]
    plain_h, plain_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = headloss.linear_head_loss(plain_h, plain_w, y, spec, backend=backend, chunk_bytes=3 * V * 4)
    _backward(out, 0.7)
    assert out.route.startswith("lm_head:" + route) if backend == "triton" else out.route == "torch"

    weight = w.clone().requires_grad_()
    weight.main_grad = torch.full((V, H), 0.25)
    weight.grad_added_to_main_grad = False
    fired: list = []
    megatron_ddp_hook(weight, fired)
    hidden = h.clone().requires_grad_()
    for _ in range(2):  # two micro-batches accumulate
        weight.grad_added_to_main_grad = False
        got = headloss.linear_head_loss(hidden, weight, y, spec, backend=backend, chunk_bytes=3 * V * 4,
                                        weight_grad="main_grad")
        _backward(got, 0.7)
    assert fired == [True, True] and weight.grad is None
    torch.testing.assert_close(weight.main_grad, 0.25 + 2 * plain_w.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, 2 * plain_h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, out.loss)


@needs_kernel
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_half_precision_weight_accumulates_in_an_fp32_main_grad(backend):
    """A bf16 weight and an fp32 main_grad: dW is accumulated in fp32 (the deferred chunks add each chunk's
    g.T @ h there); the result is the fp64 product of the call's own bf16 gradient rows within fp32."""
    h, w, y = _batch(2, torch.bfloat16)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(V, H)
    weight.grad_added_to_main_grad = False
    hidden = h.clone().requires_grad_()
    out = headloss.linear_head_loss(hidden, weight, y, SPECS["deferred"], backend=backend, chunk_bytes=3 * V * 4,
                                    weight_grad="main_grad")
    _backward(out, 1.0)
    assert weight.main_grad.dtype == torch.float32 and weight.grad_added_to_main_grad
    logits = (h.double() @ w.double().T).requires_grad_()
    want = headloss.head_loss(logits, y, SPECS["deferred"], backend="torch")
    want.loss.sum().backward()
    dw = logits.grad.T @ h.double()
    err = (weight.main_grad.double() - dw).norm() / dw.norm()
    assert err < 2e-2  # (bf16 logits and gradient rows; the sum itself is fp32)


@needs_kernel
def test_zero_out_wgrad_gives_zeros_and_no_flag_gives_none():
    h, w, y = _batch(3)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(V, H)
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = True
    _backward(headloss.linear_head_loss(h, weight, y, SPECS["deferred"], weight_grad="main_grad"), 1.0)
    assert weight.grad is not None and not weight.grad.any()
    bare = w.clone().requires_grad_()  # a main_grad but no flag: autograd gets None, as Megatron gives it
    bare.main_grad = torch.zeros(V, H)
    _backward(headloss.linear_head_loss(h, bare, y, SPECS["fused"], weight_grad="main_grad"), 1.0)
    assert bare.grad is None and bare.main_grad.abs().sum() > 0


def test_bad_main_grad_requests_name_the_argument():
    h, w, y = _batch(4)
    weight = w.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"weight_grad: 'main_grad' adds dW into weight.main_grad"):
        headloss.linear_head_loss(h, weight, y, weight_grad="main_grad")
    weight.main_grad = torch.zeros(V + 1, H)
    with pytest.raises(ValueError, match=r"weight_grad: weight.main_grad must be shaped and placed as the weight"):
        headloss.linear_head_loss(h, weight, y, weight_grad="main_grad")
    weight.main_grad = torch.zeros(V, H, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"weight_grad: weight.main_grad must be fp32, bf16 or fp16"):
        headloss.linear_head_loss(h, weight, y, weight_grad="main_grad")
    with pytest.raises(ValueError, match=r"weight_grad: expected 'return' or 'main_grad', got 'grad'"):
        headloss.linear_head_loss(h, weight, y, weight_grad="grad")


@needs_kernel
@pytest.mark.parametrize("route", list(SPECS))
def test_under_autocast_the_callers_fp32_weight_keeps_the_protocol(route):
    """torch.autocast (bf16 GEMMs): the main_grad and the flag are the fp32 parameter's, not the cast copy's,
    and main_grad equals the autocast plain call's weight gradient."""
    h, w, y = _batch(5)
    spec = SPECS[route]
    plain = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = headloss.linear_head_loss(h, plain, y, spec, chunk_bytes=3 * V * 4)
    _backward(out, 1.0)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(V, H)
    weight.grad_added_to_main_grad = False
    fired: list = []
    megatron_ddp_hook(weight, fired)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = headloss.linear_head_loss(h, weight, y, spec, chunk_bytes=3 * V * 4, weight_grad="main_grad")
    _backward(got, 1.0)
    assert fired == [True] and weight.grad is None
    torch.testing.assert_close(weight.main_grad, plain.grad, rtol=2e-2, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("main_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_gradient_computed_in_forward_goes_into_main_grad_in_one_pass_times_d_loss(main_dtype, monkeypatch):
    """The scalar route computes dW in forward: backward adds it into main_grad times d loss with one kernel
    (kernels.head.add_scaled_), not a scaling pass and an add; the result is the plain call's dW."""
    import headloss.main_grad as main_grad_module

    calls = []
    real = main_grad_module.add_scaled_
    monkeypatch.setattr(main_grad_module, "add_scaled_", lambda *a: calls.append(a[0].dtype) or real(*a))
    h, w, y = _batch(6)
    plain = w.clone().requires_grad_()
    _backward(headloss.linear_head_loss(h, plain, y, SPECS["fused"], chunk_bytes=3 * V * 4), -1.3)
    weight = w.clone().requires_grad_()
    start = torch.randn(V, H, generator=generator(7), dtype=torch.float64)
    weight.main_grad = start.to(main_dtype)
    weight.grad_added_to_main_grad = False
    got = headloss.linear_head_loss(h, weight, y, SPECS["fused"], chunk_bytes=3 * V * 4, weight_grad="main_grad")
    _backward(got, -1.3)
    assert calls == [main_dtype] and weight.grad_added_to_main_grad and weight.main_grad.dtype == main_dtype
    tol = dict(rtol=1e-5, atol=1e-6) if main_dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(weight.main_grad.double(), start.to(main_dtype).double() + plain.grad.double(), **tol)


@needs_kernel
def test_fp32_weight_grad_computed_in_forward_reaches_main_grad_unrounded(monkeypatch):
    """A bf16 weight, an fp32 main_grad, the scalar route (dW in forward) and fp32_weight_grad=True: the dW
    backward adds is the fp32 sum of the chunks' g.T @ h (their own bf16 gradient rows, read by a spy), not
    that sum rounded to bf16 first (about 2**-9 relative: 200x the tolerance)."""
    import headloss.chunks as chunks_module

    seen = []
    real = chunks_module.add_dw
    monkeypatch.setattr(chunks_module, "add_dw",
                        lambda dw, g, h, beta=1.0: seen.append((g.double(), h.double())) or real(dw, g, h, beta))
    gen = generator(8)
    n = 40
    h = torch.randn(n, H, generator=gen, dtype=torch.float64).bfloat16()
    w = torch.randn(V, H, generator=gen, dtype=torch.float64).bfloat16()
    y = torch.randint(0, V, (n,), generator=gen)
    weight = w.clone().requires_grad_()
    weight.main_grad = torch.zeros(V, H)
    weight.grad_added_to_main_grad = False
    out = headloss.linear_head_loss(h, weight, y, SPECS["fused"], chunk_bytes=8 * V * 2, fp32_weight_grad=True,
                                    weight_grad="main_grad")
    assert out.route.startswith("lm_head:fused") and len(seen) == 5
    _backward(out, -0.6)
    want = -0.6 * sum(g.T @ hc for g, hc in seen)
    assert weight.grad_added_to_main_grad and weight.grad is not None and weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(weight.main_grad.double(), want, rtol=1e-5, atol=1e-6)
