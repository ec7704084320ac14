"""headloss inside megatron-core: a GPTModel's loss patched (fused from the hidden states, or on the
vocab-parallel logits) against Megatron's own, over gloo on 2 and 3 ranks, with and without
sequence parallelism; the drop-in vocab_parallel_cross_entropy; bad shards refused on every rank."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import spawn_ranks  # noqa: E402

pytestmark = pytest.mark.slow

from megatron_cases import (  # noqa: E402
    HIDDEN,
    VOCAB,
    ddp_fusion_equals_megatron,
    gradient_accumulation_fusion_equals_megatron,
    init,
    model_of,
    mtp_patched_equals_megatron,
    patched_equals_megatron,
    step,
    verl_swap_equals_megatron,
)

# Megatron's sequence-parallel collectives allocate on CUDA (and gloo has no reduce_scatter): those
# cases need 2 GPUs over NCCL
SEQUENCE_PARALLEL = pytest.mark.skip(reason="sequence parallelism: Megatron's collectives allocate on CUDA")


@pytest.mark.parametrize("world, fused, sequence_parallel, tied", [
    (2, True, False, False), (2, True, False, True), (2, False, False, False), (3, True, False, True),
    (3, False, False, True), pytest.param(2, True, True, False, marks=SEQUENCE_PARALLEL),
    pytest.param(2, False, True, True, marks=SEQUENCE_PARALLEL)])
def test_patched_gpt_model_equals_megatrons_loss_and_gradients(world, fused, sequence_parallel, tied):
    results = spawn_ranks(patched_equals_megatron, world, fused, sequence_parallel, tied, "gloo", torch.float32)
    for rank, r in results.items():
        assert r["names"], rank
        assert r["loss"] < 1e-4 and r["restored"] == 0.0, (rank, r)
        for name, err in r["grads"].items():
            assert err < 2e-5, (rank, name, err)


@pytest.mark.parametrize("world, fused, tied", [(2, True, False), (2, True, True), (2, False, False),
                                                (3, True, True)])
def test_multi_token_prediction_equals_megatrons_losses_gradients_and_logged_depths(world, fused, tied):
    """Two MTP depths (mtp_loss_scaling_factor 0.3) in training mode: the main loss, every gradient (the MTP
    layers' through MTPLossAutoScaler included) and the per-depth losses Megatron logs equal its own."""
    results = spawn_ranks(mtp_patched_equals_megatron, world, fused, False, tied, "gloo")
    for rank, r in results.items():
        assert r["names"], rank
        assert r["loss"] < 1e-4 and r["restored"] == 0.0, (rank, r)
        assert r["logged"] is not None and r["logged"] < 1e-4, (rank, r)
        assert min(r["logged_values"]) > 1.0, (rank, r)  # (two depths' cross-entropies were logged)
        for name, err in r["grads"].items():
            assert err < 2e-5, (rank, name, err)
        assert any(name.startswith("mtp.") for name in r["grads"]), rank


def _metrics_and_drop_in(rank, world, port, results):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    from headloss import head_loss
    from headloss.integrations.megatron import patch_gpt_model, vocab_parallel_cross_entropy

    init(rank, world, port)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 3, VOCAB, generator=gen) * 3  # [s, b, V]
    target = torch.randint(0, VOCAB, (5, 3), generator=gen)
    width = VOCAB // world
    local = logits[..., rank * width:(rank + 1) * width]
    out = {}
    for smoothing in (0.0, 0.1):
        a = local.clone().requires_grad_(True)
        la = vocab_parallel_cross_entropy(a, target, label_smoothing=smoothing)
        w = torch.rand(la.shape, generator=torch.Generator().manual_seed(3))
        (la * w).sum().backward()
        if smoothing == 0.0:  # Megatron's own
            b = local.clone().requires_grad_(True)
            lb = megatron_ce(b, target)
        else:  # Megatron's formula over the whole vocabulary, fp64 (its own takes this rank's slice for the mean)
            whole = logits.double().requires_grad_(True)
            logp = whole.log_softmax(-1)
            s = smoothing * VOCAB / (VOCAB - 1)
            lb = (1 - s) * -logp.gather(-1, target[..., None])[..., 0] - s * logp.mean(-1)
            b = whole
        (lb * w).sum().backward()
        grad_b = b.grad if smoothing == 0.0 else b.grad[..., rank * width:(rank + 1) * width]
        out[smoothing] = (la.shape == lb.shape, float((la - lb).abs().max()), float((a.grad - grad_b).abs().max()))
    # Megatron's fused variant (cross_entropy_fusion_impl="native") gives the same loss and gradient
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    c = local.clone().requires_grad_(True)
    lc = fused_vocab_parallel_cross_entropy(c, target, parallel_state.get_tensor_model_parallel_group())
    d = local.clone().requires_grad_(True)
    ld = vocab_parallel_cross_entropy(d, target)
    w = torch.rand(ld.shape, generator=torch.Generator().manual_seed(5))
    (lc * w).sum().backward()
    (ld * w).sum().backward()
    e = local.clone().requires_grad_(True)
    (megatron_ce(e, target) * w).sum().backward()
    out["fused"] = (float((lc - ld).abs().max()), float((c.grad - d.grad).abs().max()),
                    float((c.grad - e.grad).abs().max()), float(c.grad.abs().max()))
    # a spec with metrics: the patched model's equal the single-process run on the gathered logits
    spec = {"cross_entropy": {}, "z_loss": {"weight": 1e-3}, "entropy": {"weight": 0.0}, "token_accuracy": True,
            "reduction": "none"}
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen)
    model = model_of(world, False, False)
    patch = patch_gpt_model(model, spec, fused=True)
    step(model, ids, labels)
    hidden = model.decoder(model.embedding(ids, torch.arange(6)[None].expand(2, 6)), attention_mask=None)
    import torch.distributed as dist

    parts = [torch.empty_like(model.output_layer.weight) for _ in range(world)]
    dist.all_gather(parts, model.output_layer.weight.detach().contiguous())
    whole = head_loss(hidden.detach().transpose(0, 1) @ torch.cat(parts).T, labels, spec)
    out["metrics"] = {k: (float(v), float(whole.metrics[k])) for k, v in patch.output.metrics.items()}
    out["order"] = list(patch.output.metrics) == list(whole.metrics)
    results[rank] = out


