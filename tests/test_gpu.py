"""GPU tests: real compiled kernels at real sizes. Skipped without CUDA; run on a GPU machine:

    python -m pytest -m gpu tests/test_gpu.py

They run the compiled kernels: with TRITON_INTERPRET=1 set they are skipped (the interpreter is the
CPU test default only).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import check_sequence_extremes, fast_log1p_error

import headloss
from headloss.head import INLINE_PREPARE_SLOTS
from headloss.kernels.head import head_kernel
from headloss.plan import SPEC_OBJECT_CONSTANT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="GPU tests run the compiled kernels: unset TRITON_INTERPRET"),
]

FULL = headloss.LossSpec(
    z_loss={"weight": 1e-4},
    entropy={"weight": 0.0},
    token_accuracy=True,
    outputs=("predicted_tokens", "logprobs", "lse", "entropy", "token_loss"),
)
EXOTIC = headloss.LossSpec(
    cross_entropy={"label_smoothing": 0.1},
    z_loss={"weight": 1e-3},
    entropy={"weight": -0.05},
    transform={"softcap": 30.0, "temperature": 0.8, "logit_scale": 1.5},
)


def _batch(rows, vocab, dtype, seed, ignore_frac=0.1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3.0).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[torch.rand(rows, device="cuda", generator=gen) < ignore_frac] = -100
    # plant the max at the target in a third of the rows so accuracy is not trivially 0
    planted = torch.arange(rows, device="cuda") % 3 == 0
    safe = targets.clamp(min=0)
    logits[planted, safe[planted]] = logits.max() + 1
    return logits, targets


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _lm_head(gen: torch.Generator, shape: tuple[int, int, int, int], dtype: torch.dtype) -> tuple:
    """(hidden [b, t, h], weight [v, h] / 16, their logits), each in ``dtype``, drawn from ``gen`` next;
    ``shape``: (b, t, v, h)."""
    b, t, v, h = shape
    hidden = torch.randn(b, t, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 16).to(dtype)
    return hidden, weight, (hidden.float() @ weight.float().T).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", [FULL, EXOTIC], ids=["full", "softcap-smoothing-entropy-bonus"])
def test_kernel_matches_fp64_reference_at_llama3_vocab(dtype, spec):
    logits, targets = _batch(257, 128256, dtype, seed=1)
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, spec)
    out.loss.backward()
    r = logits.double().requires_grad_()
    ref = headloss.reference.reference_head_loss(r, targets, spec)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    for name, value in ref.metrics.items():
        assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-5, atol=1e-6), name
    for name in spec.outputs:
        got, want = getattr(out, name), getattr(ref, name)
        if name == "predicted_tokens":
            assert torch.equal(got, want)
        else:
            assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), name
    grad_tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert x.grad.norm() > 0
    assert _rel(x.grad, r.grad) < grad_tol


def test_rows_past_grid_limit_and_int32_offsets():
    """70000 rows (> 65535) and N*V > 2**31 elements: every row is addressed right."""
    rows, vocab = 70_000, 32_768
    logits, targets = _batch(rows, vocab, torch.bfloat16, seed=2, ignore_frac=0.0)
    spec = headloss.LossSpec(token_accuracy=True, outputs=("predicted_tokens", "logprobs"))
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, spec, inplace_grad=True)
    out.loss.backward()
    check = torch.tensor([0, 1, 65_535, 65_536, 69_998, 69_999], device="cuda")
    ref_x = logits[check].double().requires_grad_()
    ref = headloss.reference.reference_head_loss(ref_x, targets[check], spec.model_copy(update={"reduction": "sum"}))
    (ref.loss / rows).backward()
    assert torch.equal(out.predicted_tokens[check], ref.predicted_tokens)
    assert torch.allclose(out.logprobs[check].double(), ref.logprobs, atol=1e-4)
    assert _rel(x.grad[check], ref_x.grad) < 8e-3


def test_vocab_262144_and_odd_vocab():
    for vocab in (262_144, 151_937):
        logits, targets = _batch(64, vocab, torch.bfloat16, seed=3)
        x = logits.clone().requires_grad_()
        out = headloss.head_loss(x, targets, FULL)
        out.loss.backward()
        r = logits.double().requires_grad_()
        ref = headloss.reference.reference_head_loss(r, targets, FULL)
        ref.loss.backward()
        assert abs(out.loss.item() - ref.loss.item()) < 1e-4
        assert _rel(x.grad, r.grad) < 8e-3


def _variants() -> int:
    return sum(len(cache[0]) for cache in head_kernel.device_caches.values())


def test_new_weights_and_temperature_do_not_recompile():
    logits, targets = _batch(64, 5000, torch.bfloat16, seed=4)
    base = dict(z_loss={"weight": 1e-4}, entropy={"weight": 0.1}, transform={"temperature": 0.9})
    headloss.head_loss(logits.clone().requires_grad_(), targets, headloss.LossSpec(**base)).loss.backward()
    before = _variants()
    for w in (2e-4, 3e-4):
        for temp in (0.7, 1.3):
            spec = headloss.LossSpec(
                z_loss={"weight": w}, entropy={"weight": -w}, transform={"temperature": temp}, ignore_index=-1
            )
            headloss.head_loss(logits.clone().requires_grad_(), targets.clamp(min=0), spec).loss.backward()
    assert _variants() == before


def _ptx_of_variant(spec, logits, targets) -> str:
    head_kernel.device_caches.clear()
    headloss.head_loss(logits.clone().requires_grad_(), targets, spec).loss.backward()
    compiled = [k for c in head_kernel.device_caches.values() for k in c[0].values()]
    assert len(compiled) == 1, "expected exactly one compiled variant"
    return compiled[0].asm["ptx"]


def test_unrequested_outputs_are_compiled_out():
    logits, targets = _batch(32, 3000, torch.bfloat16, seed=5)
    ce_only = _ptx_of_variant(headloss.LossSpec(), logits, targets)
    full = _ptx_of_variant(FULL, logits, targets)
    # the CE-only variant has no entropy math, no argmax reduction and fewer stores
    assert ce_only.count("st.global") < full.count("st.global")
    assert len(ce_only) < len(full)


@pytest.mark.parametrize("case", ["full", "distill", "grpo", "grpo-shift"])
def test_hot_path_has_no_host_sync_with_default_arguments(case):
    logits, targets = _batch(128, 32000, torch.bfloat16, seed=6)
    spec, inputs = FULL, {}
    if case == "distill":
        spec = headloss.LossSpec(distillation={"divergence": "jsd", "temperature": 2.0})
        inputs = {"teacher_logits": logits.flip(-1).contiguous()}
    if case.startswith("grpo"):
        spec = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "grpo", "kl_beta": 0.04})
        logits, targets = logits.view(4, 32, -1), targets.clamp(min=0).view(4, 32)
        inputs = dict(advantages=torch.randn(4, device="cuda"), old_logprobs=torch.full((4, 32), -10.0, device="cuda"),
                      ref_logprobs=torch.full((4, 32), -10.0, device="cuda"))
        if case == "grpo-shift":
            targets = targets[:, 1:]
            inputs = {k: v[:, 1:] if v.dim() == 2 else v for k, v in inputs.items()}
            inputs.update(shift=True, num_items_in_batch=torch.tensor(100.0, device="cuda"))
    x = logits.clone().requires_grad_()
    headloss.head_loss(x, targets, spec, **inputs).loss.backward()  # compile first
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = headloss.head_loss(x, targets, spec, **inputs)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss)


def test_the_lm_head_skips_ignored_rows_without_a_host_sync_given_its_scored_rows():
    gen = torch.Generator(device="cuda").manual_seed(12)
    hidden = torch.randn(2, 700, 256, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(32000, 256, device="cuda", generator=gen) / 16).bfloat16().requires_grad_()
    labels = torch.randint(0, 32000, (2, 700), device="cuda", generator=gen)
    labels[0, :300] = -100  # a prompt
    chunk = 256 * 32000 * 2  # 256 rows a chunk

    def run(compact):
        hidden.grad = weight.grad = None
        out = headloss.linear_head_loss(hidden, weight, labels, FULL, shift=True, compact=compact, chunk_bytes=chunk)
        out.loss.backward()
        return out, hidden.grad.clone(), weight.grad.clone()

    want, dh, dw = run(True)  # (compiles the kernels)
    torch.cuda.synchronize()
    ahead = headloss.scored_rows(labels, shift=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        mine, dh_mine, dw_mine = run(ahead)
        with pytest.raises(RuntimeError, match="synchronizing"):  # compact=True: nonzero's count waits
            run(True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(mine.loss, want.loss) and torch.equal(mine.logprobs, want.logprobs)
    assert torch.equal(dh_mine, dh) and torch.equal(dw_mine, dw)


def test_the_hf_patch_does_not_wait_for_the_gpu_where_the_labels_are_the_input_ids():
    """labels=input_ids (T > 64): the patched forward queues no ScoredRows and its head computes every row, so
    the host runs ahead of a GPU still busy (a sleep kernel of 150 ms or more queued first) instead of waiting
    for it to pass the forward's start; a masked copy of the labels keeps the handle and its wait."""
    import time

    transformers = pytest.importorskip("transformers")
    from headloss.integrations.transformers import patch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).cuda().bfloat16()
    ids = torch.randint(0, 32000, (2, 512), device="cuda")
    masked = ids.clone()
    masked[:, :200] = -100

    def host_ms(labels) -> float:
        model(input_ids=ids, labels=labels).loss.backward()  # (compiles)
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(300_000_000)  # clock cycles: at least 150 ms at an H100 / H200 top clock (1.98 GHz)
        model(input_ids=ids, labels=labels)
        took = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
        return took

    with patch(model, verify=False):
        ahead, waited = host_ms(ids), host_ms(masked)
    assert ahead < 100 < waited, (ahead, waited)


@pytest.mark.parametrize("fp32_weight_grad", [False, True], ids=["bf16-dW", "fp32-dW"])
def test_a_forward_computed_weight_gradient_goes_into_main_grad_times_d_loss(fp32_weight_grad):
    gen = torch.Generator(device="cuda").manual_seed(13)
    hidden = torch.randn(1000, 512, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(50257, 512, device="cuda", generator=gen) / 16).bfloat16()
    labels = torch.randint(0, 50257, (1000,), device="cuda", generator=gen)
    plain = w.clone().requires_grad_()
    (headloss.linear_head_loss(hidden, plain, labels, chunk_bytes=300 * 50257 * 2).loss * 0.37).backward()
    weight = w.clone().requires_grad_()
    start = torch.randn(50257, 512, device="cuda", generator=gen)
    weight.main_grad, weight.grad_added_to_main_grad = start.clone(), False
    out = headloss.linear_head_loss(hidden, weight, labels, chunk_bytes=300 * 50257 * 2, weight_grad="main_grad",
                                    fp32_weight_grad=fp32_weight_grad)
    assert out.route == "lm_head:fused"
    (out.loss * 0.37).backward()
    assert weight.grad_added_to_main_grad and weight.grad.dtype == torch.bfloat16
    assert _rel(weight.main_grad - start, plain.grad.float()) < 5e-3  # (plain's dW is rounded to bf16)


def test_inplace_gradient_needs_only_per_row_memory():
    rows, vocab = 8192, 128256
    logits, targets = _batch(rows, vocab, torch.bfloat16, seed=7)
    x = logits.requires_grad_()
    headloss.head_loss(x, targets, FULL, inplace_grad=True).loss.backward()  # compile first
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    headloss.head_loss(x, targets, FULL, inplace_grad=True).loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 64 * rows * 8  # a few fp32/int64 vectors per row, nothing of size N*V
    assert x.grad.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("spec", [headloss.LossSpec(), FULL], ids=["ce", "full"])
