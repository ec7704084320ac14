"""headloss.integrations.verl against verl's own code (verl 0.9.1 from the registry, installed with
``pip install --no-deps verl`` plus the ``verl`` extra): the registered losses against
``compute_policy_loss_*`` through verl's registry, the fused head against ``FusedLinearForPPO``
on packed rows with rolled labels, verl's ``ppo_loss`` against the fused policy spec, the
vocab-parallel contract against verl's own test's (dh summed by the caller), and install()."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import assert_close_norm, generator, needs_kernel, spawn_ranks, tiered

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402
from verl.workers.config.actor import ActorConfig, PolicyLossConfig  # noqa: E402

import headloss  # noqa: E402
from headloss.integrations import verl as hv  # noqa: E402

B, T = 6, 9
MODES = list(hv.LOSS_MODES)
AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def actor_config(mode="vanilla", agg="token-mean", dp=None, **changes):
    low, high = {"dppo_tv": (5e-4, 1e-3), "dppo_kl": (5e-5, 1e-4)}.get(mode, (0.2, 0.28))
    policy_loss = PolicyLossConfig(loss_mode=mode, clip_cov_ratio=0.2, clip_cov_lb=-5.0, clip_cov_ub=5.0,
                                   kl_cov_ratio=0.2, ppo_kl_coef=0.5, dro_beta=0.3)
    fields = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=low,
                  clip_ratio_high=high, clip_ratio_c=1.5, loss_agg_mode=agg, tau_pos=1.0, tau_neg=1.05,
                  policy_loss=policy_loss)
    fields.update(changes)
    config = ActorConfig(**fields)
    config.global_batch_info.update(dp or {})
    return config


def batch(seed, empty_row=True):
    """verl's padded response tensors, fp64: a fully masked sequence (seq-mean drops it), ragged masks."""
    gen = generator(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    log_prob = old + 0.6 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    log_prob = torch.where(log_prob < 0, log_prob, -log_prob - 1e-2)  # no ties (the covariance modes rank them)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)[:, None].expand(B, T).clone()
    lengths = torch.randint(2, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None] < lengths[:, None]
    if empty_row:
        mask[1] = False
    weights = torch.rand(B, T, generator=gen, dtype=torch.float64) + 0.5
    return old, log_prob, adv, mask, weights


def verl_loss(mode, agg, config, old, log_prob, adv, mask, weights):
    leaf = log_prob.clone().requires_grad_()
    torch.manual_seed(7)  # clip_cov's draw: torch.randperm on the default generator, seeded alike
    loss, metrics = core_algos.get_policy_loss_fn(mode)(old, leaf, adv, mask, agg, config, weights)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def headloss_loss(mode, agg, config, old, log_prob, adv, mask, weights):
    leaf = log_prob.clone().float().requires_grad_()
    torch.manual_seed(7)
    loss, metrics = core_algos.get_policy_loss_fn(f"headloss_{mode}")(old.float(), leaf, adv.float(), mask, agg,
                                                                       config,
                                                                       None if weights is None else weights.float())
    loss.backward()
    return loss.detach(), leaf.grad, metrics


CASES = [(mode, agg) for mode in MODES for agg in AGGS if mode != "geo_mean" or agg == "token-mean"]  # geo_mean: no agg


@pytest.mark.parametrize("mode, agg", CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_registered_losses_equal_verls_own_compute_policy_loss(mode, agg):
    """Each loss mode through verl's registry (the entry point registered headloss_<mode>): loss,
    d loss / d log_prob and every metric verl's returns, on a batch with a fully masked sequence."""
    assert f"headloss_{mode}" in core_algos.POLICY_LOSS_REGISTRY
    for weighted in (False, True):
        config = actor_config(mode, agg)
        old, log_prob, adv, mask, weights = batch(sum(map(ord, mode + agg)), empty_row=mode != "geo_mean")
        weights = weights if weighted else None
        if mode in ("clip_cov", "kl_cov"):  # verl's covariance picks on the CPU generator: one pick per batch
            weights = None  # and a ranking of covariances: both sides rank the same fp32 values
            old, log_prob, adv = old.float().double(), log_prob.float().double(), adv.float().double()
        want_loss, want_grad, want = verl_loss(mode, agg, config, old, log_prob, adv, mask, weights)
        if mode in ("vanilla", "cispo", "dppo_tv", "clip_cov"):  # the batch clips some tokens, not all
            assert 0.0 < want["actor/pg_clipfrac"] < 1.0
        if mode == "vanilla":  # and verl's dual clip acts
            assert want["actor/pg_clipfrac_lower"] > 0.0
        got_loss, got_grad, got = headloss_loss(mode, agg, config, old, log_prob, adv, mask,
                                                weights)
        assert_close_norm(got_loss.double(), want_loss, rtol=1e-5, atol=1e-7, name=f"{mode} loss")
        assert_close_norm(got_grad.double(), want_grad, rtol=1e-5, atol=1e-9, name=f"{mode} grad")
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name, value in want.items():
            assert isinstance(got[name], torch.Tensor)  # a device scalar: no host read by headloss
            assert_close_norm(got[name].double(), torch.tensor(value, dtype=torch.float64), rtol=1e-5, atol=1e-6,
                              name=f"{mode} {name}")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum",
                                 "seq-mean-token-sum-norm"])