@pytest.mark.parametrize("world", [2, 3])
def test_drop_in_cross_entropy_and_metrics(world):
    for rank, r in spawn_ranks(_metrics_and_drop_in, world).items():
        for smoothing in (0.0, 0.1):
            same_shape, loss_err, grad_err = r[smoothing]
            assert same_shape and loss_err < 1e-4 and grad_err < 1e-5, (rank, smoothing, r[smoothing])
        # the fused variant's gradient is Megatron's unfused one to ~2e-3 (its own rounding): ours to as much
        loss_err, grad_err, fused_vs_unfused, scale = r["fused"]
        assert loss_err < 1e-4 and grad_err <= fused_vs_unfused + 1e-5 and grad_err < 5e-3 * scale, (rank, r["fused"])
        assert r["order"], rank
        for name, (got, want) in r["metrics"].items():
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (rank, name)


def _bad_shard(rank, world, port, results):
    from headloss.integrations.megatron import patch_gpt_model

    init(rank, world, port)
    model = model_of(world, False, False)
    if rank == 1:  # one rank's output layer holds the wrong rows
        model.output_layer.weight = torch.nn.Parameter(model.output_layer.weight.detach()[:-1].clone())
    try:
        patch_gpt_model(model)
        results[rank] = "no error"
    except ValueError as exc:
        results[rank] = str(exc)


def test_a_wrong_weight_shard_is_refused_on_every_rank():
    results = spawn_ranks(_bad_shard, 2)
    assert len(results) == 2
    for msg in results.values():
        assert msg.startswith("weight: the output layer's weight must be this rank's shard"), msg