def test_linear_head_matches_torch_eager_at_llama3_size(spec):
    """hidden [8192, 4096] x weight [128256, 4096], bf16: loss, metrics and all gradients vs fp32 eager."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 32).to(torch.bfloat16).requires_grad_()
    bias = (torch.randn(v, device="cuda", generator=gen) * 0.1).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    targets[::7] = -100
    out = headloss.linear_head_loss(hidden, weight, targets, spec, bias=bias)
    out.loss.backward()
    grads = [t.grad for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    ref = headloss.reference.reference_head_loss(
        torch.nn.functional.linear(hidden.float(), weight.float(), bias.float()), targets, spec
    )
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) < 2e-3 * abs(ref.loss.item())
    for name in ref.metrics:
        assert torch.allclose(out.metrics[name].float(), ref.metrics[name].float(), rtol=2e-3, atol=2e-3), name
    for got, t in zip(grads, (hidden, weight, bias)):
        assert got.norm() > 0
        assert _rel(got, t.grad) < 2e-2


@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_distillation_matches_fp64_reference_at_llama3_vocab(divergence, beta):
    spec = headloss.LossSpec(
        cross_entropy={"weight": 0.5}, z_loss={"weight": 1e-4},
        distillation={"weight": 0.5, "divergence": divergence, "beta": beta, "temperature": 2.0,
                      "scale_by_temperature_squared": True},
    )
    logits, targets = _batch(129, 128256, torch.bfloat16, seed=9)
    teacher, _ = _batch(129, 128256, torch.bfloat16, seed=10)
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, spec, teacher_logits=teacher)
    out.loss.backward()
    r = logits.double().requires_grad_()
    ref = headloss.reference.reference_head_loss(r, targets, spec, teacher_logits=teacher.double())
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    for name, value in ref.metrics.items():
        assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-5, atol=1e-5), name
    assert _rel(x.grad, r.grad) < 8e-3


SPARSE_CASES = {
    "verl": {"teacher": "topk", "topk": "verl", "log_prob_min_clamp": -12.0},
    "renormalized-reverse": {"teacher": "topk", "topk": "renormalized", "divergence": "reverse_kl"},
    "rest-jsd": {"teacher": "topk", "topk": "rest", "divergence": "jsd", "beta": 0.3},
    "token-k3+": {"teacher": "token", "estimator": "k3", "estimator_clamp": True, "estimator_grad": "k2"},
}


def _sparse_teacher(logits, targets, k, seed):
    """A teacher near the student: its top-k ids (a few rows padded with -1) and log-probs, and its
    log-prob at each target."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    teacher = torch.log_softmax(logits.float() + torch.randn(logits.shape, device="cuda", generator=gen), -1)
    top = teacher.topk(k, dim=-1)
    ids = top.indices.clone()
    ids[::7, k // 2:] = -1
    return ids, top.values, teacher.gather(-1, targets.clamp(min=0)[:, None])[:, 0]


@pytest.mark.parametrize("k", [64, 256])
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_teacher_matches_fp64_reference_at_qwen_vocab(case, k):
    """A top-k or per-token teacher on the compiled kernels (logits and lm_head, bf16, V 151936, an
    odd row count) against the plain-torch path in fp64: loss, metrics, gradients."""
    spec = headloss.LossSpec(cross_entropy={"weight": 0.5}, distillation=SPARSE_CASES[case], token_accuracy=True)
    logits, targets = _batch(129, 151936, torch.bfloat16, seed=31)
    ids, lp, lp_token = _sparse_teacher(logits, targets, k, seed=32)
    kw = dict(teacher_ids=ids, teacher_logprobs=lp) if spec.distillation.teacher == "topk" else \
        dict(teacher_logprobs=lp_token)
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, spec, **kw)
    out.loss.backward()
    r = logits.double().requires_grad_()
    ref = headloss.head_loss(r, targets, spec, backend="torch", **kw)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    for name, value in ref.metrics.items():
        assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-5, atol=1e-5), name
    assert _rel(x.grad, r.grad) < 8e-3
    # the fused lm_head on the same rows: hidden [129, 256] x weight [151936, 256]
    gen = torch.Generator(device="cuda").manual_seed(33)
    hidden = (torch.randn(129, 256, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(151936, 256, device="cuda", generator=gen) / 8).to(torch.bfloat16).requires_grad_()
    fused = headloss.linear_head_loss(hidden, weight, targets, spec, chunk_bytes=32 << 20, **kw)
    fused.loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = headloss.head_loss(h64 @ w64.t(), targets, spec, backend="torch", **kw)
    want.loss.backward()
    assert abs(fused.loss.item() - want.loss.item()) <= 1e-4 * max(1.0, abs(want.loss.item()))
    assert _rel(hidden.grad, h64.grad) < 2e-2 and _rel(weight.grad, w64.grad) < 2e-2


OBJECTIVE_CASES = {
    "dapo": {"loss_type": "dapo"}, "grpo": {"loss_type": "grpo"},
    "cispo": {"objective": "cispo", "eps_high": 1.2}, "cispo-verl": {"objective": "cispo", "convention": "verl"},
    "sapo": {"objective": "sapo", "loss_type": "grpo"}, "gpg": {"objective": "gpg"},
    "dro": {"objective": "dro", "dro_beta": 0.3},
    "dppo_tv": {"objective": "dppo_tv", "eps_low": 1e-5, "eps_high": 2e-5},
    "dppo_kl": {"objective": "dppo_kl", "eps_low": 1e-9, "eps_high": 2e-9},
    "verl-k3+": {"convention": "verl", "dual_clip_c": 1.3, "kl_clamp": True, "kl_grad": "k2", "kl_estimator": "k3"},
}


@pytest.mark.parametrize("case", list(OBJECTIVE_CASES))
def test_grpo_matches_fp64_reference_at_llama3_vocab(case):
    """Every policy objective through the compiled kernel (the DPPO thresholds are tiny because a
    128256-way softmax gives tiny probabilities)."""
    policy = {"loss_type": "dapo", "kl_beta": 0.04, "eps_high": 0.28, "entropy_coef": 0.01, **OBJECTIVE_CASES[case]}
    spec = headloss.LossSpec(cross_entropy=None, transform={"temperature": 0.9}, policy=policy)
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, t, v = 2, 64, 128256
    logits = (torch.randn(b, t, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double() / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    inputs = dict(
        advantages=torch.randn(b, device="cuda", generator=gen),
        old_logprobs=(logp + 0.3 * torch.randn(logp.shape, device="cuda", generator=gen, dtype=torch.float64)).float(),
        ref_logprobs=(logp + 0.1 * torch.randn(logp.shape, device="cuda", generator=gen, dtype=torch.float64)).float(),
        loss_mask=(torch.arange(t, device="cuda") < 50).float().expand(b, t).contiguous(),
        num_items_in_batch=100,
    )
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, spec, **inputs)
    out.loss.backward()
    r = logits.double().requires_grad_()
    as_fp64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    ref = headloss.reference.reference_head_loss(r, ids, spec, **as_fp64)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-4 * max(1.0, abs(ref.loss.item()))
    assert set(out.metrics) == set(ref.metrics)
    for name, value in ref.metrics.items():
        assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-4, atol=1e-5), name
    assert r.grad.norm() > 0
    assert _rel(x.grad, r.grad) < 8e-3


def test_linear_head_with_teacher_hidden_and_policy_matches_eager():
    """Fused lm_head with a computed teacher (hidden x weight) and the policy term, bf16, V=128256."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    b, t, h, v = 4, 256, 1024, 128256
    hidden = torch.randn(b, t, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 16).to(torch.bfloat16).requires_grad_()
    t_hidden = torch.randn(b, t, h, device="cuda", generator=gen).to(torch.bfloat16)
    t_weight = (torch.randn(v, h, device="cuda", generator=gen) / 16).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    spec = headloss.LossSpec(
        cross_entropy={"weight": 0.3}, distillation={"weight": 0.5, "temperature": 2.0},
        policy={"loss_type": "grpo", "kl_beta": 0.04},
    )
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen),
                  old_logprobs=-torch.rand(b, t, device="cuda", generator=gen) * 3 - 9,
                  ref_logprobs=-torch.rand(b, t, device="cuda", generator=gen) * 3 - 9)
    out = headloss.linear_head_loss(hidden, weight, ids, spec, teacher_hidden=t_hidden, teacher_weight=t_weight,
                           chunk_bytes=64 << 20, **inputs)
    out.loss.backward()
    grads = [hidden.grad, weight.grad]
    hidden.grad = weight.grad = None
    ref = headloss.reference.reference_head_loss(
        torch.nn.functional.linear(hidden.float(), weight.float()), ids, spec,
        teacher_logits=torch.nn.functional.linear(t_hidden.float(), t_weight.float()), **inputs,
    )
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) < 5e-3 * max(1.0, abs(ref.loss.item()))
    for got, leaf in zip(grads, (hidden, weight)):
        assert got.norm() > 0 and _rel(got, leaf.grad) < 3e-2


@pytest.mark.parametrize("case", [(4, 96, False, False, "one"), (33, 1500, True, True, "none"),
                                  (7, 3, True, False, "all"), (300, 17, False, False, "none")])
def test_sequence_extremes_kernel_equals_the_torch_ops(case):
    check_sequence_extremes("cuda", *case, seed=5)


@pytest.mark.parametrize("case", [
    dict(policy=dict(loss_type="dapo", importance_sampling="sequence"), batch=8, length=700, vocab=32000),
    dict(policy=dict(loss_type="grpo", importance_sampling="sequence_token", convention="verl", kl_beta=0.1,
                     kl_importance_correction=True, entropy_coef=0.01), batch=5, length=97, vocab=5000, empty="one",
         input_dtype=torch.bfloat16),
    dict(policy=dict(loss_type="bnpo", importance_sampling="sequence", off_policy_mask=0.05, kl_beta=0.04,
                     entropy_coef=0.02, entropy_aggregation="token-mean"), batch=3, length=33, vocab=300,
         rollout=True, shift=False, input_dtype=torch.float64),
    dict(policy=dict(loss_type="dapo", objective="sapo", importance_sampling="sequence", kl_beta=0.04,
                     kl_estimator="k2"), batch=2, length=1, vocab=7, empty="all"),
    dict(policy=dict(loss_type="dr_grpo", max_completion_length=64, objective="dppo_kl", kl_beta=0.1),
         batch=4, length=64, vocab=1000, per_token_adv=True, weights=True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_policy_kernels_equal_the_torch_ops(case, dtype):
    """The deferred mode's policy term by its two kernels, compiled, on the inputs as given and on fp32
    copies, against the torch ops: loss, metrics and gradient."""
    from conftest import check_policy_objective

    from headloss.spec import Policy

    case = dict(case)
    policy = Policy(**case.pop("policy"))
    check_policy_objective("cuda", policy, case.pop("batch"), case.pop("length"), case.pop("vocab"), seed=7,
                           shift=case.pop("shift", True), logits_dtype=dtype, **case)


def test_lm_head_grpo_metrics_match_fp64_reference_without_a_host_sync():
    """TRL-shaped GRPO on the fused lm_head (completion ids, a loss mask, num_items on the device) with
    compact=False: no host sync in the call or its backward (the per-sequence clip extremes are two
    launches, not torch ops that could read the device), and every policy metric as the reference's."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    b, t, h, v = 4, 96, 512, 32000
    hidden = torch.randn(b, t + 1, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 8).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    logits = torch.nn.functional.linear(hidden.detach().double(), weight.detach().double())[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0].float()
    mask = torch.ones(b, t, device="cuda")
    mask[:, 80:] = 0
    mask[1, 40:] = 0
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen),
                  old_logprobs=logp + 0.3 * torch.randn(b, t, device="cuda", generator=gen),
                  ref_logprobs=logp + 0.1 * torch.randn(b, t, device="cuda", generator=gen), loss_mask=mask,
                  num_items_in_batch=mask.sum())
    spec = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04})
    headloss.linear_head_loss(hidden, weight, ids, spec, shift=True, compact=False, **inputs).loss.backward()
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = headloss.linear_head_loss(hidden, weight, ids, spec, shift=True, compact=False, **inputs)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = headloss.reference.reference_head_loss(logits, ids, spec, **inputs)
    assert abs(out.loss.item() - ref.loss.item()) < 1e-2 * max(1.0, abs(ref.loss.item()))
    names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
             "clip_ratio/high_max", "ratio/mean", "ratio/min", "ratio/max", "kl")
    for name in names:  # bf16 logits: a clip indicator at its boundary may flip (1/40 of a sequence at most)
        got, want = float(out.metrics[name]), float(ref.metrics[name])
        assert abs(got - want) <= 0.03 * max(1.0, abs(want)), (name, got, want)
    assert 0 < float(out.metrics["clip_ratio/high_max"]) < 1 and float(out.metrics["ratio/max"]) > 1.2


# --- the kernel boundary: compile, CUDA graphs, shift, validation, the launch fast path ------------


SFT = headloss.LossSpec(z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True,
                        outputs=("predicted_tokens",))
SFT_AS_DICT = SFT.model_dump(mode="json")  # a plain dict spec: compiled once, at trace time