def test_registered_losses_take_verls_global_batch_info(agg):
    """dp_size, batch_num_tokens, global_batch_size and loss_scale_factor as verl's agg_loss reads them."""
    info = dict(dp_size=4, batch_num_tokens=57, global_batch_size=13, loss_scale_factor=11)
    for mode in ("vanilla", "sapo", "gspo"):
        config = actor_config(mode, agg, info)
        old, log_prob, adv, mask, _ = batch(3)
        want_loss, want_grad, _ = verl_loss(mode, agg, config, old, log_prob, adv, mask, None)
        got_loss, got_grad, _ = headloss_loss(mode, agg, config, old, log_prob, adv, mask, None)
        assert_close_norm(got_loss.double(), want_loss, rtol=1e-5, atol=1e-7, name=f"{mode} {agg} loss")
        assert_close_norm(got_grad.double(), want_grad, rtol=1e-5, atol=1e-9, name=f"{mode} {agg} grad")


def test_config_errors_name_the_key():
    old, log_prob, adv, mask, _ = batch(5)
    fn = hv.policy_loss_fn("vanilla")
    with pytest.raises(ValueError, match="global_batch_info.batch_num_tokens"):
        fn(old, log_prob, adv, mask, "token-mean", actor_config(dp={"dp_size": 2}))
    with pytest.raises(ValueError, match="global_batch_info.global_batch_size"):
        fn(old, log_prob, adv, mask, "seq-mean-token-mean", actor_config(dp={"dp_size": 2}))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, log_prob, adv, mask, "token-median", actor_config())
    with pytest.raises(ValueError, match="policy_loss.dro_beta"):
        hv.policy_for(actor_config(policy_loss=PolicyLossConfig(loss_mode="dro")))
    with pytest.raises(ValueError, match="policy_loss.loss_mode"):
        hv.policy_for(actor_config(), "bypass_mode")
    with pytest.raises(ValueError, match="config"):
        fn(old, log_prob, adv, mask, "token-mean", None)
    with pytest.raises(ValueError, match="loss_mask"):
        fn(old, log_prob, adv, mask.double() * 0.5, "token-mean", actor_config())
    with pytest.raises(ValueError, match="kl_loss_type"):
        hv.policy_spec(actor_config(use_kl_loss=True, kl_loss_type="full"))


# --- the fused head ---------------------------------------------------------------------------

H, V = 16, 37