def test_spec_errors_name_the_argument():
    from headloss.integrations.megatron import megatron_spec

    with pytest.raises(ValueError, match="^spec: Megatron's loss function masks"):
        megatron_spec({"cross_entropy": {}, "reduction": "mean"})
    with pytest.raises(ValueError, match="^spec: a GPTModel's loss gets the labels only"):
        megatron_spec({"cross_entropy": {}, "distillation": {}, "reduction": "none"})
    for extra in ({"token_weights": {}}, {"transform": {"per_row_temperature": True}}):
        with pytest.raises(ValueError, match="^spec: a GPTModel's loss gets the labels only"):
            megatron_spec({"cross_entropy": {}, "reduction": "none", **extra})
    with pytest.raises(TypeError, match="^model: expected a megatron.core GPTModel"):
        from headloss.integrations.megatron import patch_gpt_model

        patch_gpt_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("world, tied", [(2, False), (3, True)], ids=["2-untied", "3-tied"])
def test_verl_megatron_fused_forward_through_headloss(world, tied):
    """verl's Megatron fused forward (its _fused_GPTModel_forward, the output_processor's body) after
    install() computes its log-probs and entropy with headloss: equal to Megatron's own logits' and
    with the same gradients, tensor parallel over gloo (tests/test_gpu.py: with sequence parallelism
    over NCCL)."""
    pytest.importorskip("verl.models.mcore.model_forward_fused")
    for rank, r in spawn_ranks(verl_swap_equals_megatron, world, tied, "gloo", True).items():
        assert r["names"], rank
        assert r["lp"] < 1e-4 and r["ent"] < 1e-4, (rank, r)
        for name, err in r["grads"].items():
            assert err < 2e-5, (rank, name, err)


@pytest.mark.parametrize("world", [1, 2])
def test_gradient_accumulation_fusion_adds_dw_into_main_grad_as_megatrons_layer(world):
    """The output layer's gradient_accumulation_fusion with a main_grad (Megatron's DDP protocol, its hook):
    the fused loss adds dW into main_grad over two micro-batches, the flag set, param.grad dropped; main_grad
    equals Megatron's own weight gradient, the other gradients Megatron's."""
    results = spawn_ranks(gradient_accumulation_fusion_equals_megatron, world, "gloo")
    for rank, r in results.items():
        assert r["names"] and r["weight_grad"] and r["fired"] == [True, True], (rank, r)
        assert r["loss"] < 1e-4 and r["main_grad"] < 1e-4, (rank, r)
        for name, err in r["grads"].items():
            assert err < 1e-4, (rank, name, err)


@pytest.mark.parametrize("world, overlap", [(1, True), (2, False)])
def test_megatron_ddp_with_gradient_accumulation_fusion_equals_megatrons_own(world, overlap):
    """megatron-core's own DistributedDataParallel over gloo (its buffers on the CPU), two micro-batches: with
    the output layer's gradient_accumulation_fusion the patched head adds dW into the weight's fp32 main_grad
    and DDP's hook adds nothing more; every main_grad equals Megatron's own model's under the same DDP
    (tests/test_gpu.py: the same over NCCL)."""
    for rank, r in spawn_ranks(ddp_fusion_equals_megatron, world, "gloo", torch.float32, overlap).items():
        assert r["names"], rank
        assert r["flags"][False] == (False, True) and r["flags"][True] == (True, True), (rank, r["flags"])
        for name, err in r["grads"].items():
            assert err < 1e-5, (rank, name, err)


@pytest.mark.parametrize("fusion", [False, True])
def test_gradient_accumulation_fusion_gives_the_unallocated_dw_to_the_chunks(monkeypatch, fusion):
    """With gradient accumulation fusion the fused loss's chunk budget is the default plus the weight
    shard's bytes (the dW buffer its deferred backward does not allocate); without it, the default."""
    from headloss.chunks import DEFAULT_CHUNK_BYTES
    from headloss.integrations import megatron

    seen = {}
    real = megatron.linear_head_loss

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(megatron, "linear_head_loss", spy)
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).requires_grad_()
    weight.main_grad = torch.zeros_like(weight)
    hidden = torch.randn(5, 2, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (2, 5), generator=gen)
    out = megatron.fused_loss(hidden, weight, labels, gradient_accumulation_fusion=fusion)
    out.loss.sum().backward()
    extra = weight.numel() * weight.element_size() if fusion else 0
    assert seen["chunk_bytes"] == DEFAULT_CHUNK_BYTES + extra
    assert seen["weight_grad"] == ("main_grad" if fusion else "return")
    assert bool(weight.main_grad.abs().sum() > 0) == fusion