@pytest.mark.parametrize("entry", ["logits", "hidden", "hidden-grpo"])
def test_torch_compile_fullgraph_inductor_matches_eager(entry):
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(20)
    if entry == "logits":
        x = (torch.randn(4, 257, 32000, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        y = torch.randint(0, 32000, (4, 256), device="cuda", generator=gen)

        def step(x, y):
            out = headloss.head_loss(x, y, SFT_AS_DICT, shift=True)
            return out.loss * 1.0, out.metrics["token_accuracy"], out.metrics["z_loss"]

        inputs = [x]
    else:
        x = torch.randn(1000, 512, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(32000, 512, device="cuda", generator=gen) / 16).to(torch.bfloat16)
        y = torch.randint(0, 32000, (1000,), device="cuda", generator=gen)

        def step(x, w, y):
            out = headloss.linear_head_loss(x, w, y, SFT, chunk_bytes=64 << 20)
            return out.loss * 1.0, out.metrics["token_accuracy"], out.metrics["z_loss"]

        inputs = [x, w]
    if entry == "hidden-grpo":  # a token-level policy term on the lm_head (the eager routes' checks stay out)
        policy_inputs = dict(advantages=torch.randn(4, device="cuda", generator=gen),
                             old_logprobs=-10.4 + 0.1 * torch.randn(4, 250, device="cuda", generator=gen),
                             ref_logprobs=-10.4 + 0.1 * torch.randn(4, 250, device="cuda", generator=gen))
        spec = headloss.LossSpec(cross_entropy=None, policy={"kl_beta": 0.04, "eps_high": 0.28})

        def step(x, w, y):
            out = headloss.linear_head_loss(x.view(4, 250, 512), w, y.view(4, 250), spec, chunk_bytes=64 << 20,
                                            **policy_inputs)
            return out.loss * 1.0, out.metrics["kl"], out.metrics["clip_ratio/high_mean"]

    eager = [t.clone().requires_grad_() for t in inputs]
    compiled = [t.clone().requires_grad_() for t in inputs]
    want = step(*eager, y)
    got = torch.compile(step, fullgraph=True)(*compiled, y)
    want[0].backward()
    got[0].backward()
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled, eager):
        assert _rel(a.grad, b.grad) < 1e-6



@pytest.mark.skipif(not SPEC_OBJECT_CONSTANT, reason="torch < 2.13: Dynamo gives assume_constant_result no object")
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_torch_compile_dynamic_shapes_with_two_specs_match_eager(entry):
    """torch.compile(dynamic=True), Inductor: two LossSpec objects (other floats and terms) and two row counts,
    each call's loss, metric and input gradient equal to eager's, on the compiled kernels."""
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(21)
    specs = (SFT, headloss.LossSpec(cross_entropy={"label_smoothing": 0.1}, z_loss={"weight": 3e-4},
                                    transform={"temperature": 0.8}, token_accuracy=True))
    w = (torch.randn(32000, 512, device="cuda", generator=gen) / 16).to(torch.bfloat16)

    def step(x, y, spec):
        if entry == "logits":
            out = headloss.head_loss(x, y, spec)
        else:
            out = headloss.linear_head_loss(x, w, y, spec, chunk_bytes=64 << 20)
        return out.loss * 1.0, out.metrics["token_accuracy"]

    compiled_step = torch.compile(step, fullgraph=True, dynamic=True)
    for rows in (600, 1000):
        x = torch.randn(rows, 32000 if entry == "logits" else 512, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch.randint(0, 32000, (rows,), device="cuda", generator=gen)
        for spec in specs:
            eager, compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
            want, got = step(eager, y, spec), compiled_step(compiled, y, spec)
            want[0].backward()
            got[0].backward()
            for a, b in zip(got, want):
                assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
            assert _rel(compiled.grad, eager.grad) < 1e-6

RL_COMPILED = {
    "grpo-fused": (headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04,
                                                                 "kl_estimator": "k3"}), "logits", "fused"),
    "gspo-deferred+kernels": (headloss.LossSpec(cross_entropy=None, policy={
        "loss_type": "dapo", "importance_sampling": "sequence", "eps_low": 3e-4, "eps_high": 4e-4}), "logits",
        "deferred+kernels"),
    "gspo-lm_head-sequences+kernels": (headloss.LossSpec(cross_entropy=None, policy={
        "loss_type": "dapo", "importance_sampling": "sequence", "eps_low": 3e-4, "eps_high": 4e-4}), "hidden",
        "lm_head:sequences+kernels"),
}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("case", list(RL_COMPILED))
def test_torch_compile_runs_the_policy_routes_on_their_kernels(case, mode):
    """An RL micro-batch (TRL's inputs: a float completion mask, num_items_in_batch a device tensor)
    compiled (fullgraph) on the eager route's kernels: the same route, values and gradients; under
    reduce-overhead (CUDA graph trees) across replays with new inputs."""
    torch._dynamo.reset()
    spec, entry, route = RL_COMPILED[case]
    gen = torch.Generator(device="cuda").manual_seed(23)
    batch, length, vocab, hidden = 4, 64, 32000, 256

    def batch_inputs():
        mask = (torch.rand(batch, length, device="cuda", generator=gen) > 0.1).float()
        old = -10.4 + 0.1 * torch.randn(batch, length, device="cuda", generator=gen)
        return dict(advantages=torch.randn(batch, device="cuda", generator=gen), old_logprobs=old,
                    ref_logprobs=old - 0.05, loss_mask=mask, num_items_in_batch=mask.sum())

    ids = torch.randint(0, vocab, (batch, length), device="cuda", generator=gen)
    if entry == "logits":
        x = (torch.randn(batch, length + 1, vocab, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        leaves = [x]

        def step(x, policy):
            out = headloss.head_loss(x, ids, spec, shift=True, **policy)
            return out.loss, out.metrics, out.route
    else:
        h = torch.randn(batch, length, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / 16).to(torch.bfloat16)
        leaves = [h, w]

        def step(h, w, policy):
            out = headloss.linear_head_loss(h, w, ids, spec, **policy)
            return out.loss, out.metrics, out.route

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(4):  # warm-up, record, replays
        policy = batch_inputs()
        eager = [t.clone().requires_grad_() for t in leaves]
        traced = [t.clone().requires_grad_() for t in leaves]
        want = step(*eager, policy)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        got = compiled(*traced, policy)
        assert want[2] == route and got[2] == route
        want[0].backward()
        got[0].backward()
        assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        for name, value in want[1].items():
            assert torch.allclose(got[1][name].float(), value.float(), rtol=1e-5, atol=1e-6), name
        for a, b in zip(traced, eager):
            assert _rel(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("handoff", [True, False], ids=["handed-off", "in-graph"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_hands_the_fused_gradient_over_without_a_copy(mode, handoff, monkeypatch):
    """A large gradient (here: HANDOFF_MIN_BYTES lowered to 0) autograd gets from a compiled fused
    step is the buffer the kernel wrote in forward (no Inductor clone); a small one stays in the graph
    (nothing handed over). Under reduce-overhead (CUDA graph trees) replays stay correct."""
    import headloss.engine as engine
    import headloss.ops
    from headloss.ops import hand_off

    torch._dynamo.reset()
    if handoff:
        monkeypatch.setattr(headloss.ops, "HANDOFF_MIN_BYTES", 0)
    written = []
    monkeypatch.setattr(engine, "hand_off",
                        lambda grads: written.extend(g.data_ptr() for g, _ in filter(None, grads)) or hand_off(grads))
    gen = torch.Generator(device="cuda").manual_seed(22)
    x = (torch.randn(2048, 32000, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 32000, (2048,), device="cuda", generator=gen)

    def step(x, y, scale):
        return headloss.head_loss(x, y, SFT).loss * scale

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for i in range(4):  # warm-up, record, replays
        scale = torch.tensor(1.0 + i, device="cuda")
        x.grad = None
        compiled(x, y, scale).backward()
        got = x.grad.clone()
        if mode == "default" and handoff:
            assert x.grad.data_ptr() in written
        if not handoff:
            assert not written
        x.grad = None
        step(x, y, scale).backward()
        assert _rel(got, x.grad) < 1e-6


def _replay(step, *leaves):
    """(output, loss, the first leaf's gradient) of one replay of a CUDA graph of ``step()`` and its
    backward, captured after the caller's warmup; the leaves' gradients are cleared before and after."""
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
        out.loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    result = out, out.loss.clone(), leaves[0].grad.clone()
    for t in leaves:
        t.grad = None
    return result


@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_cuda_graph_capture_and_replay_with_default_arguments(entry):
    gen = torch.Generator(device="cuda").manual_seed(21)
    if entry == "logits":
        leaf = (torch.randn(2048, 32000, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
        w = None
        y = torch.randint(0, 32000, (2048,), device="cuda", generator=gen)
        y[::9] = -100

        def step():
            return headloss.head_loss(leaf, y, SFT)
    else:
        leaf = torch.randn(512, 256, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(32000, 256, device="cuda", generator=gen) / 16).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, 32000, (512,), device="cuda", generator=gen)
        y[::9] = -100

        def step():
            return headloss.linear_head_loss(leaf, w, y, SFT, chunk_bytes=16 << 20)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            leaf.grad = None
            step().loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    out, captured_loss, captured_grad = _replay(step, *(t for t in (leaf, w) if t is not None))
    eager = step()
    eager.loss.backward()
    # eager lm_head skips ignored rows (one host read of their count), a captured one computes them
    # all: other chunks, so other bf16 GEMM accumulation orders
    tol = 1e-6 if entry == "logits" else 1e-2
    assert torch.allclose(captured_loss, eager.loss, rtol=tol)
    assert _rel(captured_grad, leaf.grad) < tol
    assert float(out.metrics["n_tokens"]) == float(eager.metrics["n_tokens"])


def test_cuda_graph_capture_after_pinned_host_copies():
    """A process that has used pinned memory (a DataLoader with pin_memory=True, a non-blocking copy to
    the host) holds cached pinned blocks with CUDA events; allocating pinned memory during a capture
    would query them and invalidate the capture. A captured call takes a verdict slot reserved
    before: the capture holds, and its replay gives eager's loss and gradient."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    x = (torch.randn(512, 32000, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, 32000, (512,), device="cuda", generator=gen)

    def step():
        return headloss.head_loss(x, y, SFT)

    step().loss.backward()  # the board exists, the kernels are compiled
    for _ in range(4):  # cached pinned blocks with recorded events
        host = torch.empty(1 << 16, pin_memory=True)
        host.copy_(torch.randn(1 << 16, device="cuda"), non_blocking=True)
        del host
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.grad = None
        step().loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    _, captured_loss, captured_grad = _replay(step, x)
    eager = step()
    eager.loss.backward()
    assert torch.allclose(captured_loss, eager.loss, rtol=1e-6)
    assert _rel(captured_grad, x.grad) < 1e-6


def test_cuda_graph_capture_of_the_lm_head_with_a_top_entropy_mask():
    """Under capture the lm_head's top-entropy mask takes deferred mode (the guessed route's correction
    reads a count on the host): a captured call replays to the eager loss and gradient. The warmup
    ran the guessed route, so the capture is the first deferred call."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    b, t, h, v = 4, 128, 256, 32000
    leaf = torch.randn(b, t, h, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=gen) / 16).requires_grad_()
    y = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen),
                  old_logprobs=-10.4 + 0.2 * torch.randn(b, t, device="cuda", generator=gen),
                  loss_mask=(torch.rand(b, t, device="cuda", generator=gen) > 0.1).long())
    spec = headloss.LossSpec(cross_entropy=None, policy={"top_entropy_quantile": 0.3, "eps_high": 0.28})

    def step():
        return headloss.linear_head_loss(leaf, w, y, spec, chunk_bytes=64 * v * 4, compact=False, **inputs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            leaf.grad = w.grad = None
            step().loss.backward()
            # a model's own backward GEMMs, as in any real warmup: they set up cuBLAS on autograd's
            # device thread, where the captured deferred backward runs its GEMMs (without them the
            # capture fails creating that handle: CUBLAS_STATUS_NOT_INITIALIZED)
            (leaf.detach().requires_grad_() @ w.detach().T).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    _, captured_loss, captured_grad = _replay(step, leaf, w)
    eager = step()
    eager.loss.backward()
    assert torch.allclose(captured_loss, eager.loss, rtol=1e-5, atol=1e-7)
    assert _rel(captured_grad, leaf.grad) < 1e-4


def _in_a_fresh_process(request) -> bool:
    """Run the calling test again alone in a new process (True: it ran there and passed; the caller
    returns), unless this is that process (False)."""
    import subprocess
    import sys

    if os.environ.get("HEADLOSS_TEST_FRESH_PROCESS") == "1":
        return False
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                           request.node.nodeid], cwd=request.config.rootpath, capture_output=True, text=True,
                          env={**os.environ, "HEADLOSS_TEST_FRESH_PROCESS": "1"})
    assert done.returncode == 0, f"{request.node.nodeid} in a fresh process:\n{done.stdout[-4000:]}"
    return True


@pytest.mark.parametrize("case", ["sft", "grpo", "hidden"])
def test_make_graphed_callables_replays_equal_eager_with_new_inputs(case, request):
    """torch.cuda.make_graphed_callables over a head-loss call returning the loss and
    out.packed_metrics(): forward and backward each replay one graph behind an autograd.Function.
    With new values copied into the inputs (the differentiable ones and those the call closes over)
    before each call, a replay's loss, every metric and the gradients equal an eager call's on the
    same values.

    Each case runs in a process of its own: after other tests had captured and freed graphs in the
    same process (pytest-xdist's worker), the hidden case's capture failed inside cuBLAS
    (CUBLAS_STATUS_EXECUTION_FAILED at its GEMM, torch 2.11, twice on 2 x H200), and alone it passed.
    make_graphed_callables captures on torch.cuda.graph's one shared stream, whose cuBLAS workspace
    torch keeps between graphs (pytorch/pytorch#193402 describes that state going stale)."""
    if _in_a_fresh_process(request):
        return
    gen = torch.Generator(device="cuda").manual_seed(37)
    n, v = 512, 32000
    rows = (n,) if case != "grpo" else (4, n // 4)  # a policy term on [B, T, V] logits
    y = torch.randint(0, v, rows, device="cuda", generator=gen)
    if case == "hidden":
        args = (torch.randn(n, 256, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(),
                (torch.randn(v, 256, device="cuda", generator=gen) / 16).to(torch.bfloat16).requires_grad_())
        closed = {}

        def call(h, w):
            return headloss.linear_head_loss(h, w, y, SFT, chunk_bytes=16 << 20)
    else:
        args = ((torch.randn(*rows, v, device="cuda", generator=gen) * 2).to(torch.bfloat16).requires_grad_(),)
        spec = SFT if case == "sft" else headloss.LossSpec(
            cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04, "kl_estimator": "k3"})
        closed = {} if case == "sft" else dict(
            advantages=torch.randn(rows[0], device="cuda", generator=gen),
            old_logprobs=-12.4 + 0.3 * torch.randn(rows, device="cuda", generator=gen),
            ref_logprobs=-12.4 + 0.3 * torch.randn(rows, device="cuda", generator=gen))

        def call(x):
            return headloss.head_loss(x, y, spec, **closed)

    names: list[str] = []

    def flat(*leaves):  # the metrics as one output (each output costs the graphed callable host time)
        out = call(*leaves)
        names[:] = list(out.metrics)
        return out.loss, out.packed_metrics()

    if case == "hidden":  # a model's own backward GEMM first (cuBLAS set up on autograd's device thread)
        (args[0].detach().requires_grad_() @ args[1].detach().T).sum().backward()
    graphed = torch.cuda.make_graphed_callables(flat, args)
    for trial in range(2):
        with torch.no_grad():  # the next batch, written into the tensors the graphs read
            for t in args:
                t.copy_(torch.randn(t.shape, device="cuda", generator=gen) * (0.06 if t.shape[-2:] == (v, 256) else 2))
            y.copy_(torch.randint(0, v, rows, device="cuda", generator=gen))
            y.view(-1)[trial::7] = -100
            for t in closed.values():
                t.add_(0.1 * torch.randn(t.shape, device="cuda", generator=gen))
        for t in args:
            t.grad = None
        loss, packed = graphed(*args)
        loss.backward()
        torch.cuda.synchronize()
        got = [loss.clone(), *packed.clone().unbind(0)], [t.grad.clone() for t in args]
        for t in args:
            t.grad = None
        eager = call(*args)
        eager.loss.backward()
        # the eager lm_head skips ignored rows (one host read of their count), a captured one computes
        # them all: other chunks, so other bf16 GEMM accumulation orders
        tol = 1e-2 if case == "hidden" else 1e-6
        assert torch.allclose(got[0][0], eager.loss, rtol=tol), (trial, float(got[0][0]), float(eager.loss))
        assert len(got[0]) == len(names) + 1
        for name, value in zip(names, got[0][1:]):
            assert torch.allclose(value, eager.metrics[name].double(), rtol=tol, atol=1e-6), (trial, name)
        for grad, t in zip(got[1], args):
            assert _rel(grad, t.grad) < tol, trial


def test_graph_replays_with_new_targets_each_prepare_their_own_count():
    """One of the head kernel's programs prepares the call (counted rows) and tags it with a nonce baked
    into the graph: every replay elects its own preparer (the last program clears the ticket) and must
    wait for its own count, never read the last replay's."""
    logits, targets = _batch(4096, 32000, torch.bfloat16, seed=31)
    x = logits.clone().requires_grad_()
    y = targets.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.grad = None
            headloss.head_loss(x, y, FULL).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = headloss.head_loss(x, y, FULL)
        out.loss.backward()
    gen = torch.Generator(device="cuda").manual_seed(32)
    for ignore_frac in (0.05, 0.6, 0.0, 0.95):
        fresh = torch.randint(0, 32000, (4096,), device="cuda", generator=gen)
        fresh[torch.rand(4096, device="cuda", generator=gen) < ignore_frac] = -100
        y.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        got_loss, got_grad, got_n = out.loss.clone(), x.grad.clone(), int(out.metrics["n_tokens"])
        ref = torch.nn.functional.cross_entropy(logits.double(), fresh, ignore_index=-100)
        eager_x = logits.clone().requires_grad_()
        eager = headloss.head_loss(eager_x, fresh, FULL)
        eager.loss.backward()
        assert got_n == int((fresh != -100).sum())
        assert torch.allclose(got_loss, eager.loss, rtol=1e-6)
        assert _rel(got_grad, eager_x.grad) < 1e-6
        assert abs(float(out.metrics["ce"]) - float(ref)) <= 1e-4 * float(ref)


@pytest.mark.parametrize("rows", [INLINE_PREPARE_SLOTS, INLINE_PREPARE_SLOTS + 1])
def test_in_kernel_prepare_with_a_tiny_vocabulary(rows):
    """V = 8: every row's stats pass ends long before the preparing program has counted all the targets,
    so the other programs really wait for it (one slot more: a prepare launch of its own)."""
    logits, targets = _batch(rows, 8, torch.float32, seed=33, ignore_frac=0.3)
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, FULL)
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64, targets, ignore_index=-100)
    ref_z = (torch.logsumexp(x64, -1)[targets != -100] ** 2).mean()
    (ref + 1e-4 * ref_z).backward()
    assert int(out.metrics["n_tokens"]) == int((targets != -100).sum())
    assert abs(float(out.metrics["ce"]) - float(ref)) <= 1e-5 * float(ref)
    assert _rel(x.grad, x64.grad) < 1e-5


def test_bad_targets_are_raised_by_the_next_call_without_a_host_wait():
    logits, targets = _batch(64, 32000, torch.bfloat16, seed=22)
    targets[5] = 40000
    x = logits.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = headloss.head_loss(x, targets)  # returns: the check runs on the device
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isnan(out.loss)
    with pytest.raises(ValueError, match=r"targets: value 40000 at position \(5,\) .* after that call returned"):
        headloss.head_loss(x, targets.clamp(max=31999))
    with pytest.raises(ValueError, match=r"targets: value 40000 at position \(5,\) is outside \[0, 32000\)"):
        headloss.head_loss(x, targets, validate="sync")
    torch.cuda.synchronize()
    headloss.check_pending()  # nothing left


def test_a_bad_teacher_id_is_raised_by_the_next_call_without_a_host_wait():
    """A top-k teacher's id outside the vocabulary, with the default validation: the call returns (no
    host wait), its row is NaN, and the next call raises naming teacher_ids and the entry."""
    logits, targets = _batch(64, 32000, torch.bfloat16, seed=41)
    ids, lp, _ = _sparse_teacher(logits, targets, 8, seed=42)
    ids[5, 3] = 32000
    spec = headloss.LossSpec(cross_entropy=None, distillation={"teacher": "topk"})
    out = headloss.head_loss(logits, targets, spec, teacher_ids=ids, teacher_logprobs=lp)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"teacher_ids: the id at row 5, entry 3 is outside \[0, 32000\)"):
        headloss.head_loss(logits, targets)
    assert not torch.isfinite(out.loss)