def packed_rows(seed, lengths=(5, 1, 8, 3)):
    gen = generator(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    hidden = torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.5
    ids = torch.randint(0, V, (n,), generator=gen)
    positions = torch.cat([torch.arange(k) for k in lengths])
    return hidden, weight, ids, cu, positions


@needs_kernel
@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids", "none"])
def test_fused_head_equals_verls_fused_linear_for_ppo_on_packed_rows(boundaries):
    """verl's torch fused head on rolled labels over the packed stream vs the drop-in: equal values
    and gradients; given the boundaries, each sequence's last row (scored across the boundary by
    the roll) is 0 and carries no gradient."""
    hidden, weight, ids, cu, positions = packed_rows(11)
    rolled = torch.roll(ids, -1)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = FusedLinearForPPO(chunk_size=4)(h64, w64, rolled, 0.8)
    last = torch.zeros(len(ids), dtype=torch.bool)
    if boundaries != "none":
        last[cu[1:] - 1] = True
        if boundaries == "position_ids":
            last[-1] = False  # the stream's end: no reset after it to read
    gen = generator(12)
    g_lp, g_ent = torch.randn(len(ids), generator=gen), torch.randn(len(ids), generator=gen)
    g_lp, g_ent = g_lp.masked_fill(last, 0.0), g_ent.masked_fill(last, 0.0)
    (want_lp * g_lp.double() + want_ent * g_ent.double()).sum().backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    extra = {"cu_seqlens": dict(cu_seqlens=cu), "position_ids": dict(position_ids=positions[None]),
             "none": {}}[boundaries]
    lp, ent = hv.linear_cross_entropy(h[None], w, rolled[None], 0.8, "none", **extra)
    assert lp.shape == ent.shape == (1, len(ids)) and lp.dtype == ent.dtype == torch.float32
    lp, ent = lp[0], ent[0]
    assert torch.all(lp[last] == 0) and torch.all(ent[last] == 0)
    assert_close_norm(lp[~last].double(), want_lp[~last].detach(), rtol=1e-5, atol=1e-6, name="logprobs")
    assert_close_norm(ent[~last].double(), want_ent[~last].detach(), rtol=1e-5, atol=1e-6, name="entropy")
    (lp * g_lp + ent * g_ent).sum().backward()
    assert_close_norm(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-7, name="dh")
    assert_close_norm(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-7, name="dw")
    total, _ = hv.linear_cross_entropy(hidden, weight, rolled, 0.8, "sum", **extra)
    assert_close_norm(total.double(), want_lp[~last].sum().detach(), rtol=1e-5, atol=1e-5, name="sum")


def test_fused_head_errors_name_the_argument():
    hidden, weight, ids, cu, _ = packed_rows(13)
    with pytest.raises(ValueError, match="reduction"):
        hv.linear_cross_entropy(hidden, weight, ids, 1.0, "max")
    with pytest.raises(ValueError, match="temperature"):
        hv.linear_cross_entropy(hidden, weight, ids, 0.0)
    with pytest.raises(ValueError, match="labels"):
        hv.linear_cross_entropy(hidden, weight, ids[:-1])
    with pytest.raises(ValueError, match="labels"):
        hv.linear_cross_entropy(hidden, weight, ids.float())
    with pytest.raises(ValueError, match="cu_seqlens"):
        hv.linear_cross_entropy(hidden, weight, ids, cu_seqlens=cu.float())
    with pytest.raises(ValueError, match="cu_seqlens"):  # not ending at the row count (found by the device check)
        hv.linear_cross_entropy(hidden, weight, ids, cu_seqlens=torch.cat([cu[:-1], cu[-1:] + 2]))
    with pytest.raises(ValueError, match="position_ids"):
        hv.linear_cross_entropy(hidden, weight, ids, position_ids=torch.zeros(len(ids) + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_grad"):
        headloss.linear_head_loss(hidden, weight, ids, hidden_grad="summed")


def ppo_batch(seed, lengths=(6, 9, 4, 7), prompts=(2, 3, 1, 4)):
    """Packed prompt + response sequences and verl's padded [S, R] response tensors, with the
    per-row inputs of the same tokens for the head pass (row t scores token t + 1)."""
    gen = generator(seed)
    hidden, weight, ids, cu, _ = packed_rows(seed, lengths)
    responses = [n - p for n, p in zip(lengths, prompts)]
    r_max = max(responses)
    s = len(lengths)
    old = -torch.rand(s, r_max, generator=gen, dtype=torch.float64) * 2 - 0.5
    ref = old + 0.3 * torch.randn(s, r_max, generator=gen, dtype=torch.float64)
    adv = torch.randn(s, generator=gen, dtype=torch.float64)[:, None].expand(s, r_max).clone()
    mask = torch.arange(r_max)[None] < torch.tensor(responses)[:, None]
    rows = torch.full((s, r_max), -1)  # the packed row that scores each response token
    for i, (start, p, r) in enumerate(zip(cu[:-1].tolist(), prompts, responses)):
        rows[i, :r] = start + p - 1 + torch.arange(r)
    n = len(ids)
    per_row = {name: torch.zeros(n, dtype=torch.float64) for name in ("old", "ref", "adv")}
    row_mask = torch.zeros(n, dtype=torch.bool)
    for name, t in (("old", old), ("ref", ref), ("adv", adv)):
        per_row[name][rows[mask]] = t[mask]
    row_mask[rows[mask]] = True
    return hidden, weight, ids, cu, old, ref, adv, mask, rows, per_row, row_mask


@needs_kernel
@pytest.mark.parametrize("mode, agg, kl", tiered(["vanilla", "gspo", "sapo", "cispo"],
                                                 ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
                                                 ["low_var_kl", "k1+"], pairs=False))
def test_policy_spec_on_packed_rows_equals_verls_ppo_loss(mode, agg, kl):
    """verl's ppo_loss (policy loss + entropy bonus + KL loss, each by agg_loss) on log-probs from its
    FusedLinearForPPO, vs one linear_head_loss over the packed hidden states with policy_spec."""
    hidden, weight, ids, cu, old, ref, adv, mask, rows, per_row, row_mask = ppo_batch(21)
    config = actor_config(mode, agg, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type=kl)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = FusedLinearForPPO(chunk_size=8)(h64, w64, torch.roll(ids, -1), 0.9)
    log_prob, entropy = lp[rows.clamp(min=0)], ent[rows.clamp(min=0)]
    pg, _ = core_algos.get_policy_loss_fn(mode)(old, log_prob, adv, mask, agg, config, None)
    entropy_loss = core_algos.agg_loss(entropy, mask, agg, **config.global_batch_info)
    kld = core_algos.kl_penalty(log_prob, ref, kl)
    kl_loss = core_algos.agg_loss(kld, mask, agg, **config.global_batch_info)
    want = pg - 0.01 * entropy_loss + 0.05 * kl_loss
    want.backward()
    spec = hv.policy_spec(config, temperature=0.9)
    for backend in ("triton", "torch"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = headloss.linear_head_loss(h, w, ids, spec, shift=True, cu_seqlens=cu, backend=backend,
                                        advantages=per_row["adv"].float(), old_logprobs=per_row["old"].float(),
                                        ref_logprobs=per_row["ref"].float(), loss_mask=row_mask,
                                        **hv.policy_counts(config, spec.policy))
        out.loss.backward()
        assert_close_norm(out.loss.double(), want.detach(), rtol=1e-5, atol=1e-6, name=f"{backend} loss")
        assert_close_norm(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-8, name=f"{backend} dh")
        assert_close_norm(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-8, name=f"{backend} dw")


# --- install() into verl ---------------------------------------------------------------------


@pytest.fixture
def installed():
    """install() for one test, verl's functions and registry restored after."""
    import importlib

    from verl.trainer.distillation import losses as distill
    from verl.trainer.distillation.fsdp import losses as fsdp_distill

    kernel = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    dense = importlib.import_module("verl.models.transformers.dense_common")
    saved = (kernel.linear_cross_entropy, dense.forward_with_triton_backend, dict(core_algos.POLICY_LOSS_REGISTRY),
             fsdp_distill.compute_forward_kl_topk, dict(distill.DISTILLATION_LOSS_REGISTRY),
             dict(distill.DISTILLATION_SETTINGS_REGISTRY))
    try:
        hv.install()
        yield kernel, dense
    finally:
        kernel.linear_cross_entropy, dense.forward_with_triton_backend = saved[:2]
        core_algos.POLICY_LOSS_REGISTRY.clear()
        core_algos.POLICY_LOSS_REGISTRY.update(saved[2])
        fsdp_distill.compute_forward_kl_topk = saved[3]
        for registry, was in ((distill.DISTILLATION_LOSS_REGISTRY, saved[4]),
                              (distill.DISTILLATION_SETTINGS_REGISTRY, saved[5])):
            registry.clear()
            registry.update(was)


@needs_kernel
def test_install_routes_verls_fused_forward_and_loss_modes_through_headloss(installed):
    """After install(), a model patched by verl's own patch_forward_with_backends (use_fused_kernels,
    impl_backend triton) returns headloss's log-probs and entropy for its packed rows, with each
    sequence's last row masked from the forward's position ids; loss_mode 'vanilla' is headloss's."""
    transformers = pytest.importorskip("transformers")
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    kernel, _ = installed
    assert kernel.linear_cross_entropy is hv.linear_cross_entropy
    assert core_algos.get_policy_loss_fn("vanilla").__name__ == "headloss_vanilla"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    cls = type(model)
    original = cls.forward
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="triton")
        _, _, ids, cu, positions = packed_rows(31)
        out = model(input_ids=ids[None], position_ids=positions[None], shift_labels=torch.roll(ids, -1)[None],
                    temperature=1.0, return_dict=True, use_cache=False)
        hidden = model.model(input_ids=ids[None], position_ids=positions[None], use_cache=False).last_hidden_state
    finally:
        cls.forward = original
    want_lp, want_ent = hv.linear_cross_entropy(hidden, model.lm_head.weight, torch.roll(ids, -1)[None],
                                                cu_seqlens=cu)
    last = torch.zeros(len(ids), dtype=torch.bool)
    last[cu[1:-1] - 1] = True  # position ids tell every end but the stream's
    assert torch.all(out.log_probs[0][last] == 0)
    assert_close_norm(out.log_probs[0][:-1], want_lp[0][:-1].detach(), rtol=1e-5, atol=1e-6, name="log_probs")
    assert_close_norm(out.entropy[0][:-1], want_ent[0][:-1].detach(), rtol=1e-5, atol=1e-6, name="entropy")


# --- vocab-parallel (gloo) --------------------------------------------------------------------


def _rank_tp(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from headloss.parallel import COLLECTIVES

    try:
        widths = [20, 17]
        start = sum(widths[:rank])
        hidden, weight, ids, cu, _ = packed_rows(41)
        rolled = torch.roll(ids, -1)
        gen = generator(42)
        g_lp, g_ent = torch.randn(len(ids), generator=gen), torch.randn(len(ids), generator=gen)
        out = {}
        # verl's contract: outputs of the whole vocabulary, dW this rank's rows, dh this rank's share
        h, w = hidden.clone().requires_grad_(), weight[start:start + widths[rank]].clone().requires_grad_()
        before = dict(COLLECTIVES)
        lp, ent = hv.linear_cross_entropy(h, w, rolled, 0.7, "none", dist.group.WORLD, cu_seqlens=cu)
        (lp * g_lp + ent * g_ent).sum().backward()
        out["drop_in"] = (lp.detach(), ent.detach(), h.grad, w.grad,
                          {k: COLLECTIVES[k] - before[k] for k in COLLECTIVES})
        # a packed policy call over the vocab-parallel lm_head equals the single-device packed call
        spec = headloss.LossSpec(cross_entropy=None, entropy=headloss.Entropy(weight=0.0),
                                 policy=headloss.Policy(loss_type="grpo", importance_sampling="sequence",
                                                        kl_beta=0.04))
        inputs = dict(advantages=torch.randn(4, generator=gen), old_logprobs=-torch.rand(len(ids), generator=gen),
                      ref_logprobs=-torch.rand(len(ids), generator=gen))
        for backend in ("triton", "torch"):
            h, w = hidden.clone().requires_grad_(), weight[start:start + widths[rank]].clone().requires_grad_()
            o = headloss.linear_head_loss(h, w, ids, spec, shift=True, cu_seqlens=cu, group=dist.group.WORLD,
                                          backend=backend, **inputs)
            o.loss.backward()
            out[f"packed_{backend}"] = (o.loss.detach(), {k: v.detach() for k, v in o.metrics.items()}, h.grad,
                                        w.grad)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@needs_kernel
@pytest.mark.slow
def test_vocab_parallel_fused_head_and_packed_policy_equal_one_device():
    results = spawn_ranks(_rank_tp, 2)
    hidden, weight, ids, cu, _ = packed_rows(41)
    rolled = torch.roll(ids, -1)
    gen = generator(42)
    g_lp, g_ent = torch.randn(len(ids), generator=gen), torch.randn(len(ids), generator=gen)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = hv.linear_cross_entropy(h, w, rolled, 0.7, "none", cu_seqlens=cu)
    (lp * g_lp + ent * g_ent).sum().backward()
    shares = [results[r]["drop_in"] for r in (0, 1)]
    for rank, (r_lp, r_ent, _, r_dw, collectives) in enumerate(shares):
        assert_close_norm(r_lp, lp.detach(), rtol=1e-5, atol=1e-6, name=f"rank {rank} logprobs")
        assert_close_norm(r_ent, ent.detach(), rtol=1e-5, atol=1e-6, name=f"rank {rank} entropy")
        start = [0, 20][rank]
        assert_close_norm(r_dw, w.grad[start:start + r_dw.shape[0]], rtol=1e-4, atol=1e-6, name=f"rank {rank} dw")
        assert collectives["dh"] == 0 and collectives["stats"] >= 1  # one gather per chunk, no reduction of dh
    # each rank's dh is its own columns' share: their sum (the caller's reduction) is the whole dh
    assert_close_norm(shares[0][2] + shares[1][2], h.grad, rtol=1e-4, atol=1e-6, name="dh summed over ranks")
    assert not torch.allclose(shares[0][2], h.grad, atol=1e-3)
    gen = generator(42)
    torch.randn(len(ids), generator=gen), torch.randn(len(ids), generator=gen)
    spec = headloss.LossSpec(cross_entropy=None, entropy=headloss.Entropy(weight=0.0),
                             policy=headloss.Policy(loss_type="grpo", importance_sampling="sequence", kl_beta=0.04))
    inputs = dict(advantages=torch.randn(4, generator=gen), old_logprobs=-torch.rand(len(ids), generator=gen),
                  ref_logprobs=-torch.rand(len(ids), generator=gen))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    one = headloss.linear_head_loss(h, w, ids, spec, shift=True, cu_seqlens=cu, **inputs)
    one.loss.backward()
    for backend in ("triton", "torch"):
        for rank in (0, 1):
            loss, metrics, dh, dw = results[rank][f"packed_{backend}"]
            name = f"{backend} rank {rank}"
            assert_close_norm(loss, one.loss.detach(), rtol=1e-5, atol=1e-6, name=f"{name} loss")
            for key in ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_max"):
                assert_close_norm(metrics[key], one.metrics[key], rtol=1e-5, atol=1e-6, name=f"{name} {key}")
            assert_close_norm(dh, h.grad, rtol=1e-4, atol=1e-6, name=f"{name} dh")
            start = [0, 20][rank]
            assert_close_norm(dw, w.grad[start:start + dw.shape[0]], rtol=1e-4, atol=1e-6, name=f"{name} dw")


# --- distillation ---------------------------------------------------------------------------------


def topk_batch(seed, k=6, vocab=V, rows=(2, 11), dtype=torch.float32):
    """verl's top-k inputs: student logits [1, total_nnz, V] and the teacher's nested [bsz, seqlen, K] top-k
    (ids and log-probs of a teacher near the student), flattened by verl to [1, total_nnz, K]."""
    gen = generator(seed)
    lengths = list(rows)
    total = sum(lengths)
    logits = (torch.randn(1, total, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype)
    teacher = torch.log_softmax(logits.double() + torch.randn(1, total, vocab, generator=gen, dtype=torch.float64),
                                -1)
    top = teacher.topk(k, dim=-1)
    split = lambda t: torch.nested.as_nested_tensor(list(t[0].split(lengths)), layout=torch.jagged)  # noqa: E731
    return logits, split(top.values.float()), split(top.indices)


def distill_config(clamp=None, loss_mode="forward_kl_topk"):
    from types import SimpleNamespace

    return SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp, use_chunked_topk=False,
                                                             loss_mode=loss_mode, topk=6))


@needs_kernel
@pytest.mark.parametrize(("clamp", "dtype"), [
    (None, torch.float32), (-3.0, torch.bfloat16),  # (each clamp and dtype once in the fast tier)
    pytest.param(-3.0, torch.float32, marks=pytest.mark.slow),
    pytest.param(None, torch.bfloat16, marks=pytest.mark.slow)])
def test_forward_kl_topk_equals_verls_own_top_k_step(clamp, dtype):
    """forward_kl_topk against verl's compute_forward_kl_topk (its default path, which materialises the
    log-softmax): the per-token loss as verl's loss clamps it at 0, the student and teacher mass, verl's
    overlap diagnostics (the student's top-k from the pass) and the gradient of a weighted sum of the
    clamped losses."""
    from verl.trainer.distillation.fsdp import losses as fsdp_distill

    logits, lp, ids = topk_batch(3, dtype=dtype)
    config = distill_config(clamp)
    weights = torch.rand(logits.shape[:2], generator=generator(4)) + 0.5
    x_verl, x_ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    want = fsdp_distill.compute_forward_kl_topk(x_verl, lp, ids, config, "thd")
    got = hv.forward_kl_topk(x_ours, lp, ids, config, "thd")
    assert set(got) == set(want)  # (with overlap_count, overlap_token_advantage)
    (want["distillation_losses"].float().clamp_min(0.0) * weights).sum().backward()
    (got["distillation_losses"] * weights).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert_close_norm(got["distillation_losses"].detach(), want["distillation_losses"].float().clamp_min(0.0),
                      name="distillation_losses", **tol)
    for name in ("student_mass", "teacher_mass"):
        assert_close_norm(got[name], want[name].float(), name=name, **tol)
    assert_close_norm(x_ours.grad.float(), x_verl.grad.float(), name="grad", **tol)
    assert got["overlap_count"].dtype == want["overlap_count"].dtype
    assert torch.equal(got["overlap_count"], want["overlap_count"])
    assert 0 < int(got["overlap_count"].sum()) < got["overlap_count"].numel() * lp.shape[-1]  # (some, not all)
    assert_close_norm(got["overlap_token_advantage"], want["overlap_token_advantage"].float(),
                      name="overlap_token_advantage", **tol)


@needs_kernel
@pytest.mark.parametrize("case", ["65 teacher ids", "OVERLAP_TOPK = 0"])
def test_forward_kl_topk_leaves_the_overlap_out_above_64_teacher_ids_or_when_switched_off(case, monkeypatch):
    """A teacher of more than 64 ids (beyond student_topk's range), or the diagnostics switched off: the loss
    and masses as before, no overlap diagnostics (verl's consumer logs none then)."""
    from verl.trainer.distillation.fsdp import losses as fsdp_distill

    if case == "OVERLAP_TOPK = 0":
        from headloss.integrations import verl_distill

        monkeypatch.setattr(verl_distill, "OVERLAP_TOPK", 0)
    logits, lp, ids = topk_batch(6, k=65 if case == "65 teacher ids" else 6, vocab=100)
    got = hv.forward_kl_topk(logits, lp, ids, distill_config(), "thd")
    want = fsdp_distill.compute_forward_kl_topk(logits, lp, ids, distill_config(), "thd")
    assert set(got) == {"distillation_losses", "student_mass", "teacher_mass"}
    assert_close_norm(got["distillation_losses"], want["distillation_losses"].float().clamp_min(0.0),
                      name="distillation_losses", rtol=1e-4, atol=1e-5)


@needs_kernel
def test_install_puts_forward_kl_topk_in_verls_top_k_step(installed):
    """After install(), verl's own compute_topk_loss (its logits processor's call, strategy fsdp) runs
    headloss's forward_kl_topk; the estimator losses are in verl's registry as headloss_<name>."""
    from types import SimpleNamespace

    from verl.trainer.distillation import losses as distill

    logits, lp, ids = topk_batch(5)
    out = distill.compute_topk_loss(SimpleNamespace(strategy="fsdp"), distill_config(),
                                    {"teacher_logprobs": lp, "teacher_ids": ids}, logits, "thd")
    want = hv.forward_kl_topk(logits, lp, ids, distill_config(), "thd")
    for name, value in want.items():
        assert torch.equal(out[name], value), name
    for mode in hv.DISTILLATION_ESTIMATORS:
        assert distill.get_distillation_loss_fn(f"headloss_{mode}").__name__ == f"headloss_{mode}"
        assert distill.get_distillation_loss_settings(f"headloss_{mode}").use_estimator


def _estimator_data(seed):
    """verl's unpadded log-probs [total_nnz] and the TensorDict no_padding_2_padding reads (prompts,
    responses, attention mask), with a ragged response mask and a teacher near the student."""
    from tensordict import TensorDict

    gen = generator(seed)
    b, prompt, response = 3, 2, 5
    student = -torch.rand(b * (prompt + response), generator=gen, dtype=torch.float64) * 4 - 0.05
    teacher = student + 0.8 * torch.randn(student.shape, generator=gen, dtype=torch.float64)
    mask = torch.arange(response)[None] < torch.tensor([5, 3, 1])[:, None]
    data = TensorDict({"prompts": torch.ones(b, prompt, dtype=torch.long),
                       "responses": torch.ones(b, response, dtype=torch.long),
                       "attention_mask": torch.ones(b, prompt + response, dtype=torch.long),
                       "response_mask": mask, "teacher_logprobs": teacher[:, None]}, batch_size=[])
    return student, data


@pytest.mark.parametrize("mode", sorted(hv.DISTILLATION_ESTIMATORS))
def test_estimator_losses_equal_verls_own(mode):
    """Each of verl's single-sample distillation losses (kl_penalty's names, '+' forms too) against
    verl's registered compute_distillation_loss_reverse_kl_estimator: per-token losses, their gradient
    and distillation/abs_loss."""
    from verl.trainer.distillation import losses as distill

    student, data = _estimator_data(7)
    config = distill_config(loss_mode=mode)
    results = []
    for fn in (distill.get_distillation_loss_fn("k3"), hv.distillation_loss_fn(mode)):
        leaf = student.clone().requires_grad_()
        losses, metrics = fn(None, config, {"log_probs": leaf}, data)
        (losses * data["response_mask"]).sum().backward()
        results.append((losses.detach(), leaf.grad, metrics["distillation/abs_loss"].values))
    (want, want_grad, want_abs), (got, got_grad, got_abs) = results
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    assert got_abs == pytest.approx(want_abs, rel=1e-12)  # (Metric.values: a list of floats)