def test_a_repeated_teacher_id_is_raised_by_the_next_call_without_a_host_wait():
    """Two entries of one id in a row (each a real entry), with the default validation: the device check
    (each row's ids sorted, neighbours compared) finds it without a host wait, and the next call raises
    naming teacher_ids, the row and the later entry; TRL's padding (id 0 at log-prob -inf, repeated) is
    no entry and passes, as on the plain-torch path."""
    logits, targets = _batch(300, 32000, torch.bfloat16, seed=43)
    ids, lp, _ = _sparse_teacher(logits, targets, 64, seed=44)
    ids, lp = ids.clone(), lp.clone()
    ids[::7] = torch.arange(64, device="cuda")  # rows without -1 entries
    spec = headloss.LossSpec(cross_entropy=None, distillation={"teacher": "topk", "topk": "rest"})
    padded_ids, padded_lp = ids.clone(), lp.clone()
    padded_ids[3, 40:], padded_lp[3, 40:] = 0, float("-inf")
    headloss.head_loss(logits, targets, spec, teacher_ids=padded_ids, teacher_logprobs=padded_lp)
    torch.cuda.synchronize()
    headloss.check_pending()
    ids[211, 50] = ids[211, 17]
    torch.cuda.set_sync_debug_mode("error")
    try:
        headloss.head_loss(logits, targets, spec, teacher_ids=ids, teacher_logprobs=lp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"teacher_ids: the id at row 211, entry 50 repeats an earlier entry"):
        headloss.head_loss(logits, targets)
    with pytest.raises(ValueError, match=r"teacher_ids: the id \d+ at row 211, entry 50 repeats an earlier entry"):
        headloss.head_loss(logits, targets, spec, teacher_ids=ids, teacher_logprobs=lp, validate="sync")


def test_rest_teacher_at_its_edges_is_trls_fp64_value_on_the_compiled_kernels():
    """``topk: rest`` where the student's or the teacher's top-k mass is (or rounds to) 1, and student tails
    from 1e-3 down to TRL's clamp, on the logits (fused and per-token) and the lm_head: TRL's value
    (tests/trl_oracle.py, fp64), finite, with its gradient."""
    import math

    import trl_oracle

    z = torch.tensor([7.0, 10.0, 12.0, 14.0, 15.5, 16.5, 17.5, 24.0, 30.0])
    logits = torch.zeros(len(z) + 2, 128, device="cuda")
    logits[:len(z), 0] = z.cuda()
    logits[len(z):] = torch.randn(2, 128, device="cuda")
    k = 128
    ids = torch.full((len(z) + 2, k), -1, dtype=torch.long, device="cuda")
    lq = torch.zeros(len(z) + 2, k, device="cuda")
    ids[:len(z), 0], lq[:len(z), 0] = 0, math.log(0.9)
    ids[-2] = torch.arange(k, device="cuda")  # K = V: the student's tail is 0
    lq[-2] = (torch.log_softmax(torch.randn(k, device="cuda", dtype=torch.float64), 0) + math.log1p(-1e-5)).float()
    ids[-1, 0], lq[-1, 0] = 5, 0.0  # a certain teacher: its tail is 0
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        beta = trl_oracle.beta_of(divergence, 0.5)
        x64 = logits.detach().double().cpu().requires_grad_()
        want = trl_oracle.token_divergence(x64, ids.cpu(), lq.cpu(), "rest", beta)
        want.mean().backward()
        spec = headloss.LossSpec(cross_entropy=None, distillation={"teacher": "topk", "topk": "rest",
                                                                   "divergence": divergence})
        for entry in ("logits", "none", "lm_head"):
            if entry == "lm_head":
                x = logits.clone().requires_grad_()
                out = headloss.linear_head_loss(x, torch.eye(128, device="cuda"), None, spec, teacher_ids=ids,
                                                teacher_logprobs=lq)
                out.loss.backward()
            elif entry == "none":
                x = logits.clone().requires_grad_()
                out = headloss.head_loss(x, None, spec.model_copy(update={"reduction": "none"}), teacher_ids=ids,
                                         teacher_logprobs=lq)
                torch.testing.assert_close(out.loss.detach().double().cpu(), want.detach(), rtol=2e-5, atol=1e-6)
                (out.loss.mean()).backward()
            else:
                x = logits.clone().requires_grad_()
                out = headloss.head_loss(x, None, spec, teacher_ids=ids, teacher_logprobs=lq)
                out.loss.backward()
            loss = out.loss.mean().item()
            assert math.isfinite(loss) and abs(loss - want.mean().item()) <= 2e-5 * abs(want.mean().item()), \
                (divergence, entry, loss, want.mean().item())
            assert _rel(x.grad.cpu(), x64.grad) < 1e-4, (divergence, entry)


def _holder(kind: str):
    """A kernel whose every program stays on its SM until ``flag`` (device int32) turns nonzero, and how many
    of its programs to launch so that all of them are resident at once: a holder with programs still queued
    would keep any later kernel, of any library, from starting (the block scheduler serves launches in order).

    ``whole-sm``: 1024 threads and the block's opt-in shared memory, so each program owns an SM (CuPy compiles
    it; the GPU image ships CuPy). ``threads``: a Triton program of 1024 threads, at most two to an SM; one
    fewer than the SMs to hold keeps every program resident whatever the scheduler packs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if kind == "whole-sm":
        cp = pytest.importorskip("cupy")
        import numpy as np

        kernel = cp.RawKernel(r"""extern "C" __global__ void hold(const volatile int* flag) {
            extern __shared__ int pad[];
            if (threadIdx.x == 0) pad[0] = 1;
            while (*flag == 0) { __nanosleep(2000); }
        }""", "hold")
        smem = cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, 0)
        kernel.max_dynamic_shared_size_bytes = smem

        def launch(flag, programs, stream):
            with cp.cuda.ExternalStream(stream.cuda_stream):
                kernel((programs,), (1024,), (np.uint64(flag.data_ptr()),), shared_mem=smem)

        return launch, sms - 1  # one SM left for the head call
    import triton
    import triton.language as tl

    @triton.jit
    def hold(flag):
        spins = 0
        while tl.load(flag, volatile=True) == 0:
            spins += 1

    def launch(flag, programs, stream):
        with torch.cuda.stream(stream):
            hold[(programs,)](flag, num_warps=32)

    return launch, sms - 8


@pytest.mark.parametrize("kind", ["whole-sm", "threads"])
def test_the_head_kernel_runs_beside_a_kernel_holding_most_sms(kind):
    """The in-kernel prepare's preparer is the first program to take the call's ticket, not program 0:
    with another stream's kernel holding most of the SMs (its programs spin until a copy engine lets them
    go), the call (inline prepare, gradient, policy counters) completes on what is left, with the values
    of the call run alone."""
    import time

    launch, programs = _holder(kind)
    b, t, vocab = 16, 256, 32000
    logits, ids = _batch(b * t, vocab, torch.bfloat16, seed=51)
    logits, ids = logits.view(b, t, vocab), ids.clamp(min=0).view(b, t)
    assert b * t <= INLINE_PREPARE_SLOTS
    gen = torch.Generator(device="cuda").manual_seed(52)
    policy = dict(advantages=torch.randn(b, device="cuda", generator=gen),
                  old_logprobs=-torch.rand(b, t, device="cuda", generator=gen))
    spec = headloss.LossSpec(cross_entropy=None, entropy={"weight": 0.0}, policy={"loss_type": "dapo"})

    def call():
        x = logits.clone().requires_grad_()
        out = headloss.head_loss(x, ids, spec, **policy)
        out.loss.backward()
        return out, x

    want, want_x = call()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")  # polled in device memory: no host traffic
    release = torch.ones(1, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize()
    side, copier = torch.cuda.Stream(), torch.cuda.Stream()
    launch(flag, programs, side)
    time.sleep(0.2)  # the holder's programs are placed before the call's
    got, got_x = call()
    done = torch.cuda.Event()
    done.record()
    deadline = time.time() + 30
    while not done.query() and time.time() < deadline:
        time.sleep(0.005)
    finished = done.query()
    held = not side.query()  # the holder was still running when the call finished
    with torch.cuda.stream(copier):  # a copy engine lets the holding programs go, whatever the SMs do
        flag.copy_(release, non_blocking=True)
    torch.cuda.synchronize()
    assert finished, "the head call did not finish beside the kernel holding the SMs"
    assert held, "the holder ended before the call did: the test held nothing"
    assert torch.equal(got.loss, want.loss)
    assert {k: v.item() for k, v in got.metrics.items()} == {k: v.item() for k, v in want.metrics.items()}
    assert torch.equal(got_x.grad, want_x.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [
    dict(cross_entropy={"label_smoothing": 0.1}, z_loss={"weight": 1e-3}, entropy={"weight": 0.02},
         token_accuracy=True),
    dict(distillation={"divergence": "jsd", "temperature": 1.5}),
    dict(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04}),
    dict(cross_entropy=None, policy={"loss_type": "grpo", "importance_sampling": "sequence"}),
], ids=["sft", "jsd", "dapo", "gspo"])
def test_per_row_temperature_on_the_compiled_kernels_scores_the_logits_over_t(spec, dtype):
    """Each row at its own temperature (one per sequence) equals the call at temperature 1 on the
    logits divided by it, d/dz = d/dx / t; the fused lm_head equals an fp64 oracle on the logits its
    GEMM gives; a bad temperature is found on the device and raised by check_pending."""
    b, t, v, h = 4, 300, 32000, 256
    gen = torch.Generator(device="cuda").manual_seed(61)
    temperature = 0.5 + torch.rand(b, device="cuda", generator=gen)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), dtype)
    inputs = {}
    if "distillation" in spec:
        inputs["teacher_logits"] = (logits.float() + torch.randn(b, t, v, device="cuda", generator=gen)).to(dtype)
    if "policy" in spec:
        old = -10.4 + 0.2 * torch.randn(b, t, device="cuda", generator=gen)
        inputs.update(advantages=torch.randn(b, device="cuda", generator=gen), old_logprobs=old,
                      ref_logprobs=old + 0.05)
    rowwise = headloss.LossSpec(transform={"per_row_temperature": True}, **spec)
    plain = headloss.LossSpec(**spec)
    scaled = temperature[:, None, None]
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, rowwise, temperature=temperature, **inputs)
    out.loss.backward()
    xt = (logits.float() / scaled).to(dtype).requires_grad_()  # the same values the kernel reads, in fp32
    ref = headloss.head_loss(xt, ids, plain, **inputs)
    ref.loss.backward()
    tol = 2e-3 if dtype == torch.bfloat16 else 2e-5  # bf16: the divided logits rounded once more
    assert abs(out.loss.item() - ref.loss.item()) <= tol * max(abs(ref.loss.item()), 1.0)
    assert _rel(x.grad.float(), xt.grad.float() / scaled) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    if "distillation" not in spec:  # the fused lm_head against an fp64 oracle on the logits its GEMM rounds
        hh = hidden.clone().requires_grad_()
        lin = headloss.linear_head_loss(hh, weight, ids, rowwise, temperature=temperature, chunk_bytes=64 << 20,
                                        **inputs)
        lin.loss.backward()
        z = logits.double().requires_grad_()
        want = headloss.head_loss(z, ids, rowwise, backend="torch", temperature=temperature, **inputs)
        want.loss.backward()
        assert abs(lin.loss.item() - want.loss.item()) <= 1e-4 * max(abs(want.loss.item()), 1.0)
        assert _rel(hh.grad.float(), z.grad @ weight.double()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    bad = temperature.clone()
    bad[2] = 0.0
    headloss.head_loss(logits, ids, rowwise, temperature=bad, **inputs)
    with pytest.raises(ValueError, match=r"temperature: the value at position \(2, 0\) is not a positive"):
        headloss.check_pending(wait=True)


def test_a_per_row_temperature_variant_keeps_to_the_registers_of_the_plain_one():
    """From its second launch a per-row temperature's head kernel runs compiled with maxnreg at the
    registers of the same variant without it (kernels.launch._fitted) where that spills nothing: the
    same loss and gradient bit for bit as its first, uncapped launch, and no more registers than the
    plain variant."""
    from headloss.kernels import head as kernels_head

    b, t, v = 8, 256, 32000
    gen = torch.Generator(device="cuda").manual_seed(71)
    logits = torch.randn(b, t, v, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    old = -10.4 + 0.2 * torch.randn(b, t, device="cuda", generator=gen)
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen), old_logprobs=old, ref_logprobs=old + 0.05)
    spec = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04},
                             transform={"per_row_temperature": True})
    temperature = 0.5 + torch.rand(b, device="cuda", generator=gen)
    results = []
    for _ in range(4):  # the first two launches compile and run uncapped, the later ones the fitted variant
        x = logits.clone().requires_grad_()
        out = headloss.head_loss(x, ids, spec, temperature=temperature, **inputs)
        out.loss.backward()
        results.append((out.loss.detach(), x.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
    # (a capped build that spills is compiled, then left unused: Triton's cache keeps it). The cap is the
    # registers of a build without it (the plain sibling's); other tests' variants share the cache, so the
    # check is of each capped build against its own cap, which an uncapped build holds
    compiled = [k for caches in kernels_head.head_kernel.device_caches.values() for k in caches[0].values()]
    capped = [k for k in compiled if k.metadata.maxnreg and k.n_spills == 0]
    assert capped
    uncapped = {k.n_regs for k in compiled if not k.metadata.maxnreg}
    assert any(k.n_regs <= k.metadata.maxnreg and k.metadata.maxnreg in uncapped for k in capped)
    assert min(k.n_regs for k in capped) < max(uncapped)  # below the per-row temperature's own build


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_a_teacher_given_as_probabilities_on_the_compiled_kernels(divergence, dtype):
    """teacher_probs = softmax(teacher logits) scores as the logits teacher (log q read on load), on the
    logits and the fused lm_head; a row that does not sum to 1 is found on the device (check_pending)."""
    b, t, v, h = 4, 300, 32000, 256
    gen = torch.Generator(device="cuda").manual_seed(63)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), dtype)
    teacher = logits.float() + torch.randn(b, t, v, device="cuda", generator=gen)
    probs = torch.softmax(teacher, -1)
    given = headloss.LossSpec(distillation={"teacher": "probs", "divergence": divergence})
    plain = headloss.LossSpec(distillation={"divergence": divergence})
    x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, given, teacher_probs=probs)
    out.loss.backward()
    ref = headloss.head_loss(xr, ids, plain, teacher_logits=teacher)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-4 * abs(ref.loss.item())
    assert _rel(x.grad.float(), xr.grad.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
    hh, hr = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    lin = headloss.linear_head_loss(hh, weight, ids, given, teacher_probs=probs, chunk_bytes=64 << 20)
    lin.loss.backward()
    lin_ref = headloss.linear_head_loss(hr, weight, ids, plain, teacher_logits=teacher, chunk_bytes=64 << 20)
    lin_ref.loss.backward()
    assert abs(lin.loss.item() - lin_ref.loss.item()) <= 1e-4 * abs(lin_ref.loss.item())
    assert _rel(hh.grad.float(), hr.grad.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-4)
    bad = probs.clone()
    bad[3, 7] *= 1.01
    headloss.head_loss(logits, ids, given, teacher_probs=bad)
    with pytest.raises(ValueError, match=r"teacher_probs: the row at position \(3, 7\) does not sum to 1"):
        headloss.check_pending(wait=True)


@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_a_topk_teacher_given_as_probabilities_on_the_compiled_kernels(entry):
    """teacher_probs [.., K] beside teacher_ids equals the call with their log as teacher_logprobs, bit
    for bit, on the logits and the fused lm_head; a negative one is found on the device, named."""
    b, t, v, h, k = 4, 300, 32000, 256, 16
    gen = torch.Generator(device="cuda").manual_seed(67)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), torch.bfloat16)
    top = torch.log_softmax(logits.float() + torch.randn(b, t, v, device="cuda", generator=gen), -1).topk(k, -1)
    probs = top.values.exp()
    spec = headloss.LossSpec(distillation={"teacher": "topk", "topk": "rest", "divergence": "jsd"})

    def call(**teacher):
        leaf = (logits if entry == "logits" else hidden).clone().requires_grad_()
        if entry == "logits":
            out = headloss.head_loss(leaf, ids, spec, teacher_ids=top.indices, **teacher)
        else:
            out = headloss.linear_head_loss(leaf, weight, ids, spec, teacher_ids=top.indices, chunk_bytes=64 << 20,
                                            **teacher)
        out.loss.backward()
        return out.loss, leaf.grad

    from headloss.inputs import topk_logprobs

    loss, grad = call(teacher_probs=probs)
    want, want_grad = call(teacher_logprobs=topk_logprobs(probs))
    assert torch.isfinite(loss) and loss.item() == want.item() and torch.equal(grad, want_grad)
    bad = probs.clone()
    bad[2, 5, 3] = -0.5
    with pytest.raises(ValueError, match=r"teacher_probs: the value at row 605, entry 3 is not a probability"):
        call(teacher_probs=bad)  # (the lm_head's compaction reads the verdict in the call)
        headloss.check_pending(wait=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", [{"cross_entropy": {"label_smoothing": 0.1}, "z_loss": {"weight": 1e-4}},
                                  {"cross_entropy": None, "distillation": {"divergence": "jsd"}}],
                         ids=["sft", "jsd"])
def test_token_weights_on_the_compiled_kernels_weigh_each_tokens_loss_and_gradient(spec, dtype):
    """The weighted call is sum(w * L) / sum(w) over the same spec's per-token losses (reduction none), its
    gradient that sum's, on the logits and the fused lm_head (against an fp64 oracle on the logits its GEMM
    gives); a negative weight is found on the device and raised by check_pending."""
    b, t, v, h = 4, 300, 32000, 256
    gen = torch.Generator(device="cuda").manual_seed(73)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    ids[1, :40] = -100
    w = 2 * torch.rand(b, t, device="cuda", generator=gen)
    w[2, 7:20] = 0.0
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), dtype)
    inputs = {}
    if "distillation" in spec:
        inputs["teacher_logits"] = (logits.float() + torch.randn(b, t, v, device="cuda", generator=gen)).to(dtype)
    weighted = headloss.LossSpec(token_weights={}, **spec)
    x, xr = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, weighted, token_weights=w, **inputs)
    out.loss.backward()
    per_token = headloss.head_loss(xr, ids, headloss.LossSpec(reduction="none", **spec), **inputs)
    want = (w * per_token.loss).sum() / (w * (ids != -100)).sum()
    want.backward()
    assert abs(out.loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert _rel(x.grad.float(), xr.grad.float()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    if "distillation" not in spec:  # the fused lm_head against an fp64 oracle on the logits its GEMM rounds
        hh = hidden.clone().requires_grad_()
        lin = headloss.linear_head_loss(hh, weight, ids, weighted, token_weights=w, chunk_bytes=64 << 20)
        lin.loss.backward()
        z = logits.double().requires_grad_()
        oracle = headloss.head_loss(z, ids, weighted, backend="torch", token_weights=w.double())
        oracle.loss.backward()
        assert abs(lin.loss.item() - oracle.loss.item()) <= 1e-4 * abs(oracle.loss.item())
        assert _rel(hh.grad.float(), z.grad @ weight.double()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    bad = w.clone()
    bad[3, 9] = -1.0
    headloss.head_loss(logits, ids, weighted, token_weights=bad, **inputs)
    with pytest.raises(ValueError, match=r"token_weights: the value at position \(3, 9\) is not a finite number"):
        headloss.check_pending(wait=True)


@pytest.mark.parametrize("normalize", ["weights", "tokens"])
def test_token_weights_in_the_policy_terms_aggregation_on_the_compiled_kernels(normalize):
    """GRPO (dapo + k3 KL, TRL's entropy mean) with the CE beside it and token weights: the fused epilogue and
    the lm_head equal the plain-torch path in fp64 on the same logits."""
    b, t, v, h = 4, 300, 32000, 256
    gen = torch.Generator(device="cuda").manual_seed(79)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    w = 2 * torch.rand(b, t, device="cuda", generator=gen)
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), torch.bfloat16)
    old = -10.4 + 0.2 * torch.randn(b, t, device="cuda", generator=gen)
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen), old_logprobs=old, ref_logprobs=old + 0.05,
                  loss_mask=(torch.rand(b, t, device="cuda", generator=gen) > 0.1).float(), token_weights=w)
    spec = headloss.LossSpec(cross_entropy={"weight": 0.3}, token_weights={"normalize": normalize},
                             policy={"loss_type": "dapo", "kl_beta": 0.04, "entropy_coef": 0.01,
                                     "entropy_aggregation": "token-mean"})
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, spec, **inputs)
    out.loss.backward()
    hh = hidden.clone().requires_grad_()
    lin = headloss.linear_head_loss(hh, weight, ids, spec, chunk_bytes=64 << 20, **inputs)
    lin.loss.backward()
    z = logits.double().requires_grad_()
    want = headloss.head_loss(z, ids, spec, backend="torch", **inputs)
    want.loss.backward()
    for got in (out, lin):
        assert abs(got.loss.item() - want.loss.item()) <= 1e-4 * max(abs(want.loss.item()), 1e-2)
    assert _rel(x.grad.float(), z.grad.float()) < 1e-2
    assert _rel(hh.grad.float(), (z.grad @ weight.double()).float()) < 2e-2


@pytest.mark.parametrize("fp32_weight_grad", [False, True], ids=["bf16-dW", "fp32-dW"])
def test_quack_weight_gradient_accumulation_equals_cublas(fp32_weight_grad, monkeypatch):
    """dw_gemm.DW_GEMM "quack" (quack-kernels' GEMM for dW after the first chunk, at headloss's pinned config on
    Hopper): the same loss, dh, and dW within the GEMMs' rounding as cuBLAS's addmm, over several chunks."""
    pytest.importorskip("quack.gemm_interface")
    from headloss import dw_gemm

    n, h, v = 1000, 512, 32000
    gen = torch.Generator(device="cuda").manual_seed(83)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 16).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    grads, calls = {}, []
    original = dw_gemm.quack_gemm_add
    monkeypatch.setattr(dw_gemm, "quack_gemm_add",
                        lambda major: lambda a, b, out: (calls.append(a.shape[1]), original(major)(a, b, out)))
    for impl in ("cublas", "quack"):
        monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", impl)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = headloss.linear_head_loss(hh, ww, ids, chunk_bytes=128 * v * 2, fp32_weight_grad=fp32_weight_grad)
        out.loss.backward()
        grads[impl] = (out.loss.detach(), hh.grad, ww.grad)
    assert calls == [128] * 6 + [104]  # (every accumulation after the first chunk, the short last one too)
    (loss_c, dh_c, dw_c), (loss_q, dh_q, dw_q) = grads["cublas"], grads["quack"]
    assert torch.equal(loss_c, loss_q) and torch.equal(dh_c, dh_q)
    assert _rel(dw_q.float(), dw_c.float()) < (1e-2 if not fp32_weight_grad else 1e-5)


@pytest.mark.parametrize("case", ["quack", "at the threshold", "few rows", "odd vocabulary", "side stream",
                                  "failed before"])
def test_the_default_weight_gradient_gemm_is_quack_where_it_runs_and_cublas_elsewhere(case, monkeypatch):
    """DW_GEMM "auto" (the default) on a Hopper GPU with quack-kernels installed: chunks of QUACK_MIN_ROWS rows
    or more accumulate dW with quack (counted), fewer rows or a vocabulary whose rows quack's loads cannot take
    with cuBLAS; loss and dh equal cuBLAS's, dW within the GEMMs' rounding (against fp64 too). "side stream": the
    call on a stream held back by a long sleep, so that a quack launch on any other stream would read the chunk
    before its gradient is written. "failed before": a device where a quack call raised earlier (QUACK_FAILED)
    stays with cuBLAS."""
    pytest.importorskip("quack.gemm_interface")
    from headloss import dw_gemm

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("auto sends dW to quack on Hopper only")
    rows = {"at the threshold": dw_gemm.QUACK_MIN_ROWS, "few rows": 512}.get(case, 768)
    failed = {torch.cuda.current_device(): "RuntimeError"} if case == "failed before" else {}
    monkeypatch.setattr(dw_gemm, "QUACK_FAILED", failed)
    n, h, v = 3 * rows + 100, 512, 32003 if case == "odd vocabulary" else 32000
    gen = torch.Generator(device="cuda").manual_seed(84)
    hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / 16).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    calls = []
    original = dw_gemm.quack_gemm_add

    def counted(major):
        add = original(major)
        return lambda a, b, out: (calls.append(a.shape[1]), add(a, b, out))

    monkeypatch.setattr(dw_gemm, "quack_gemm_add", counted)
    grads = {}
    side = torch.cuda.Stream()
    if case == "side stream":  # (quack's first call compiles, and loading the kernel waits for the device)
        monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", "auto")
        headloss.linear_head_loss(hidden, weight.clone().requires_grad_(), ids, chunk_bytes=rows * v * 2,
                                  compact=False).loss.backward()
        calls.clear()
    for impl in ("cublas", "auto"):
        monkeypatch.setitem(dw_gemm.DW_GEMM, "impl", impl)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side if case == "side stream" else torch.cuda.current_stream()):
            if case == "side stream":
                torch.cuda._sleep(1 << 31)  # (about a second of the side stream's time, no host wait)
            out = headloss.linear_head_loss(hh, ww, ids, chunk_bytes=rows * v * 2, compact=False, validate=False)
            out.loss.backward()
        torch.cuda.synchronize()
        grads[impl] = (out.loss.detach(), hh.grad, ww.grad)
    # chunks after the first: two of `rows` rows and the last of 100; quack takes the full ones
    assert calls == ([rows, rows] if case in ("quack", "at the threshold", "side stream") else [])
    (loss_c, dh_c, dw_c), (loss_a, dh_a, dw_a) = grads["cublas"], grads["auto"]
    assert torch.equal(loss_c, loss_a) and torch.equal(dh_c, dh_a)
    assert _rel(dw_a.float(), dw_c.float()) < 1e-2
    logits = hidden.double() @ weight.double().t()
    g = torch.softmax(logits, -1) - torch.nn.functional.one_hot(ids, v).double()
    assert _rel(dw_a.float(), (g.t() @ hidden.double() / n).float()) < 1e-2


def test_bad_num_items_on_the_device_is_raised_by_check_pending():
    logits, targets = _batch(64, 32000, torch.bfloat16, seed=23)
    headloss.head_loss(logits, targets, num_items_in_batch=torch.tensor(0.0, device="cuda"))
    with pytest.raises(ValueError, match="num_items_in_batch: expected a positive finite number, got 0.0"):
        headloss.check_pending(wait=True)


def test_a_bad_target_inside_a_captured_graph_is_raised_after_replay():
    logits, targets = _batch(256, 32000, torch.bfloat16, seed=24)
    x = logits.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        headloss.head_loss(x, targets).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        headloss.head_loss(x, targets).loss.backward()
    graph.replay()
    headloss.check_pending(wait=True)  # good targets: nothing to raise
    targets[7] = -3
    graph.replay()
    with pytest.raises(ValueError, match=r"targets: value -3 at position \(7,\)"):
        headloss.check_pending(wait=True)


def test_grpo_from_the_full_model_logits_equals_the_slice_and_adds_no_memory():
    spec = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": 0.04, "eps_high": 0.28})
    gen = torch.Generator(device="cuda").manual_seed(25)
    b, k, v = 4, 256, 128256
    logits = (torch.randn(b, k + 1, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, k), device="cuda", generator=gen)
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen),
                  old_logprobs=-torch.rand(b, k, device="cuda", generator=gen) - 10,
                  ref_logprobs=-torch.rand(b, k, device="cuda", generator=gen) - 10)
    a = logits.clone().requires_grad_()
    sliced = logits.clone().requires_grad_()
    headloss.head_loss(sliced[:, :-1], ids, spec, **inputs).loss.backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = headloss.head_loss(a, ids, spec, shift=True, inplace_grad=True, **inputs)
    out.loss.backward()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 64 << 20  # per-row buffers only, no [B, L, V] tensor
    assert a.grad.data_ptr() == a.data_ptr() and torch.all(a.grad[:, -1] == 0)
    assert _rel(a.grad, sliced.grad) < 1e-6


def test_dft_matches_fp64_reference_at_llama3_vocab():
    spec = headloss.LossSpec(cross_entropy={"weight": 0.5}, dft={"weight": 1.0}, token_accuracy=True)
    logits, targets = _batch(257, 128256, torch.bfloat16, seed=26)
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, targets, spec)
    out.loss.backward()
    r = logits.double().requires_grad_()
    ref = headloss.reference.reference_head_loss(r, targets, spec)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    assert abs(out.metrics["dft"].item() - ref.metrics["dft"].item()) < 1e-5
    assert _rel(x.grad, r.grad) < 8e-3


def test_fast_launch_picks_the_variant_of_an_unaligned_view():
    """The launch fast path keys variants as Triton does: a view whose rows start one element off a
    16-byte boundary runs its own (unaligned) variant, with the same results."""
    logits, targets = _batch(300, 32000, torch.float32, seed=27)
    padded = torch.zeros(300, 32001, device="cuda")
    padded[:, 1:] = logits
    results = []
    for x in (logits, padded[:, 1:], logits):  # aligned, unaligned, aligned again (all from the cache)
        leaf = x.clone() if x.is_contiguous() else x.detach()
        leaf.requires_grad_()
        out = headloss.head_loss(leaf, targets, SFT)
        out.loss.backward()
        results.append((out.loss.item(), leaf.grad.float()))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) < 1e-6 and _rel(grad, results[0][1]) < 1e-6


def test_repeated_calls_launch_from_the_fast_table_and_skip_triton_binding(monkeypatch):
    """After the first call, a repeated call (its own nonce for the in-kernel prepare each time) finds
    every launch in the fast table: no new entry, no native_specialize_impl, no Triton launch."""
    from headloss.kernels import launch

    logits, targets = _batch(512, 32000, torch.bfloat16, seed=34)
    x = logits.clone().requires_grad_()
    for spec in (SFT, FULL):
        for _ in range(2):
            x.grad = None
            headloss.head_loss(x, targets, spec).loss.backward()
    before = dict(launch._FAST)
    slow = []
    monkeypatch.setattr(launch, "_native_specialize", lambda *a: slow.append(a))
    for spec in (SFT, FULL, SFT):
        x.grad = None
        headloss.head_loss(x, targets, spec).loss.backward()
    torch.cuda.synchronize()
    assert not slow and launch._FAST == before


# --- vocab-parallel over NCCL ----------------------------------------------------------------------


def _nccl_rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        from headloss.parallel import COLLECTIVES

        n, v, h = 1000, 50257, 256  # V odd, uneven shards
        widths = [v // world + (1 if r < v % world else 0) for r in range(world)]
        start, width = sum(widths[:rank]), widths[rank]
        gen = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
        ids[::7] = -100
        errs = {}
        deferred = headloss.LossSpec(z_loss={"weight": 1e-3}, entropy={"weight": 0.01}, reduction="none",
                                     outputs=("logprobs",), differentiable_outputs=True)
        teacher = (logits.float() + torch.randn(n, v, device="cuda", generator=gen)).to(torch.bfloat16)
        distill = headloss.LossSpec(distillation={"divergence": "reverse_kl", "temperature": 2.0}, token_accuracy=True)
        jsd = headloss.LossSpec(distillation={"divergence": "jsd", "beta": 0.3})
        for name, spec in (("full", FULL), ("exotic", EXOTIC), ("deferred", deferred), ("distill", distill),
                           ("jsd", jsd)):
            extra = {"teacher_logits": teacher} if spec.distillation is not None else {}
            mine_extra = {"teacher_logits": teacher[:, start: start + width]} if extra else {}
            x = logits.clone().requires_grad_()
            whole = headloss.head_loss(x, ids, spec, **extra)
            (whole.loss.sum() + (0.3 * whole.logprobs.sum() if spec.differentiable_outputs else 0)).backward()
            part = logits[:, start: start + width].contiguous().requires_grad_()
            before = COLLECTIVES["stats"]
            mine = headloss.head_loss(part, ids, spec, group=dist.group.WORLD, **mine_extra)
            (mine.loss.sum() + (0.3 * mine.logprobs.sum() if spec.differentiable_outputs else 0)).backward()
            errs[(name, "collectives")] = COLLECTIVES["stats"] - before
            errs[(name, "loss")] = float((mine.loss - whole.loss).abs().max() / whole.loss.abs().max())
            for k, value in whole.metrics.items():
                diff = (mine.metrics[k].double() - value.double()).abs()
                errs[(name, k)] = float(diff / value.double().abs().clamp_min(1e-6))
            errs[(name, "grad")] = float((part.grad.float() - x.grad[:, start: start + width].float()).abs().max()
                                         / x.grad.float().abs().max())
            if "predicted_tokens" in spec.outputs:
                errs[(name, "pred")] = float((mine.predicted_tokens != whole.predicted_tokens).sum())
        hidden = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(v, h, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        whole = headloss.linear_head_loss(h1, w1, ids, FULL)
        whole.loss.backward()
        h2, w2 = hidden.clone().requires_grad_(), weight[start: start + width].clone().requires_grad_()
        mine = headloss.linear_head_loss(h2, w2, ids, FULL, group=dist.group.WORLD)
        mine.loss.backward()
        errs[("linear", "loss")] = float((mine.loss - whole.loss).abs() / whole.loss.abs())
        errs[("linear", "dh")] = float((h2.grad.float() - h1.grad.float()).abs().max() / h1.grad.float().abs().max())
        errs[("linear", "dw")] = float((w2.grad.float() - w1.grad[start: start + width].float()).abs().max()
                                       / w1.grad.float().abs().max())
        # the deferred lm_head: statistics saved for the backward, dh all-reduced there (the log-probs
        # weighted apart from the loss: CE's loss is minus the log-prob, so their plain sum has no gradient)
        spec = headloss.LossSpec(z_loss={"weight": 1e-3}, reduction="none", outputs=("logprobs",),
                                 differentiable_outputs=True)
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        whole = headloss.linear_head_loss(h1, w1, ids, spec)
        (whole.loss.sum() + 0.3 * whole.logprobs.sum()).backward()
        h2, w2 = hidden.clone().requires_grad_(), weight[start: start + width].clone().requires_grad_()
        mine = headloss.linear_head_loss(h2, w2, ids, spec, group=dist.group.WORLD)
        (mine.loss.sum() + 0.3 * mine.logprobs.sum()).backward()
        errs[("linear-deferred", "loss")] = float((mine.loss - whole.loss).abs().max() / whole.loss.abs().max())
        errs[("linear-deferred", "dh")] = float((h2.grad.float() - h1.grad.float()).abs().max()
                                                / h1.grad.float().abs().max())
        errs[("linear-deferred", "dw")] = float((w2.grad.float() - w1.grad[start: start + width].float()).abs().max()
                                                / w1.grad.float().abs().max())
        results[rank] = errs
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_vocab_parallel_over_nccl_matches_one_gpu():
    from conftest import spawn_ranks

    results = spawn_ranks(_nccl_rank, 2)
    for rank, errs in results.items():
        for key, err in errs.items():
            if key[1] == "collectives":
                assert err == 1, (rank, key)
            elif key[1] == "pred":
                assert err == 0, (rank, key)
            elif key[1] in ("grad", "dh", "dw"):
                assert err <= 1e-2, (rank, key, err)  # bf16 storage of the gradient
            else:
                assert err <= 1e-5, (rank, key, err)


def _nccl_compiled_rank(rank: int, world: int, port: int, results) -> None:
    """Vocab-parallel head_loss and linear_head_loss compiled (fullgraph; default, and reduce-overhead
    for the fused kernel) against the same calls in eager mode, over NCCL: on the logits the
    statistics' all_gather (and the JSD's all-reduce) are functional collectives of the graph; on the
    lm_head each chunk's all_gather and the hidden gradient's all-reduce run inside its op."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        n, v, hidden = 512, 50257, 1024
        widths = [v // world + (1 if r < v % world else 0) for r in range(world)]
        start, width = sum(widths[:rank]), widths[rank]
        gen = torch.Generator(device="cuda").manual_seed(1)
        logits = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)[:, start: start + width]
        teacher = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)[:, start: start + width]
        h = (torch.randn(n, hidden, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        w = (torch.randn(v, hidden, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)[start: start + width]
        ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
        ids[::7] = -100
        deferred = headloss.LossSpec(entropy={"weight": 0.01}, reduction="none", outputs=("logprobs",),
                                     differentiable_outputs=True)
        jsd = headloss.LossSpec(distillation={"divergence": "jsd", "beta": 0.3})
        cases = (("full", FULL, ("default", "reduce-overhead")), ("deferred", deferred, ("default",)),
                 ("jsd", jsd, ("default",)), ("lm_head full", FULL, ("default", "reduce-overhead")),
                 ("lm_head deferred", deferred, ("default",)))
        errs = {}
        for name, spec, modes in cases:
            extra = {"teacher_logits": teacher.contiguous()} if spec.distillation is not None else {}
            lm_head = name.startswith("lm_head")

            def step(*xs, spec=spec, extra=extra, lm_head=lm_head):
                if lm_head:
                    out = headloss.linear_head_loss(*xs, ids, spec, group=dist.group.WORLD, chunk_bytes=16 << 20)
                else:
                    out = headloss.head_loss(*xs, ids, spec, group=dist.group.WORLD, **extra)
                return out.loss.sum(), out.metrics

            def leaves(lm_head=lm_head):
                sources = (h, w) if lm_head else (logits,)
                return [t.contiguous().requires_grad_() for t in sources]

            for mode in modes:
                torch._dynamo.reset()
                compiled = torch.compile(step, fullgraph=True, mode=mode)
                for _ in range(3):
                    a, b = leaves(), leaves()
                    want = step(*a)
                    want[0].backward()
                    if mode == "reduce-overhead":
                        torch.compiler.cudagraph_mark_step_begin()
                    got = compiled(*b)
                    got[0].backward()
                errs[(name, mode, "loss")] = float((got[0] - want[0]).abs().detach() / want[0].abs().clamp_min(1e-6))
                for k, value in want[1].items():
                    errs[(name, mode, k)] = float((got[1][k].double() - value.double()).abs()
                                                  / value.double().abs().clamp_min(1e-6))
                for i, (x, y) in enumerate(zip(a, b)):
                    errs[(name, mode, f"grad {i}")] = _rel(y.grad, x.grad)
        results[rank] = errs
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_compiled_vocab_parallel_over_nccl_equals_eager():
    from conftest import spawn_ranks

    for rank, errs in spawn_ranks(_nccl_compiled_rank, 2).items():
        for key, err in errs.items():
            assert err <= 1e-5, (rank, key, err)


@pytest.mark.parametrize("objective", [{"importance_sampling": "sequence"}, {"objective": "vespo"},
                                       {"objective": "gmpo", "loss_type": "grpo"}, {"objective": "kl_cov"},
                                       {"top_entropy_quantile": 0.2, "kl_beta": 0.04},
                                       {"top_entropy_quantile": 0.5, "entropy_coef": 0.01,
                                        "entropy_aggregation": "token-mean"}])
def test_lm_head_sequence_statistics_match_fp64_reference(objective):
    """Sequence statistics on the fused lm_head (chunks of whole sequences, gradient in forward) and
    batch statistics (kl_cov and the top-entropy mask: the base fused, the changed rows corrected;
    the top-entropy mask with TRL's bonus: deferred), through the compiled kernels, against fp64
    logits."""
    gen = torch.Generator(device="cuda").manual_seed(23)
    b, t, h, v = 4, 256, 256, 32000
    hidden = torch.randn(b, t, h, device="cuda", generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, device="cuda", generator=gen, dtype=torch.float64) / h**0.5 * 2
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    inputs = dict(advantages=torch.randn(b, device="cuda", generator=gen, dtype=torch.float64),
                  old_logprobs=logp + 0.2 * torch.randn(logp.shape, device="cuda", generator=gen, dtype=torch.float64),
                  loss_mask=(torch.rand(b, t, device="cuda", generator=gen) > 0.1).long())
    if objective.get("kl_beta"):
        inputs["ref_logprobs"] = logp + 0.1 * torch.randn(logp.shape, device="cuda", generator=gen,
                                                          dtype=torch.float64)
    spec = headloss.LossSpec(cross_entropy=None, policy={"loss_type": "dapo", "eps_high": 0.28, **objective})
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    out = headloss.linear_head_loss(x, w, ids, spec, chunk_bytes=300 * v * 4,
                                    **{k: (t_.float() if t_.is_floating_point() else t_) for k, t_ in inputs.items()})
    out.loss.backward()
    x64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = headloss.head_loss(x64 @ w64.T, ids, spec, backend="torch", **inputs)
    ref.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) <= 1e-4 * max(1.0, abs(ref.loss.item()))
    assert _rel(x.grad, x64.grad) < 1e-4 and _rel(w.grad, w64.grad) < 1e-4
    for name, value in ref.metrics.items():
        assert torch.allclose(out.metrics[name].double(), value.double(), rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize("name", ["sft", "grpo-dapo", "gspo", "gmpo"])
def test_packed_rows_equal_the_padded_call_on_the_compiled_kernels(name):
    """Packed sequences (cu_seqlens and position_ids) on CUDA: value, gradient and metrics of the
    logits path and the fused lm_head equal the padded [S, T] call's on the same tokens."""
    from test_packed import SPECS, assert_equal_calls, packed_case, run

    spec = SPECS[name]
    for packed_by in ("cu_seqlens", "position_ids"):
        lengths = [700, 1, 0, 257, 1500, 64, 3, 900]
        if packed_by == "position_ids":  # (a sequence without rows has no position 0)
            lengths = [length for length in lengths if length]
        packed, padded, where = packed_case(lengths, seed=3, vocab=4099, per_sequence_adv=packed_by == "cu_seqlens")
        packed, padded = ({k: v.cuda() for k, v in d.items()} for d in (packed, padded))
        where = tuple(t.cuda() for t in where)
        assert_equal_calls(run(packed, spec, "triton", packed_by), run(padded, spec, "triton"), where, rtol=1e-4)
        assert_equal_calls(run(packed, spec, "triton", packed_by, entry="hidden"),
                           run(padded, spec, "triton", entry="hidden"), where, rtol=1e-4)


def test_verl_fused_head_drop_in_equals_verls_triton_kernel_and_the_fused_policy_its_ppo_loss():
    """headloss.integrations.verl on CUDA against verl's own Triton linear_cross_entropy (packed rows,
    rolled labels, bf16): log-probs and entropy equal off the sequence ends, gradients equal for
    upstream gradients that leave the ends out; the fused policy_spec call equals verl's ppo_loss
    on its kernel's log-probs."""
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (pip install --no-deps verl, and the verl extra)")
    from benchmarks.bench_verl import actor_config, import_verl, make_batch, providers

    verl_head = import_verl("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    from headloss.integrations import verl as hv

    b = make_batch([300, 1, 77, 1024, 129], 256, 32003, seed=5)
    rolled = torch.roll(b["ids"], -1)
    last = torch.zeros_like(b["row_mask"])
    last[b["cu"][1:] - 1] = True
    gen = torch.Generator(device="cuda").manual_seed(6)
    g_lp, g_ent = (torch.randn(len(rolled), device="cuda", generator=gen).masked_fill(last, 0.0) for _ in range(2))
    grads = {}
    for name, head in (("verl", lambda: verl_head(b["hidden"], b["weight"], rolled, 0.9, "none")),
                       ("headloss", lambda: hv.linear_cross_entropy(b["hidden"], b["weight"], rolled, 0.9, "none",
                                                                    cu_seqlens=b["cu"]))):
        b["hidden"].grad = b["weight"].grad = None
        lp, ent = head()
        (lp * g_lp + ent * g_ent).sum().backward()
        grads[name] = (lp.detach(), ent.detach(), b["hidden"].grad.float(), b["weight"].grad.float())
    (v_lp, v_ent, v_dh, v_dw), (h_lp, h_ent, h_dh, h_dw) = grads["verl"], grads["headloss"]
    assert torch.all(h_lp[last] == 0) and torch.all(h_ent[last] == 0)
    for got, want, what in ((h_lp[~last], v_lp[~last], "logprobs"), (h_ent[~last], v_ent[~last], "entropy")):
        rel = float((got - want).norm() / want.norm())  # bf16 logits (headloss's GEMM) vs verl's fp32 tiles
        assert rel < 5e-3, f"{what}: relative difference {rel:.2e}"
    for got, want, what in ((h_dh, v_dh, "dh"), (h_dw, v_dw, "dw")):
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, f"{what}: relative difference {rel:.2e}"
    table = providers(b, actor_config())
    losses = {}
    for name in ("verl", "headloss fused", "headloss drop-in + headloss loss"):
        b["hidden"].grad = b["weight"].grad = None
        loss = table[name]()
        loss.backward()
        losses[name] = (loss.detach().float(), b["hidden"].grad.float(), b["weight"].grad.float())
    for name in ("headloss fused", "headloss drop-in + headloss loss"):
        for got, want, what in zip(losses[name], losses["verl"], ("loss", "dh", "dw")):
            rel = float((got - want).norm() / want.norm())
            assert rel < 2e-2, f"{name} {what}: relative difference {rel:.2e}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused, sequence_parallel, tied", [(True, True, False), (True, False, True),
                                                           (False, True, True), (True, True, True)])
def test_megatron_gpt_model_over_nccl_equals_megatrons_own(fused, sequence_parallel, tied, dtype):
    """The patched GPTModel's loss and gradients against Megatron's own, tensor parallel over NCCL on 2
    GPUs, with sequence parallelism (which needs CUDA: tests/integrations/test_megatron.py has the rest)."""
    pytest.importorskip("megatron.core")
    from conftest import spawn_ranks
    from megatron_cases import patched_equals_megatron

    results = spawn_ranks(patched_equals_megatron, 2, fused, sequence_parallel, tied, "nccl", dtype)
    loss_tol, grad_tol = (1e-4, 2e-5) if dtype == torch.float32 else (3e-2, 2e-2)
    for rank, r in results.items():
        assert r["names"], rank
        assert r["loss"] < loss_tol and r["restored"] == 0.0, (rank, r)
        for name, err in r["grads"].items():
            assert err < grad_tol, (rank, name, err)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype, overlap", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-overlapped-reduction"])
def test_megatron_ddp_gradient_accumulation_fusion_over_nccl(dtype, overlap):
    """megatron-core's own DistributedDataParallel, tensor parallel over NCCL on 2 GPUs, two micro-batches:
    with the output layer's gradient_accumulation_fusion the patched head adds dW into the weight's main_grad
    (fp32, DDP's buffer) and hands DDP's hook Megatron's dummy; every main_grad equals Megatron's own model's
    (fusion off) under the same DDP (tests/integrations/test_megatron.py: DDP's hook over gloo)."""
    pytest.importorskip("megatron.core")
    from conftest import spawn_ranks
    from megatron_cases import ddp_fusion_equals_megatron

    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for rank, r in spawn_ranks(ddp_fusion_equals_megatron, 2, "nccl", dtype, overlap).items():
        assert r["names"], rank
        assert r["flags"][False] == (False, True), (rank, r["flags"])  # Megatron's own: no fusion, grad dropped
        assert r["flags"][True] == (True, True), (rank, r["flags"])  # the fused head: added into main_grad
        for name, err in r["grads"].items():
            assert err < tol, (rank, name, err)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("fused, sequence_parallel, tied", [(True, True, False), (True, True, True),
                                                           (True, False, False), (False, True, True)])
def test_megatron_multi_token_prediction_over_nccl_equals_megatrons_own(fused, sequence_parallel, tied):
    """Two MTP depths, tensor parallel over NCCL on 2 GPUs (with sequence parallelism): the main loss, every
    gradient and the per-depth losses Megatron logs against its own."""
    pytest.importorskip("megatron.core")
    from conftest import spawn_ranks
    from megatron_cases import mtp_patched_equals_megatron

    results = spawn_ranks(mtp_patched_equals_megatron, 2, fused, sequence_parallel, tied, "nccl")
    for rank, r in results.items():
        assert r["names"], rank
        assert r["loss"] < 1e-4 and r["restored"] == 0.0, (rank, r)
        assert r["logged"] is not None and r["logged"] < 1e-4, (rank, r)
        for name, err in r["grads"].items():
            assert err < 2e-5, (rank, name, err)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_verl_megatron_fused_forward_over_nccl_with_sequence_parallelism(tied):
    """verl's Megatron fused forward after headloss's install() (or, where verl's Megatron modules do not
    import, its head's steps), sequence parallel over NCCL on 2 GPUs: log-probs, entropy and every
    gradient equal to Megatron's own logits'."""
    import importlib.util

    pytest.importorskip("megatron.core")
    from conftest import spawn_ranks
    from megatron_cases import verl_swap_equals_megatron

    try:
        via_verl = importlib.util.find_spec("verl.models.mcore.model_forward_fused") is not None
        if via_verl:
            importlib.import_module("verl.models.mcore.model_forward_fused")
    except ImportError:
        via_verl = False
    for rank, r in spawn_ranks(verl_swap_equals_megatron, 2, tied, "nccl", via_verl).items():
        assert r["names"], rank
        assert r["lp"] < 1e-4 and r["ent"] < 1e-4, (rank, r)
        for name, err in r["grads"].items():
            assert err < 2e-5, (rank, name, err)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_linear_head_loss_in_an_fsdp2_forward_over_nccl():
    """linear_head_loss in an FSDP2 model's forward on 2 GPUs: the loss and gradients of the unsharded model
    (gradients averaged over the ranks); FSDP2's shard of the weight outside the forward refused on both."""
    from conftest import spawn_ranks
    from fsdp2_cases import check_direct, direct_in_forward

    check_direct(spawn_ranks(direct_in_forward, 2, "nccl"), grad_tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 64])
def test_selected_logprobs_on_the_compiled_kernels_match_fp64(k, dtype):
    """The selected ids' log-probs (a repeated id, -1 entries, an ignored row) and the gradient of loss +
    sum(g * them) on the logits and on the fused lm_head, against fp64 torch on the logits the GEMM gives;
    in fused mode the loss and gradient are the call's without them; a bad id is found on the device."""
    b, t, v, h = 4, 200, 32000, 256
    gen = torch.Generator(device="cuda").manual_seed(79)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    ids[1, :30] = -100
    selected = torch.randint(-1, v, (b, t, k), device="cuda", generator=gen)
    selected[2, 5, -1] = selected[2, 5, 0] = 17
    g = torch.randn(b, t, k, device="cuda", generator=gen)
    hidden, weight, logits = _lm_head(gen, (b, t, v, h), dtype)
    spec = headloss.LossSpec(outputs=("selected_logprobs",), differentiable_outputs=True,
                             transform={"softcap": 30.0})
    z = logits.double().requires_grad_()
    oracle = headloss.head_loss(z, ids, spec, backend="torch", selected_ids=selected)
    (oracle.loss + (oracle.selected_logprobs * g.double()).sum()).backward()
    x = logits.clone().requires_grad_()
    out = headloss.head_loss(x, ids, spec, selected_ids=selected)
    (out.loss + (out.selected_logprobs * g).sum()).backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out.selected_logprobs, oracle.selected_logprobs) < tol
    assert _rel(x.grad.float(), z.grad) < tol
    hh = hidden.clone().requires_grad_()
    lin = headloss.linear_head_loss(hh, weight, ids, spec, selected_ids=selected, chunk_bytes=64 << 20)
    (lin.loss + (lin.selected_logprobs * g).sum()).backward()
    assert _rel(lin.selected_logprobs, oracle.selected_logprobs) < tol
    assert _rel(hh.grad.float(), z.grad @ weight.double()) < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    fused = spec.model_copy(update={"differentiable_outputs": False})
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with_ids = headloss.head_loss(x1, ids, fused, selected_ids=selected)
    with_ids.loss.backward()
    plain = headloss.head_loss(x2, ids, headloss.LossSpec(transform={"softcap": 30.0}))
    plain.loss.backward()
    # (the same loss and gradient up to rounding: another variant's instructions may contract differently)
    assert abs(with_ids.loss.item() - plain.loss.item()) <= 1e-6 * abs(plain.loss.item())
    assert _rel(x1.grad.float(), x2.grad.float()) < 1e-6
    assert _rel(with_ids.selected_logprobs, oracle.selected_logprobs) < tol
    bad = selected.clone()
    bad[3, 9, 0] = v
    headloss.head_loss(logits, ids, fused, selected_ids=bad)
    with pytest.raises(ValueError, match=r"selected_ids: the id at position \(3, 9\), entry 0 is outside"):
        headloss.check_pending(wait=True)


@pytest.mark.parametrize("teacher", ["none", "dense", "topk-rest"])
def test_the_selected_ids_gradient_beside_each_teacher_on_the_compiled_kernels(teacher):
    """The gradient with the selected ids' term minus the same call's without it is the fp64 gradient of
    sum g log p(ids) on the compiled kernels, fp32 logits, K 64: the gradient pass walking each row's sorted
    list down the row (no teacher, or a top-k teacher whose ids are rewritten after the pass) or up it (a dense
    teacher); ids on the target, on the teacher's ids, repeated, at the first and last columns, -1."""
    b, t, v, k = 2, 300, 50257, 64
    gen = torch.Generator(device="cuda").manual_seed(83)
    z = torch.randn(b, t, v, device="cuda", generator=gen) * 2
    y = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    y[0, :20] = -100
    ids = torch.randint(-1, v, (b, t, k), device="cuda", generator=gen)
    teacher_ids = torch.stack([torch.randperm(v, device="cuda", generator=gen)[:16] for _ in range(b * t)])
    teacher_ids = teacher_ids.reshape(b, t, 16)
    ids[..., :4] = teacher_ids[..., :4]
    ids[..., 4] = y.clamp(min=0)
    ids[..., 5] = ids[..., 6] = teacher_ids[..., 7]
    ids[..., 8], ids[..., 9], ids[..., 10] = 0, v - 1, -1
    g = torch.randn(b, t, k, device="cuda", generator=gen)
    extra, distill = {}, None
    if teacher == "dense":
        extra["teacher_logits"] = torch.randn(b, t, v, device="cuda", generator=gen) * 2
        distill = {"divergence": "forward_kl"}
    elif teacher == "topk-rest":
        lq = torch.log_softmax(torch.randn(b, t, 16, device="cuda", generator=gen), -1) - 0.3
        extra.update(teacher_ids=teacher_ids, teacher_logprobs=lq)
        distill = {"teacher": "topk", "topk": "rest"}
    spec = headloss.LossSpec(distillation=distill, outputs=("logprobs", "selected_logprobs"),
                             differentiable_outputs=True, transform={"temperature": 0.8})
    grads = []
    for with_ids in (True, False):
        x = z.clone().requires_grad_()
        out = headloss.head_loss(x, y, spec if with_ids else spec.model_copy(update={"outputs": ("logprobs",)}),
                                 **({"selected_ids": ids} if with_ids else {}), **extra)
        total = out.loss + out.logprobs.sum()
        if with_ids:
            total = total + (out.selected_logprobs * g).sum()
        total.backward()
        grads.append(x.grad.double())
    z64 = z.double().requires_grad_()
    logp = torch.log_softmax(z64 / 0.8, -1)
    picked = torch.where(ids >= 0, logp.gather(-1, ids.clamp(min=0)), 0.0) * (y != -100)[..., None]
    (picked * g.double()).sum().backward()
    assert _rel(grads[0] - grads[1], z64.grad) < 1e-4


def test_the_students_topk_keeps_to_the_registers_of_the_call_without_it():
    """From its second launch the top-7 head kernel runs compiled with maxnreg at the registers of the same
    launch without the top-k (kernels.head._sibling, kernels.launch._fitted), where that spills at most
    FIT_SPILLS: the same ids, log-probs, loss and gradient bit for bit as its first, uncapped launch. (k 7: a
    variant no other test compiles, so the builds this test finds are its own.)"""
    from headloss.kernels import head as kernels_head
    from headloss.kernels.launch import FIT_SPILLS

    def builds():
        return {id(k): k for caches in kernels_head.head_kernel.device_caches.values() for k in caches[0].values()}

    before = builds()
    v = 128256
    gen = torch.Generator(device="cuda").manual_seed(89)
    logits = (torch.randn(2048, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    y = torch.randint(0, v, (2048,), device="cuda", generator=gen)
    spec = headloss.LossSpec(student_topk=7, outputs=("topk_ids", "topk_logprobs"))
    results = []
    for _ in range(3):  # the first launch compiles and runs uncapped, the later ones the fitted variant
        x = logits.clone().requires_grad_()
        out = headloss.head_loss(x, y, spec)
        out.loss.backward()
        results.append((out.loss.detach(), out.topk_ids, out.topk_logprobs, x.grad))
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))
    new = [k for key, k in builds().items() if key not in before]
    capped = [k for k in new if k.metadata.maxnreg]
    own = [k for k in new if not k.metadata.maxnreg]  # the top-7 build and the one without it (its registers)
    assert len(capped) == 1 and capped[0].n_spills <= FIT_SPILLS
    assert capped[0].metadata.maxnreg in {k.n_regs for k in own}
    assert capped[0].metadata.maxnreg < max(k.n_regs for k in own)


@pytest.mark.parametrize("k", [8, 64])
@pytest.mark.parametrize("block_v", [None, 256])
def test_the_students_topk_takes_its_exact_fallbacks_on_the_compiled_kernels(k, block_v, monkeypatch):
    """The compiled selection's paths other than the common one, each row's top k planted so that no near-tie
    of random logits decides it: a row of equal logits and a group of lanes holding 120 distinct top logits
    (more keys at least the bound than the row's buffer holds: the running insertion), a row with +inf (the
    insertion over every block), 70 equal top logits down one block (a tie at the bound), and a row whose top
    k lie in the last blocks. With blocks of 256 (LAUNCH_OVERRIDES) a row has 501 blocks, more than the bound
    keeps (every row the insertion). The ids of a stable sort, on every row."""
    from headloss.kernels.launch import LAUNCH_OVERRIDES

    monkeypatch.setitem(LAUNCH_OVERRIDES, "block_v", block_v)
    v = 128256
    gen = torch.Generator(device="cuda").manual_seed(97)
    z = torch.randn(6, v, device="cuda", generator=gen)
    z[0] = 1.5
    step = block_v or 4096  # (6 rows: blocks of 4096)
    cols = (torch.arange(15, device="cuda")[:, None] * step + torch.arange(8, device="cuda")[None, :]).flatten()
    z[1, cols] = 100.0 - 0.5 * torch.arange(120.0, device="cuda")
    z[2, [5, 70000]] = float("inf")
    z[2, 2 * step + 3 + torch.arange(70, device="cuda")] = 50.0 + torch.arange(70.0, device="cuda")
    z[3, 1000 + torch.arange(70, device="cuda")] = 30.0
    z[4, v - 100 + torch.arange(70, device="cuda")] = 40.0 - 0.25 * torch.arange(70.0, device="cuda")
    z = z.to(torch.bfloat16)
    spec = headloss.LossSpec(student_topk=k, outputs=("topk_ids", "topk_logprobs"))
    out = headloss.head_loss(z, torch.randint(0, v, (6,), device="cuda", generator=gen), spec)
    want = torch.sort(z.double(), dim=-1, descending=True, stable=True).indices[:, :k]
    planted = [0, 1, 2, 3, 4]
    assert torch.equal(out.topk_ids[planted], want[planted])


@pytest.mark.parametrize("k", [8, 64])
def test_the_students_topk_on_the_compiled_kernels_matches_a_stable_sort(k):
    """The student's top-k on the compiled kernels at Llama 3's vocabulary: the ids of a stable
    descending sort of the transformed logits (planted ties across blocks to the lower id), their log-probs, the
    loss and gradient of the call without it; with a top-k teacher verl's overlap metrics as the plain-torch path
    gives them."""
    v = 128256
    gen = torch.Generator(device="cuda").manual_seed(83)
    logits = (torch.randn(300, v, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    top = logits.float().max() + 1
    logits[25, [120000, 17, 64000]] = top.to(torch.bfloat16)  # a tie in three blocks
    y = torch.randint(0, v, (300,), device="cuda", generator=gen)
    y[:20] = -100
    spec = headloss.LossSpec(student_topk=k, outputs=("topk_ids", "topk_logprobs"), transform={"softcap": 30.0})
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out = headloss.head_loss(x1, y, spec)
    out.loss.backward()
    plain = headloss.head_loss(x2, y, headloss.LossSpec(transform={"softcap": 30.0}))
    plain.loss.backward()
    assert abs(out.loss.item() - plain.loss.item()) <= 1e-6 * abs(plain.loss.item())
    assert _rel(x1.grad.float(), x2.grad.float()) < 1e-6
    ref = headloss.head_loss(logits.float(), y, spec, backend="torch")
    counted = y != -100
    assert (out.topk_ids[~counted] == -1).all()
    same = out.topk_ids[counted] == ref.topk_ids[counted]
    close = (out.topk_logprobs[counted] - ref.topk_logprobs[counted]).abs() < 1e-4
    assert (same | close).all() and same.float().mean() > 0.999  # (a near-tie may swap two ids)
    assert out.topk_ids[25, :3].tolist() == [17, 64000, 120000]
    assert _rel(out.topk_logprobs[counted], ref.topk_logprobs[counted]) < 1e-5
    teacher = torch.log_softmax(logits.float() + torch.randn(300, v, device="cuda", generator=gen), -1).topk(16)
    distill = headloss.LossSpec(student_topk=k, distillation={"teacher": "topk"})
    got = headloss.head_loss(logits, y, distill, teacher_ids=teacher.indices, teacher_logprobs=teacher.values)
    want = headloss.head_loss(logits.float(), y, distill, teacher_ids=teacher.indices,
                              teacher_logprobs=teacher.values, backend="torch")
    for name in ("distill/overlap_ratio", "distill/overlap_token_advantage"):
        expected = float(want.metrics[name])
        assert abs(float(got.metrics[name]) - expected) <= 1e-4 * max(1.0, abs(expected)), name


def test_fast_log1p_on_lg2_approx_stays_within_its_documented_error():
    # the mixture JSD's log(p / M) in both of its passes (kernels/primitives.fast_log1p: under 5e-6)
    assert fast_log1p_error("cuda") < 5e-6
