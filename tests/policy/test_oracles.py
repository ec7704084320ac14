"""The policy objectives beyond PPO's clip, and the KL variants, against fp64 oracles transcribed
from the trainers' sources, on both paths (the Triton kernel under the interpreter, and the plain
torch reference):

* verl  verl/trainer/ppo/core_algos.py (verl-project/verl @ 1dda039b, 2026-08):
        compute_policy_loss_vanilla / _cispo / _sapo / _gpg / _dro / _dppo_tv / _dppo_kl, agg_loss,
        kl_penalty + kl_penalty_forward.
* TRL   trl/trainer/grpo_trainer.py (TRL 1.16.0): GRPOTrainer._compute_loss, the loss_type branches
        cispo and sapo, their aggregation and metrics.

The oracles work on padded [B, T] fp64 tensors exactly as the sources do (mask multiplications,
masked means with verl's +1e-8); the gradient is autograd's through log_softmax of fp64 logits.
No sequence is fully masked here: verl's seq-mean modes drop such sequences, TRL's count them
(headloss follows TRL, see test_policy_kernels.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close_norm, generator, make_logits, make_targets, needs_kernel, tiered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import headloss
import headloss.env
from headloss import LossSpec, head_loss
from headloss.spec import Policy

B, T, V = 3, 7, 37

ORACLE_TESTS = {
    "clip": ["test_verl_objective_matches_core_algos", "test_verl_sequence_and_batch_objectives_match_core_algos"],
    "cispo": ["test_verl_objective_matches_core_algos", "test_trl_cispo_and_sapo_match_compute_loss"],
    "sapo": ["test_verl_objective_matches_core_algos", "test_trl_cispo_and_sapo_match_compute_loss"],
    "gpg": ["test_verl_objective_matches_core_algos"],
    "dro": ["test_verl_objective_matches_core_algos"],
    "dppo_tv": ["test_verl_objective_matches_core_algos"],
    "dppo_kl": ["test_verl_objective_matches_core_algos"],
    "reinforce": ["test_verl_bypass_mode_reinforce_matches_core_algos"],
    "gmpo": ["test_verl_sequence_and_batch_objectives_match_core_algos"],
    "vespo": ["test_trl_vespo_matches_compute_loss"],
    "clip_cov": ["test_verl_sequence_and_batch_objectives_match_core_algos"],
    "kl_cov": ["test_verl_sequence_and_batch_objectives_match_core_algos"],
}
"""Each objective of headloss.policy_tables -> the tests here that hold it against an oracle transcribed
from its source (tests/policy/test_tables.py checks that every objective has one)."""


# --- oracles --------------------------------------------------------------------------------


def masked_mean(values, mask):  # verl.utils.torch_functional.masked_mean
    return (values * mask).sum() / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, mode):  # core_algos.agg_loss, dp_size = 1, no global counts
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float().to(loss_mat.dtype)
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        return loss / loss_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss
    if mode == "seq-mean-token-mean":
        seq_count = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_count + 1e-8)
        seq_mask = (seq_count > 0).to(loss_mat.dtype)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    raise AssertionError(mode)


def verl_agg_loss_global(loss_mat, loss_mask, mode, dp_size, global_batch_size, batch_num_tokens=None):
    """core_algos.agg_loss with dp_size, global_batch_size (and batch_num_tokens) given, @ 1dda039b."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / batch_num_tokens * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float().to(loss_mat.dtype)
        loss = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
        return loss / loss_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss
    if mode == "seq-mean-token-mean":
        seq_count = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_count + 1e-8)
        seq_mask = (seq_count > 0).to(loss_mat.dtype)
        return (seq_losses * seq_mask).sum() / global_batch_size * dp_size
    raise AssertionError(mode)


def verl_policy_loss(mode, old_log_prob, log_prob, advantages, response_mask, cfg, rollout_is_weights=None):
    """core_algos.compute_policy_loss_<mode> (the registered 'vanilla', 'cispo', 'sapo', 'gpg', 'dro',
    'dppo_tv', 'dppo_kl'): (pg_loss, metrics)."""
    low, high = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    agg = cfg["loss_agg_mode"]
    metrics = {}
    negative_approx_kl = log_prob - old_log_prob
    if mode in ("vanilla", "cispo", "sapo", "dppo_tv", "dppo_kl"):
        negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    if mode == "vanilla":
        c = cfg["clip_ratio_c"]
        pg_losses1 = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
        pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
        pg_losses3 = -advantages * c
        clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
        pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(),
                                        response_mask)
        pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
        metrics = {"pg_clipfrac": pg_clipfrac, "pg_clipfrac_lower": pg_clipfrac_lower, "ppo_kl": ppo_kl}
    elif mode == "cispo":
        clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
        pg_losses = -clipped_ratio.detach() * advantages * log_prob
        metrics = {"pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask), "ppo_kl": ppo_kl}
    elif mode == "sapo":
        taus = torch.where(advantages > 0, torch.as_tensor(cfg["tau_pos"], dtype=advantages.dtype),
                           torch.as_tensor(cfg["tau_neg"], dtype=advantages.dtype))
        pg_losses = -(torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)) * advantages
        agg = "seq-mean-token-mean"  # sapo forces it
        metrics = {"ppo_kl": ppo_kl}
    elif mode == "gpg":
        pg_losses = -log_prob * advantages
    elif mode == "dro":
        log_ratio = log_prob - old_log_prob
        pg_losses = -(log_prob * advantages - 0.5 * cfg["dro_beta"] * log_ratio.square())
        metrics = {"ppo_kl": masked_mean(-log_ratio, response_mask)}
    else:  # dppo_tv, dppo_kl
        truncated_ratio = torch.clamp(ratio, max=cfg["clip_ratio_c"]).detach()
        prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
        if mode == "dppo_tv":
            valid_positive_mask = (prob - old_prob) <= high
            valid_negative_mask = (prob - old_prob) >= -low
        else:
            binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            valid_positive_mask = (binary_kl <= high) | (prob <= old_prob)
            valid_negative_mask = (binary_kl <= low) | (prob >= old_prob)
        valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().to(log_prob.dtype)
        pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
        metrics = {"pg_clipfrac": masked_mean(1.0 - valid_mask, response_mask),
                   "pg_clipfrac_lower": masked_mean((ratio > cfg["clip_ratio_c"]).to(ratio.dtype) * valid_mask,
                                                    response_mask),
                   "ppo_kl": ppo_kl}
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return verl_agg_loss(pg_losses, response_mask, agg), metrics


def verl_bypass_reinforce(old_log_prob, log_prob, advantages, response_mask, cfg):
    """core_algos.compute_policy_loss_bypass_mode with rollout_correction loss_type 'reinforce' and
    rollout_is 'token' (no rejection sampling): rollout_corr_helper's weights from log_prob against
    old_log_prob (the rollout's), then compute_policy_loss_reinforce: (pg_loss, metrics)."""
    with torch.no_grad():  # compute_rollout_correction_weights(log_ratio, response_mask, "token", threshold)
        log_ratio = log_prob - old_log_prob
        log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
        rollout_is_weights = torch.exp(log_ratio_safe) * response_mask
        rollout_is_weights = rollout_is_weights.clamp(max=cfg["rollout_is_threshold"]).detach()
    pg_losses = -advantages * log_prob * rollout_is_weights
    pg_loss = verl_agg_loss(pg_losses, response_mask, cfg["loss_agg_mode"])
    negative_approx_kl = log_prob - old_log_prob
    return pg_loss, {"ppo_kl": masked_mean(-negative_approx_kl, response_mask)}


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):  # core_algos.kl_penalty (+ kl_penalty_forward)
    def forward(name):
        if name in ("kl", "k1"):
            return logprob - ref_logprob
        if name == "abs":
            return (logprob - ref_logprob).abs()
        if name in ("mse", "k2"):
            return 0.5 * (logprob - ref_logprob).square()
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # low_var_kl, k3
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)

    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward_score = forward(base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def verl_sequence_loss(mode, old_log_prob, log_prob, advantages, response_mask, cfg, rollout_is_weights=None):
    """core_algos.compute_policy_loss_gspo / _geo_mean / _clip_cov / _kl_cov: (pg_loss, metrics)."""
    low, high = cfg["clip_ratio_low"], cfg["clip_ratio_high"]
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    if mode == "gspo":
        seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
        negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
        log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
        log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
        seq_importance_ratio = torch.exp(log_seq_importance_ratio)
        pg_losses1 = -advantages * seq_importance_ratio
        pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - low, 1 + high)
        pg_losses = torch.maximum(pg_losses1, pg_losses2)
        if rollout_is_weights is not None:
            pg_losses = pg_losses * rollout_is_weights
        pg_loss = verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")
        return pg_loss, {"pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
                         "ppo_kl": ppo_kl}
    if mode == "geo_mean":
        sgn_advantage = torch.sign(advantages)
        negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -low, high)
        negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
        negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
        response_mask_sum = response_mask.sum(dim=-1)
        ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
        advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
        pg_losses = -advantage * ratio
        if rollout_is_weights is not None:
            seq_is_weights = torch.exp(
                (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
            pg_losses = pg_losses * seq_is_weights
        pg_loss = torch.mean(pg_losses)
        clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
        return pg_loss, {"pg_clipfrac": masked_mean((clipped * (advantages > 0)).float(), response_mask),
                         "pg_clipfrac_lower": masked_mean((clipped * (advantages < 0)).float(), response_mask),
                         "ppo_kl": ppo_kl}
    ratio = torch.exp(negative_approx_kl)
    if mode == "clip_cov":
        pg_losses1 = -advantages * ratio
        corr = torch.ones_like(advantages)
        pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
        clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
        cov_all = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob.detach(), response_mask))
        cov_all[response_mask == 0] = -torch.inf
        cov_all[clip_by_origin] = -torch.inf
        clip_num = max(int(cfg["clip_cov_ratio"] * response_mask.sum().item()), 1)
        top_k_idx = (cov_all < cfg["clip_cov_ub"]) & (cov_all > cfg["clip_cov_lb"]) & (response_mask > 0)
        top_k_idx = torch.nonzero(top_k_idx)
        if len(top_k_idx) > 0:
            perm = torch.randperm(len(top_k_idx))
            top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
        else:
            top_k_idx = torch.empty((0, 2), device=cov_all.device, dtype=torch.long)
        corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
        pg_clipfrac = masked_mean((corr == 0).float(), response_mask)
        pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
        return verl_agg_loss(pg_losses, response_mask, cfg["loss_agg_mode"]), \
            {"pg_clipfrac": pg_clipfrac, "ppo_kl": ppo_kl}
    # kl_cov
    abs_kl = negative_approx_kl.abs()
    ppo_kl_abs = masked_mean(negative_approx_kl.abs(), response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + cfg["ppo_kl_coef"] * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = log_prob[all_valid].detach().reshape(-1).cpu()
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * cfg["kl_cov_ratio"]))
    large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    rows_, cols_ = large_cov_idxs // advantages.shape[1], large_cov_idxs % advantages.shape[1]
    pg_losses[rows_, cols_] = pg_losses_kl[rows_, cols_]
    return verl_agg_loss(pg_losses, response_mask, cfg["loss_agg_mode"]), {"ppo_kl": ppo_kl_abs}


def trl_vespo_gamma_weights(advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos=2.0,
                            lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):  # GRPOTrainer.get_gamma_weights
    with torch.no_grad():
        lower_clamp = math.log(1e-8)
        log_ratio_clamped = torch.clamp(log_ratio_per_token, -20.0, 20.0)
        seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
        if importance_sampling_ratio is not None:
            log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
            seq_log_ratio += torch.sum(log_is_ratio, dim=-1, keepdim=True)
        log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
        w_seq = torch.exp(log_w_seq)
        is_nonneg_adv = advantages >= 0
        k_seq = torch.where(is_nonneg_adv, k_pos, k_neg)
        lambda_seq = torch.where(is_nonneg_adv, lambda_pos, lambda_neg).clamp(min=1e-4)
        log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    kl_div = sampling_per_token_logps - per_token_logps.detach()  # GRPOTrainer.get_off_policy_mask
    kl_div = torch.nan_to_num(kl_div, nan=0.0)
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    is_pos_adv = advantages >= 0
    is_low_kl = avg_seq_kl <= off_policy_threshold
    return (is_pos_adv | is_low_kl).to(dtype=mask.dtype)


def trl_high_entropy_mask(entropies, mask, threshold):  # GRPOTrainer.get_high_entropy_mask, one process
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    masked_entropies = entropies * mask.float()
    entropy_mask = masked_entropies >= entropy_threshold
    return entropy_mask & mask.bool()


def global_masked_mean(x, mask):  # _compute_loss's global_masked_mean, one process
    if x.shape[1] == 1:  # importance_sampling_level == "sequence": one value per sequence
        return x.sum() / float(x.shape[0])
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def trl_coef_1(per_token_logps, old_per_token_logps, mask, level):
    """_compute_loss's importance ratio: per token, or (``"sequence"``) [B, 1] from the masked mean."""
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_importance_weights)


def trl_compute_loss(loss_type, per_token_logps, old_per_token_logps, advantages, mask, cfg):
    """GRPOTrainer._compute_loss for loss_type cispo / sapo, importance_sampling_level 'token' or
    'sequence', beta 0, one process, one accumulation step: (loss, metrics)."""
    coef_1 = trl_coef_1(per_token_logps, old_per_token_logps, mask, cfg["importance_sampling_level"])
    metrics = {}
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=cfg["epsilon_high"]).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
        normalizer = cfg["num_items_in_batch"].clamp(min=1.0)
        loss = (per_token_loss * mask).sum() / normalizer
        is_cispo_clipped = ((coef_1 > cfg["epsilon_high"]) & (advantages > 0)).float()
        metrics["cispo_clip_ratio"] = global_masked_mean(is_cispo_clipped, mask)
    else:  # sapo
        temperatures = torch.where(advantages > 0, cfg["sapo_temperature_pos"], cfg["sapo_temperature_neg"])
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return loss, metrics


# --- inputs ---------------------------------------------------------------------------------


def make_case(seed, dtype=torch.float32, per_token_adv=False, noise=0.3):
    logits = make_logits((B, T, V), dtype, seed=seed)
    targets = make_targets((B, T), V, seed=seed)
    gen = generator(seed + 7)
    mask = (torch.rand(B, T, generator=gen) > 0.3).long()
    mask[:, 0] = 1  # no sequence fully masked (see the module docstring)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=gen, dtype=torch.float64)
    adv[0], adv[1] = adv[0].abs(), -adv[1].abs()  # both signs
    old = logp + noise * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    iw = torch.rand(B, T, generator=gen, dtype=torch.float64) + 0.5
    return logits, targets, mask, adv, old, ref, iw


def floats(inputs):
    """The per-call inputs with fp64 tensors as fp32 (the kernel's precision); numbers as they are."""
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def run_both_one(logits, targets, spec, inputs, backend):
    """{backend: (output, logits gradient)} of one path, from the stored logits (fp32 inputs)."""
    leaf = logits.detach().clone().requires_grad_()
    out = head_loss(leaf, targets, spec, backend=backend, **floats(inputs))
    out.loss.backward()
    return {backend: (out, leaf.grad)}


def run_both(logits, targets, spec, inputs):
    """(output, logits gradient) for the kernel and the reference path, from the same stored logits."""
    return {**run_both_one(logits, targets, spec, inputs, "triton"),
            **run_both_one(logits, targets, spec, inputs, "torch")}


def oracle_logp(logits, targets):
    leaf = logits.detach().double().requires_grad_()
    return leaf, torch.log_softmax(leaf, -1).gather(-1, targets[..., None])[..., 0]


def tolerances(dtype):
    return (1e-5, 1e-4) if dtype == torch.float32 else (1e-5, 2e-2)


def compare(got, want_loss, want_grad, want_metrics, dtype):
    rtol_value, rtol_grad = tolerances(dtype)
    for backend, (out, grad) in got.items():
        assert_close_norm(out.loss, want_loss, rtol=rtol_value, atol=3e-6, name=f"{backend} loss")  # sums cancel
        assert_close_norm(grad.double(), want_grad, rtol=rtol_grad, atol=1e-9, name=f"{backend} grad")
        for name, value in want_metrics.items():
            assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=f"{backend} {name}")


# --- verl -------------------------------------------------------------------------------------

VERL_MODES = {  # verl loss_mode -> headloss objective
    "vanilla": "clip", "cispo": "cispo", "sapo": "sapo", "gpg": "gpg", "dro": "dro", "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
}
VERL_AGG = {"token-mean": "token-mean", "seq-mean-token-sum": "seq-mean-token-sum"}


def verl_case(mode, seed, dtype, per_token_adv, agg, rollout_is):
    logits, targets, mask, adv, old, ref, iw = make_case(seed, dtype, per_token_adv, noise=0.5)
    # DPPO's thresholds bound p - p_old (or its binary KL): small enough to drop some tokens here
    low, high = {"dppo_tv": (5e-4, 1e-3), "dppo_kl": (5e-5, 1e-4)}.get(mode, (0.2, 0.28))
    cfg = dict(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=1.2,
               loss_agg_mode=agg, tau_pos=1.0, tau_neg=1.05, dro_beta=0.3)
    policy = Policy(objective=VERL_MODES[mode], convention="verl", loss_type=VERL_AGG[agg], eps_low=low,
                    eps_high=high, dual_clip_c=cfg["clip_ratio_c"] if mode == "vanilla" else None,
                    dppo_ratio_cap=cfg["clip_ratio_c"], sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                    dro_beta=0.3 if mode == "dro" else None)
    if mode == "sapo":
        policy = policy.model_copy(update={"loss_type": "seq-mean-token-mean"})  # verl's sapo forces it
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    if rollout_is:
        inputs["importance_weights"] = iw
    return logits, targets, mask, cfg, LossSpec(cross_entropy=None, policy=policy), inputs


@needs_kernel
@pytest.mark.parametrize("mode, agg, dtype", tiered(list(VERL_MODES), list(VERL_AGG), [torch.float32, torch.bfloat16],
                                                     ids=[list(VERL_MODES), list(VERL_AGG), ["fp32", "bf16"]],
                                                     pairs=False))
def test_verl_objective_matches_core_algos(mode, agg, dtype):
    seed = sum(map(ord, mode + agg))
    for per_token_adv, rollout_is in ((False, False), (True, True)):
        logits, targets, mask, cfg, spec, inputs = verl_case(mode, seed, dtype, per_token_adv, agg, rollout_is)
        leaf, log_prob = oracle_logp(logits, targets)
        adv = inputs["advantages"]
        adv = adv if per_token_adv else adv[:, None].expand(B, T)
        loss, metrics = verl_policy_loss(mode, inputs["old_logprobs"], log_prob, adv, mask.double(), cfg,
                                         inputs.get("importance_weights"))
        loss.backward()
        if mode.startswith("dppo"):  # the case drops some tokens and keeps others
            assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0
        if mode == "vanilla":  # and the dual clip acts
            assert float(metrics["pg_clipfrac_lower"]) > 0.0 and float(metrics["pg_clipfrac"]) > 0.0
        compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, metrics, dtype)


@needs_kernel
@pytest.mark.parametrize("mode", ["vanilla", "cispo", "sapo", "dppo_tv"])
def test_verl_clamps_the_log_ratio_to_plus_minus_20(mode):
    """Tokens 25 nats off their old log-prob: verl's ratio is exp(+-20), its gradient there 0."""
    logits, targets, mask, cfg, spec, inputs = verl_case(mode, 5, torch.float32, False, "token-mean", False)
    mask = torch.ones_like(mask)
    inputs["loss_mask"] = mask
    leaf, log_prob = oracle_logp(logits, targets)
    old = inputs["old_logprobs"].clone()
    old[0, 1], old[1, 2] = log_prob[0, 1].detach() + 25.0, log_prob[1, 2].detach() - 25.0
    inputs["old_logprobs"] = old
    adv = inputs["advantages"][:, None].expand(B, T)
    loss, metrics = verl_policy_loss(mode, old, log_prob, adv, mask.double(), cfg)
    loss.backward()
    compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, metrics, torch.float32)


@needs_kernel
@pytest.mark.parametrize("agg, dtype, per_token_adv", tiered(list(VERL_AGG), [torch.float32, torch.bfloat16],
                                                              [False, True], ids=[list(VERL_AGG), ["fp32", "bf16"],
                                                                                  ["seq_adv", "token_adv"]]))
def test_verl_bypass_mode_reinforce_matches_core_algos(agg, dtype, per_token_adv):
    """old_logprobs are the rollout's; some weights above rollout_is_threshold, and two tokens 30
    nats off (the weight's +-20 clamp; ppo_kl takes the unclamped log-ratio)."""
    logits, targets, mask, adv, old, _, _ = make_case(sum(map(ord, agg)), dtype, per_token_adv, noise=0.5)
    leaf, log_prob = oracle_logp(logits, targets)
    old = old.clone()
    old[0, 1], old[1, 2] = log_prob[0, 1].detach() + 30.0, log_prob[1, 2].detach() - 30.0
    mask[0, 1] = mask[1, 2] = 1
    cfg = dict(rollout_is_threshold=1.3, loss_agg_mode=agg)
    adv_bt = adv if per_token_adv else adv[:, None].expand(B, T)
    loss, metrics = verl_bypass_reinforce(old, log_prob, adv_bt, mask.double(), cfg)
    loss.backward()
    weights = torch.exp(torch.clamp(log_prob - old, -20, 20)).detach()
    assert ((weights > 1.3) & (mask > 0)).any() and ((weights < 1.3) & (mask > 0)).any()  # truncation acts
    spec = LossSpec(cross_entropy=None, policy=Policy(objective="reinforce", convention="verl", loss_type=agg,
                                                      reinforce_is_max=1.3))
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, metrics, dtype)


VERL_KL = {  # verl kl_loss_type -> (kl_estimator, kl_clamp, kl_grad)
    "k1": ("k1", False, "estimator"), "abs": ("abs", False, "estimator"), "k2": ("k2", False, "estimator"),
    "low_var_kl": ("k3", True, "estimator"), "k3+": ("k3", True, "k2"), "abs+": ("abs", False, "k2"),
    "k1+": ("k1", False, "k2"),
}


@needs_kernel
@pytest.mark.parametrize("name", list(VERL_KL))
def test_verl_kl_losses_match_kl_penalty(name):
    """The actor's KL loss: agg_loss(kl_penalty(log_prob, ref, kl_loss_type)) * kl_loss_coef, added to
    the policy loss (here gpg's); refs 25 nats away and 3 below reach both of low_var_kl's clamps."""
    logits, targets, mask, adv, old, ref, _ = make_case(17)
    estimator, clamp, grad = VERL_KL[name]
    leaf, log_prob = oracle_logp(logits, targets)
    ref = ref.clone()
    ref[0, 0] = log_prob[0, 0].detach() + 25.0
    ref[1, 0] = log_prob[1, 0].detach() - 3.0
    ref[2, 0] = log_prob[2, 0].detach() + 2.5
    advs = adv[:, None].expand(B, T)
    pg, _ = verl_policy_loss("gpg", old, log_prob, advs, mask.double(),
                             dict(clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean"))
    kld = verl_kl_penalty(log_prob, ref, name)
    loss = pg + verl_agg_loss(kld, mask.double(), "token-mean") * 0.1
    loss.backward()
    spec = LossSpec(cross_entropy=None, policy=Policy(objective="gpg", convention="verl", loss_type="token-mean",
                                                      kl_beta=0.1, kl_estimator=estimator, kl_clamp=clamp,
                                                      kl_grad=grad))
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask)
    kl_metric = masked_mean(kld.detach(), mask.double())
    compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, {"kl": kl_metric}, torch.float32)


# --- TRL --------------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trl_cispo_and_sapo_match_compute_loss(loss_type, level, dtype):
    logits, targets, mask, adv, old, _, _ = make_case(23, dtype, noise=0.6)
    leaf, logp = oracle_logp(logits, targets)
    m = mask.double()
    eps_high = 1.3 if level == "token" else 1.02  # a sequence's ratio is a mean's exp: closer to 1
    cfg = dict(importance_sampling_level=level, epsilon_high=eps_high, sapo_temperature_pos=2.0,
               sapo_temperature_neg=1.05, num_items_in_batch=m.sum())
    loss, metrics = trl_compute_loss(loss_type, logp, old, adv[:, None], m, cfg)
    loss.backward()
    # TRL's cispo aggregates like dapo (sum / num_items_in_batch), sapo like grpo
    policy = Policy(objective=loss_type, loss_type="dapo" if loss_type == "cispo" else "grpo", eps_high=eps_high,
                    sapo_tau_pos=2.0, sapo_tau_neg=1.05, importance_sampling=level)
    want = {"clip_ratio/high_mean": metrics["cispo_clip_ratio"]} if loss_type == "cispo" else {}
    if loss_type == "cispo":
        assert 0.0 < float(metrics["cispo_clip_ratio"]) < 1.0
    got = run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy),
                   dict(advantages=adv, old_logprobs=old, loss_mask=mask))
    compare(got, loss.detach(), leaf.grad, want, dtype)


# --- spec ---------------------------------------------------------------------------------------


def test_dro_without_its_beta_is_a_spec_error_naming_it():
    with pytest.raises(ValueError, match="dro_beta"):
        Policy(objective="dro")


@pytest.mark.parametrize("objective", ["gpg", "dro", "dppo_tv", "dppo_kl", "reinforce"])
def test_sequence_level_ratios_with_a_per_token_objective_is_a_spec_error(objective):
    with pytest.raises(ValueError, match="importance_sampling"):
        Policy(objective=objective, importance_sampling="sequence", dro_beta=0.1)


# --- the fused lm_head path ---------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("objective, level", [("cispo", "token"), ("sapo", "sequence"), ("gpg", "token"),
                                              ("dro", "token"), ("dppo_tv", "token"), ("dppo_kl", "token"),
                                              ("reinforce", "token"), ("cispo", "sequence"), ("clip", "sequence_token"),
                                              ("gmpo", "token"),
                                              ("vespo", "token"), ("kl_cov", "token"), ("masks", "token")])
def test_linear_head_runs_every_objective_like_the_logits_path(objective, level):
    """linear_head_loss (chunks of 5 rows over [B, T, H] hidden states) against the reference on the
    fp64 logits hidden @ W.T: loss, metrics, and the gradients of hidden and weight."""
    gen = generator(31)
    hidden = torch.randn(B, T, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=gen, dtype=torch.float64) / 2
    _, targets, mask, adv, old, ref, iw = make_case(31, per_token_adv=objective == "dro")
    masks = dict(off_policy_mask=0.05, top_entropy_quantile=0.5) if objective == "masks" else {}
    objective = "clip" if objective == "masks" else objective
    policy = Policy(objective=objective, convention="verl" if objective == "cispo" else "trl", loss_type="grpo",
                    cov_ratio=0.2, **masks,
                    importance_sampling=level, eps_low=5e-4 if objective.startswith("dppo") else 0.2,
                    eps_high=1e-3 if objective.startswith("dppo") else 0.28, dro_beta=0.2 if objective == "dro" else
                    None, kl_beta=0.05, kl_estimator="k3", kl_clamp=True, kl_grad="k2")
    spec = LossSpec(cross_entropy=None, policy=policy)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, importance_weights=iw)
    floats = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    out = headloss.linear_head_loss(h, w, targets, spec, chunk_bytes=5 * V * 4, **floats)
    out.loss.backward()
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_out = head_loss(h64 @ w64.T, targets, spec, backend="torch", **inputs)
    ref_out.loss.backward()
    assert_close_norm(out.loss, ref_out.loss, rtol=1e-5, atol=3e-6, name="loss")
    assert_close_norm(h.grad, h64.grad, rtol=1e-4, atol=1e-9, name="hidden grad")
    assert_close_norm(w.grad, w64.grad, rtol=1e-4, atol=1e-9, name="weight grad")
    for name in ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower", "clip_ratio/high_mean", "kl", "ratio/mean"):
        assert_close_norm(out.metrics[name], ref_out.metrics[name], rtol=1e-5, atol=1e-6, name=name)


# --- sequence and batch statistics (deferred mode) ------------------------------------------


def oracle_logp_entropy(logits, targets):
    leaf = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(leaf, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    return leaf, logp_all.gather(-1, targets[..., None])[..., 0], entropy


VERL_SEQUENCE_MODES = ["gspo", "geo_mean", "clip_cov", "kl_cov"]


@needs_kernel
@pytest.mark.parametrize("mode, dtype", tiered(VERL_SEQUENCE_MODES, [torch.float32, torch.bfloat16],
                                               ids=[VERL_SEQUENCE_MODES, ["fp32", "bf16"]], pairs=False))
def test_verl_sequence_and_batch_objectives_match_core_algos(mode, dtype):
    """verl's gspo (importance_sampling='sequence_token'), geo_mean (gmpo), clip_cov and kl_cov: the
    random choice of clip_cov is verl's torch.randperm on the default CPU generator, seeded alike."""
    for per_token_adv, rollout_is in ((False, False), (True, True)):
        logits, targets, mask, adv, old, _, iw = make_case(41, dtype, per_token_adv, noise=0.4)
        leaf, log_prob = oracle_logp(logits, targets)
        advs = adv if per_token_adv else adv[:, None].expand(B, T)
        cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", clip_cov_ratio=0.2,
                   clip_cov_lb=-5.0, clip_cov_ub=5.0, kl_cov_ratio=0.2, ppo_kl_coef=0.5)
        weights = iw if rollout_is and mode in ("gspo", "geo_mean") else None
        torch.manual_seed(7)
        loss, metrics = verl_sequence_loss(mode, old, log_prob, advs, mask.double(), cfg, weights)
        loss.backward()
        fields = dict(eps_low=0.2, eps_high=0.28, cov_ratio=0.2, clip_cov_lb=-5.0, clip_cov_ub=5.0, kl_cov_coef=0.5)
        if mode == "gspo":
            policy = Policy(importance_sampling="sequence_token", loss_type="seq-mean-token-mean", **fields)
        else:
            policy = Policy(objective={"geo_mean": "gmpo"}.get(mode, mode),
                            loss_type="grpo" if mode == "geo_mean" else "token-mean", **fields)
        inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
        if weights is not None:
            inputs["importance_weights"] = weights
        spec = LossSpec(cross_entropy=None, policy=policy)
        got = {}
        for backend in ("triton", "torch"):
            torch.manual_seed(7)
            got.update(run_both_one(logits, targets, spec, inputs, backend))
        if mode == "clip_cov":
            assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0
        compare(got, loss.detach(), leaf.grad, metrics, dtype)


@needs_kernel
@pytest.mark.parametrize("rollout_is", [False, True], ids=["plain", "with_is_ratio"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trl_vespo_matches_compute_loss(dtype, rollout_is):
    logits, targets, mask, adv, old, _, iw = make_case(43, dtype, noise=0.05)
    leaf, logp = oracle_logp(logits, targets)
    m = mask.double()
    weights = torch.where(mask > 0, iw, 1.0) if rollout_is else None  # TRL's token ratios are 1 off the mask
    phi = trl_vespo_gamma_weights(adv[:, None], logp - old, m, weights)
    per_token_loss = -phi * adv[:, None] * logp
    loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)  # dapo's normaliser, one process
    loss.backward()
    want = {"vespo/phi_seq_mean": phi.mean()}  # global_masked_mean of a (B, 1) tensor
    assert float(phi.min()) > 0.0
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    if rollout_is:
        inputs["importance_weights"] = weights
    spec = LossSpec(cross_entropy=None, policy=Policy(objective="vespo", loss_type="dapo"))
    compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, want, dtype)


@needs_kernel
@pytest.mark.parametrize("mask_kind", ["off_policy", "top_entropy", "both"])
def test_trl_off_policy_and_entropy_masks_match_compute_loss(mask_kind):
    """The masks multiply the clipped objective (before the rollout weights and the KL, which they
    leave alone), as TRL's _compute_loss does; dapo aggregation, beta 0.05 (k3)."""
    logits, targets, mask, adv, old, ref, iw = make_case(47, noise=0.5)
    leaf, logp, entropies = oracle_logp_entropy(logits, targets)
    m = mask.double()
    a = adv[:, None]
    coef_1 = torch.exp(logp - old)
    per_token_loss = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.28) * a)
    fields = {}
    if mask_kind in ("off_policy", "both"):
        off = trl_off_policy_mask(a, logp, old, m, 0.05)
        assert 0.0 < float(off.mean()) < 1.0
        per_token_loss = per_token_loss * off
        fields["off_policy_mask"] = 0.05
    want = {}
    if mask_kind in ("top_entropy", "both"):
        high = trl_high_entropy_mask(entropies, m, 1 - 0.4)
        per_token_loss = per_token_loss * high
        fields["top_entropy_quantile"] = 0.4
        kept = high * m
        want = {"high_entropy/fraction": kept.sum() / m.sum(),
                "high_entropy/entropy": (entropies * kept).sum() / kept.sum()}
    per_token_loss = per_token_loss * iw
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token_loss = per_token_loss + 0.05 * per_token_kl
    loss = (per_token_loss * m).sum() / m.sum()
    loss.backward()
    policy = Policy(loss_type="dapo", eps_low=0.2, eps_high=0.28, kl_beta=0.05, **fields)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, importance_weights=iw)
    compare(run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy), inputs), loss.detach(),
            leaf.grad, want, torch.float32)


def trl_high_entropy_mask_gathered(entropies, mask, threshold, everyone):
    """GRPOTrainer.get_high_entropy_mask over several processes: the quantile of every process's
    counted entropies (``everyone``: their (entropies, mask) pairs, as accelerator.gather gives them)."""
    gathered = torch.cat([e[m.bool()].float() for e, m in everyone])
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(gathered, threshold)
    return ((entropies * mask.float()) >= entropy_threshold) & mask.bool()


QUANTILE_SHAPES = ((3, 7), (2, 5))  # each process's [B, T]: uneven, as trainers' micro-batches are


def quantile_case(rank):
    """Rank ``rank``'s batch: hidden states and a head (fp64), targets, mask (one rank's mask may
    empty a sequence), per-sequence advantages, old log-probs."""
    batch, length = QUANTILE_SHAPES[rank]
    gen = generator(90 + rank)
    hidden = torch.randn(batch, length, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=gen, dtype=torch.float64) * (0.6 + 0.2 * rank)  # entropies differ
    targets = torch.randint(0, V, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
    mask[:, 0] = 1
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    adv[0], adv[1] = adv[0].abs(), -adv[1].abs()
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None])[..., 0]
    old = logp + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return hidden, weight, targets, mask, adv, old


def quantile_oracle(rank, world, quantile, bonus):
    """(loss, d loss / d hidden) of TRL's grpo loss with its global top-entropy mask, and its entropy
    bonus (the mean over the masked tokens) if ``bonus``, on rank ``rank``'s batch:
    GRPOTrainer._compute_loss."""
    everyone = []
    for r in range(world):
        hidden, weight, targets, mask, _, _ = quantile_case(r)
        _, _, entropies = oracle_logp_entropy(hidden @ weight.T, targets)
        everyone.append((entropies, mask.double()))
    hidden, weight, targets, mask, adv, old = quantile_case(rank)
    h = hidden.clone().requires_grad_()
    logp_all = torch.log_softmax(h @ weight.T, -1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0]
    entropies = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.double()
    high = trl_high_entropy_mask_gathered(entropies.detach(), m, 1 - quantile, everyone)
    assert 0 < int(high.sum()) < int(m.sum())  # some tokens kept, some dropped on every rank
    coef_1 = torch.exp(logp - old)
    a = adv[:, None]
    per_token_loss = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.2) * a) * high
    loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if bonus:
        effective = m * high
        loss = loss - 0.05 * (entropies * effective).sum() / effective.sum().clamp(min=1.0)
    loss.backward()
    return loss.detach(), h.grad


def _rank_entropy_quantile(rank, world, port, results):
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        quantile = 0.4
        hidden, weight, targets, mask, adv, old = quantile_case(rank)
        inputs = dict(advantages=adv.float(), old_logprobs=old.float(), loss_mask=mask,
                      entropy_quantile_group=dist.group.WORLD)
        errors = {}
        # with TRL's bonus the lm_head runs deferred; without, fused under a guessed mask, then corrected
        for bonus, backend in (("bonus", "triton"), ("bonus", "torch"), ("", "triton")):
            want_loss, want_grad = quantile_oracle(rank, world, quantile, bool(bonus))
            policy = Policy(loss_type="grpo", top_entropy_quantile=quantile, entropy_coef=0.05 if bonus else 0.0,
                            entropy_aggregation="token-mean")
            spec = LossSpec(cross_entropy=None, policy=policy)
            h = hidden.float().requires_grad_()
            logits = h @ weight.float().T
            out = head_loss(logits, targets, spec, backend=backend, **inputs)
            out.loss.backward()
            errors[bonus + backend] = (abs(float(out.loss) - float(want_loss)) / abs(float(want_loss)),
                                       float((h.grad.double() - want_grad).norm() / want_grad.norm()))
            h = hidden.float().requires_grad_()
            out = headloss.linear_head_loss(h, weight.float(), targets, spec, backend=backend,
                                            chunk_bytes=4 * V * 4, **inputs)
            out.loss.backward()
            errors[f"lm_head-{bonus}{backend}"] = (abs(float(out.loss) - float(want_loss)) / abs(float(want_loss)),
                                                   float((h.grad.double() - want_grad).norm() / want_grad.norm()))
        alone = head_loss(hidden.float() @ weight.float().T, targets, spec, **{
            k: v for k, v in inputs.items() if k != "entropy_quantile_group"})
        errors["alone"] = (abs(float(alone.loss) - float(want_loss)) / abs(float(want_loss)), 0.0)
        results[rank] = errors
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_kernel
def test_top_entropy_quantile_over_processes_matches_trls_gathered_quantile():
    """entropy_quantile_group: the quantile of every process's counted entropies (two gloo processes
    with batches of different shapes), as TRL's get_high_entropy_mask gathers them; loss and
    gradient of TRL's grpo loss with that mask, with the entropy bonus over it (the lm_head's
    deferred mode) or without (its fused guess and correction), on the logits and the lm_head,
    kernel and reference. Without the group each process's own quantile differs."""
    from conftest import spawn_ranks

    results = spawn_ranks(_rank_entropy_quantile, 2)
    for rank, errors in results.items():
        for path, (loss_err, grad_err) in errors.items():
            if path == "alone":
                assert loss_err > 1e-3, (rank, "the test needs ranks whose own quantiles differ from the global one")
                continue
            assert loss_err <= 1e-5 and grad_err <= 1e-4, (rank, path, loss_err, grad_err)


def _rank_entropy_quantile_one_rank_empty(rank, world, port, results):
    """Rank 1 has no counted token: every route still joins the quantile's collective (a mismatch
    fails within the group's timeout instead of hanging)."""
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        hidden, weight, targets, mask, adv, old = quantile_case(0)
        if rank == 1:
            mask = torch.zeros_like(mask)
        policy = Policy(loss_type="dapo", top_entropy_quantile=0.4)
        spec = LossSpec(cross_entropy=None, policy=policy)
        inputs = dict(advantages=adv.float(), old_logprobs=old.float(), loss_mask=mask,
                      entropy_quantile_group=dist.group.WORLD)
        alone = head_loss(hidden.float() @ weight.float().T, targets, spec, backend="torch",
                          **{k: v for k, v in inputs.items() if k != "entropy_quantile_group"})
        losses = {}
        for name in ("logits", "lm_head", "lm_head no grad"):
            with torch.set_grad_enabled(name != "lm_head no grad"):
                h = hidden.float().requires_grad_(torch.is_grad_enabled())
                if name == "logits":
                    out = head_loss(h @ weight.float().T, targets, spec, **inputs)
                else:
                    out = headloss.linear_head_loss(h, weight.float(), targets, spec, chunk_bytes=4 * V * 4, **inputs)
                if out.loss.requires_grad:
                    out.loss.backward()
            losses[name] = (float(out.loss), float(alone.loss), sorted(out.metrics))
        results[rank] = losses
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@needs_kernel
def test_top_entropy_quantile_over_processes_with_a_process_without_tokens():
    """A process whose tokens are all masked still takes part in the quantile's collective (the
    lm_head skips its rows: it joins anyway): no hang and no mismatched collective (which would fail
    within the 60 s timeout), its loss is 0, the other's loss is its own batch's (the union is its
    tokens alone), and both report the same metrics."""
    from conftest import spawn_ranks

    results = spawn_ranks(_rank_entropy_quantile_one_rank_empty, 2)
    for path in ("logits", "lm_head", "lm_head no grad"):
        loss0, alone0, names0 = results[0][path]
        loss1, _, names1 = results[1][path]
        assert loss0 == pytest.approx(alone0, rel=1e-5, abs=1e-7), path
        assert loss1 == 0.0 and names0 == names1, path
        assert "high_entropy/fraction" in names0


@needs_kernel
def test_lm_head_top_entropy_mask_without_gradient_keeps_the_mask():
    """Under torch.no_grad (evaluation) the lm_head's top-entropy mask still applies: the loss and
    metrics are the reference's (the guessed route corrects the loss without a GEMM)."""
    hidden, weight, targets, mask, adv, old = quantile_case(0)
    spec = LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo", top_entropy_quantile=0.3))
    inputs = dict(advantages=adv.float(), old_logprobs=old.float(), loss_mask=mask)
    with torch.no_grad():
        out = headloss.linear_head_loss(hidden.float(), weight.float(), targets, spec, chunk_bytes=4 * V * 4,
                                        **inputs)
    ref = head_loss(hidden @ weight.T, targets, spec, backend="torch", **inputs)
    masked = head_loss(hidden @ weight.T, targets, spec.model_copy(update={"policy": Policy(loss_type="grpo")}),
                       backend="torch", **inputs)
    assert abs(float(masked.loss) - float(ref.loss)) > 1e-3  # the mask matters here
    assert_close_norm(out.loss, ref.loss, rtol=1e-5, atol=3e-6, name="loss")
    assert set(out.metrics) == set(ref.metrics)
    for name, value in ref.metrics.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=name)


def _rank_quantile_fp64(rank, world, port, results):
    import datetime
    import os

    import torch.distributed as dist

    from headloss.policy.masks import masked_quantile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        # rank 0 holds the smallest value, 1 - 1e-9 (1.0 in fp32), and a value it does not keep
        values = torch.tensor([[1 - 1e-9, 2.0, 0.5], [3.0, 4.0, 0.25]][rank], dtype=torch.float64)
        keep = torch.tensor([True, True, False])
        threshold = masked_quantile(values, keep, 0.0, dist.group.WORLD)
        alone = masked_quantile(torch.tensor([1 - 1e-9, 2.0, 3.0, 4.0], dtype=torch.float64),
                                torch.ones(4, dtype=torch.bool), 0.0)
        results[rank] = (float(threshold), float(alone), int(((values >= threshold) & keep).sum()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_top_entropy_quantile_over_processes_keeps_fp64_values_exact():
    """fp64 values (the reference backend on fp64 logits): the gathered quantile is the
    single-process one over the union, not rounded to fp32, so the token at the threshold stays
    in its own process's mask."""
    from conftest import spawn_ranks

    results = spawn_ranks(_rank_quantile_fp64, 2)
    assert results[0][0] == results[0][1] == results[1][0] == 1 - 1e-9
    assert results[0][2] == 2 and results[1][2] == 2


def test_entropy_quantile_group_errors_name_the_argument():
    logits, targets, mask, adv, old, _, _ = make_case(3)
    masked = LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo", top_entropy_quantile=0.5))
    inputs = dict(advantages=adv.float(), old_logprobs=old.float(), loss_mask=mask)
    for backend in ("triton", "torch") if headloss.env.INTERPRETER else ("torch",):
        with pytest.raises(ValueError, match="entropy_quantile_group: given, but the spec has no top-entropy mask"):
            head_loss(logits, targets, LossSpec(cross_entropy=None, policy=Policy(loss_type="grpo")),
                      backend=backend, entropy_quantile_group=object(), **inputs)
        with pytest.raises(ValueError, match="entropy_quantile_group: given, but the spec has no policy term"):
            head_loss(logits, targets, backend=backend, entropy_quantile_group=object())
        with pytest.raises(ValueError, match="entropy_quantile_group: torch.distributed is not initialised"):
            head_loss(logits, targets, masked, backend=backend, entropy_quantile_group=object(), **inputs)
        with pytest.raises(ValueError, match="entropy_quantile_group: torch.distributed is not initialised"):
            headloss.linear_head_loss(torch.randn(B, T, 8), torch.randn(V, 8), targets, masked, backend=backend,
                                      entropy_quantile_group=object(), **inputs)


# --- rollout correction -----------------------------------------------------------------------


def trl_vllm_is_ratio(old_per_token_logps, sampling_per_token_logps, mask, mode, clip_min, clip_max):
    """GRPOTrainer._generate_and_score_completions' vllm_importance_sampling_ratio."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def verl_rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, rollout_is, upper, lower, normalize):
    """rollout_corr_helper.compute_rollout_correction_weights (one process)."""
    log_ratio = old_log_prob - rollout_log_prob
    if rollout_is == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    else:
        log_ratio_sum = (torch.where(response_mask.bool(), log_ratio, 0.0) * response_mask).sum(-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        kept = (raw >= lower) & (raw <= upper)
        weights = torch.where(kept, raw, torch.zeros_like(raw))
    weights = weights.detach()
    if normalize:
        if rollout_is == "token":
            weights_mean = masked_mean(weights, response_mask)
        else:
            seq_weights = (weights * response_mask).sum(-1) / (response_mask.sum(-1) + 1e-8)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            weights_mean = (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if weights_mean > 1e-8:
            weights = weights / weights_mean
    return weights


@needs_kernel
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_vllm_importance_sampling_modes_match(mode):
    """TRL computes the ratio from old and sampling log-probs and multiplies the clipped objective by
    it (dapo); headloss computes it from rollout_logprobs in the same call, fused mode."""
    logits, targets, mask, adv, old, _, _ = make_case(53, noise=0.3)
    leaf, logp = oracle_logp(logits, targets)
    m = mask.double()
    rollout = old + 0.05 * torch.randn(B, T, generator=generator(5), dtype=torch.float64)
    clip_min, clip_max = (0.95, 1.05) if mode.startswith("token") else (0.96, 1.04)
    ratio_is = trl_vllm_is_ratio(old, rollout, m, mode, clip_min, clip_max)
    assert 0.0 < float((ratio_is * m).sum() / m.sum()) and (mode.endswith("mask") <= bool((ratio_is == 0).any()))
    coef_1 = torch.exp(logp - old)
    a = adv[:, None]
    per_token_loss = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.2) * a) * ratio_is
    loss = (per_token_loss * m).sum() / m.sum()
    loss.backward()
    level, how = mode.split("_")
    policy = Policy(loss_type="dapo", rollout_is=level, rollout_is_mode=how, rollout_is_min=clip_min,
                    rollout_is_max=clip_max)
    inputs = dict(advantages=adv, old_logprobs=old, rollout_logprobs=rollout, loss_mask=mask)
    got = run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy), inputs)
    assert next(iter(got.values()))[0].loss.requires_grad
    compare(got, loss.detach(), leaf.grad, {}, torch.float32)


@needs_kernel
@pytest.mark.parametrize("objective, threshold, level", tiered(["clip", "gmpo"], ["tis", "icepop", "tis-normalized"],
                                                               ["token", "sequence"]))
def test_verl_rollout_correction_weights_match(level, threshold, objective):
    """verl's rollout_is weights (TIS: truncated above; IcePop: zero outside [lower, upper]; batch
    normalisation) fed to compute_policy_loss_vanilla and geo_mean (its geometric mean)."""
    logits, targets, mask, adv, old, _, _ = make_case(59, noise=0.3)
    leaf, log_prob = oracle_logp(logits, targets)
    m = mask.double()
    rollout = old + 0.05 * torch.randn(B, T, generator=generator(6), dtype=torch.float64)
    upper, lower = (1.04, 0.96) if level == "token" else (1.3, 0.8)
    weights = verl_rollout_is_weights(old, rollout, m, level, upper, lower if threshold == "icepop" else None,
                                      threshold.endswith("normalized"))
    advs = adv[:, None].expand(B, T)
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="token-mean")
    if objective == "clip":
        loss, metrics = verl_policy_loss("vanilla", old, log_prob, advs, m, cfg, weights)
    else:
        loss, metrics = verl_sequence_loss("geo_mean", old, log_prob, advs, m, cfg, weights)
    loss.backward()
    policy = Policy(objective=objective, convention="verl", loss_type="token-mean" if objective == "clip" else "grpo",
                    eps_low=0.2, eps_high=0.28, dual_clip_c=3.0 if objective == "clip" else None, rollout_is=level,
                    rollout_is_mode="mask" if threshold == "icepop" else "truncate",
                    rollout_is_min=lower if threshold == "icepop" else None, rollout_is_max=upper,
                    rollout_is_batch_normalize=threshold.endswith("normalized"))
    inputs = dict(advantages=adv, old_logprobs=old, rollout_logprobs=rollout, loss_mask=mask)
    compare(run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy), inputs), loss.detach(), leaf.grad,
            metrics, torch.float32)


def test_rollout_correction_input_errors_name_the_argument():
    logits, targets, mask, adv, old, _, iw = make_case(61)
    spec = LossSpec(cross_entropy=None, policy=Policy(rollout_is="token"))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        head_loss(logits, targets, spec, advantages=adv.float(), old_logprobs=old.float(), backend="torch")
    with pytest.raises(ValueError, match="importance_weights"):
        head_loss(logits, targets, spec, advantages=adv.float(), old_logprobs=old.float(),
                  rollout_logprobs=old.float(), importance_weights=iw.float(), backend="torch")
    with pytest.raises(ValueError, match="rollout_logprobs: expected shape"):
        head_loss(logits, targets, spec, advantages=adv.float(), old_logprobs=old.float(),
                  rollout_logprobs=old[:, :2].float(), backend="torch")
    with pytest.raises(ValueError, match="rollout_is_min"):
        Policy(rollout_is="token", rollout_is_min=2.0, rollout_is_max=1.5)



# --- conventions --------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_verl_convention_drops_fully_masked_sequences_from_the_mean(agg):
    """agg_loss's seq_mask: a sequence without counted tokens is not in the denominator (verl), while
    TRL's convention (the default) counts every sequence."""
    logits, targets, mask, adv, old, _, _ = make_case(67)
    mask[1] = 0  # sequence 1: nothing counted
    leaf, log_prob = oracle_logp(logits, targets)
    m = mask.double()
    pg_losses = -adv[:, None] * log_prob  # gpg
    loss = verl_agg_loss(pg_losses, m, agg)
    loss.backward()
    spec = LossSpec(cross_entropy=None, policy=Policy(objective="gpg", convention="verl", loss_type=agg))
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    compare(run_both(logits, targets, spec, inputs), loss.detach(), leaf.grad, {}, torch.float32)
    trl_style = run_both(logits, targets, LossSpec(cross_entropy=None, policy=Policy(objective="gpg", loss_type=agg)),
                         inputs)
    # the same sum over all 3 sequences instead of the 2 counted ones; the default sum-norm is verl's
    # earlier sum / T, without the mean over sequences
    ratio = 3.0 / 2.0 if agg != "seq-mean-token-sum-norm" else 1.0 / 2.0
    for out, _ in trl_style.values():
        assert abs(float(out.loss.detach()) * ratio - float(loss.detach())) <= 1e-5 * abs(float(loss.detach()))


@needs_kernel
@pytest.mark.parametrize("agg, loss_type, convention, form", tiered([
    ("seq-mean-token-mean", "seq-mean-token-mean", "verl"), ("seq-mean-token-sum", "seq-mean-token-sum", "verl"),
    ("seq-mean-token-sum-norm", "seq-mean-token-sum-norm", "verl"), ("seq-mean-token-mean", "grpo", "trl"),
], ["number", "tensor"], pairs=False))
def test_verl_seq_mean_over_data_parallel_ranks_takes_the_global_batch_size(agg, loss_type, convention, form):
    """agg_loss(..., dp_size, global_batch_size): num_sequences_in_batch = global_batch_size and
    policy.num_processes = dp_size; the kernel, the reference and the lm_head alike."""
    logits, targets, mask, adv, old, ref, _ = make_case(71)
    mask[1] = 0  # a sequence with nothing counted adds nothing (and its count is the caller's business)
    leaf, log_prob = oracle_logp(logits, targets)
    ratio = torch.exp(log_prob - old)
    pg_losses = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * torch.clamp(ratio, 0.8, 1.28))
    kl = torch.exp(ref - log_prob) - (ref - log_prob) - 1  # k3, inside agg_loss with the policy loss
    loss = verl_agg_loss_global(pg_losses + 0.04 * kl, mask.double(), agg, dp_size=4, global_batch_size=11)
    loss.backward()
    spec = LossSpec(cross_entropy=None, policy=Policy(
        loss_type=loss_type, convention=convention, num_processes=4, eps_low=0.2, eps_high=0.28, kl_beta=0.04))
    given = 11 if form == "number" else torch.tensor(11.0)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, num_sequences_in_batch=given)
    got = run_both(logits, targets, spec, inputs)
    compare(got, loss.detach(), leaf.grad, {}, torch.float32)
    hidden = torch.randn(B, T, 16, generator=generator(72), dtype=torch.float64)
    weight = torch.randn(V, 16, generator=generator(73), dtype=torch.float64)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = torch.log_softmax(h64 @ w64.t(), -1).gather(-1, targets[..., None])[..., 0]
    r = torch.exp(lp - old)
    oracle = verl_agg_loss_global(
        torch.maximum(-adv[:, None] * r, -adv[:, None] * torch.clamp(r, 0.8, 1.28))
        + 0.04 * (torch.exp(ref - lp) - (ref - lp) - 1), mask.double(), agg, dp_size=4, global_batch_size=11)
    oracle.backward()
    for backend in ("triton", "torch"):
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        out = headloss.linear_head_loss(h, w, targets, spec, backend=backend, chunk_bytes=2 * V * 4,
                                        **floats(inputs))
        out.loss.backward()
        assert_close_norm(out.loss, oracle.detach(), rtol=1e-5, atol=3e-6, name=f"lm_head {backend} loss")
        assert_close_norm(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-9, name=f"lm_head {backend} dh")
        assert_close_norm(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-9, name=f"lm_head {backend} dw")


def test_num_sequences_in_batch_errors_name_it():
    logits, targets, mask, adv, old, _, _ = make_case(74)
    for policy, value, match in (
        (Policy(loss_type="dapo"), 4, "only for a mean over sequences"),
        (Policy(loss_type="seq-mean-token-sum-norm"), 4, "convention='verl'"),
        (Policy(loss_type="grpo"), 0, "positive finite number"),
        (Policy(loss_type="grpo"), torch.tensor([1.0, 2.0]), "expected one element, got shape \\(2,\\)"),
        (Policy(objective="gmpo", loss_type="grpo"), 4, "geo_mean"),
    ):
        for backend in ("triton", "torch") if headloss.env.INTERPRETER else ("torch",):
            with pytest.raises(ValueError, match=f"num_sequences_in_batch: .*{match}"):
                head_loss(logits, targets, LossSpec(cross_entropy=None, policy=policy), advantages=adv,
                          old_logprobs=old, num_sequences_in_batch=value, backend=backend)
    with pytest.raises(ValueError, match="num_sequences_in_batch: given, but the spec has no policy term"):
        head_loss(logits, targets, num_sequences_in_batch=4)


@needs_kernel
@pytest.mark.parametrize("quantile", [1.0, 0.5])
@pytest.mark.parametrize("aggregation", ["loss", "token-mean"])
def test_entropy_bonus_follows_trl_token_mean_or_verl_loss_aggregation(aggregation, quantile):
    """TRL: loss - coef * sum(H * effective_mask) / sum(effective_mask) (the top-entropy mask's tokens);
    verl: pg_loss - coef * agg_loss(H, mask, loss_agg_mode). grpo aggregation, fused mode when
    nothing needs a batch statistic."""
    logits, targets, mask, adv, old, _, _ = make_case(71, noise=0.3)
    leaf, logp, _ = oracle_logp_entropy(logits, targets)
    logp_all = torch.log_softmax(leaf, -1)
    entropies = -(logp_all.exp() * logp_all).sum(-1)  # with gradient
    m = mask.double()
    a = adv[:, None]
    coef_1 = torch.exp(logp - old)
    per_token_loss = -torch.min(coef_1 * a, torch.clamp(coef_1, 0.8, 1.2) * a)
    effective = m
    if quantile < 1.0:
        high = trl_high_entropy_mask(entropies.detach(), m, 1 - quantile)
        per_token_loss = per_token_loss * high
        effective = m * high
    loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if aggregation == "token-mean":
        loss = loss - 0.05 * (entropies * effective).sum() / effective.sum().clamp(min=1.0)
    else:
        loss = loss - 0.05 * verl_agg_loss(entropies, m, "seq-mean-token-mean")
    loss.backward()
    policy = Policy(loss_type="grpo", entropy_coef=0.05, entropy_aggregation=aggregation,
                    top_entropy_quantile=quantile)
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    compare(run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy), inputs), loss.detach(),
            leaf.grad, {}, torch.float32)


@needs_kernel
@pytest.mark.parametrize("objective, level, masks, chunked", [
    ("clip", "sequence", {}, True), ("vespo", "token", {}, True), ("gmpo", "token", {}, True),
    ("clip", "token", {"off_policy_mask": 0.05}, True), ("clip", "sequence_token", {}, True),
    ("kl_cov", "token", {}, False), ("clip_cov", "token", {}, False),
    ("clip", "token", {"top_entropy_quantile": 0.5}, False),
])
def test_lm_head_runs_sequence_statistics_chunk_by_chunk_of_whole_sequences(objective, level, masks, chunked):
    """A sequence statistic needs only its sequence: the lm_head cuts chunks of whole sequences and
    computes each chunk's gradient in forward (three GEMMs); clip_cov and kl_cov run their base
    objective fused and correct their few selected rows; so does the entropy quantile, under a
    guessed mask.
    Both give the reference's loss and gradients, also when the loss is scaled before backward."""
    gen = generator(73)
    hidden = torch.randn(B, T, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, 8, generator=gen, dtype=torch.float64) / 2
    _, targets, mask, adv, old, ref, _ = make_case(73)
    policy = Policy(objective=objective, importance_sampling=level, loss_type="grpo", kl_beta=0.05, cov_ratio=0.2,
                    entropy_coef=0.01, **masks)
    spec = LossSpec(cross_entropy={"weight": 0.3}, policy=policy)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    torch.manual_seed(5)  # clip_cov's draw
    out = headloss.linear_head_loss(h, w, targets, spec, chunk_bytes=5 * V * 4,
                                    **{k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    (3.0 * out.loss).backward()
    # chunks of whole sequences (d rows by the objective kernel for a row-local objective); clip_cov /
    # kl_cov: the base objective fused, then one correction of the selected rows; the top-entropy
    # mask: the objective under a guessed mask, then one correction of the rows it got wrong
    row_local = objective not in ("vespo", "gmpo")
    assert out.route == ("lm_head:sequences+kernels" if chunked and row_local else
                         "lm_head:sequences+torch" if chunked else
                         "lm_head:covariance" if objective in ("clip_cov", "kl_cov") else "lm_head:entropy-guess")
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.manual_seed(5)
    ref_out = head_loss(h64 @ w64.T, targets, spec, backend="torch", **inputs)
    (3.0 * ref_out.loss).backward()
    assert_close_norm(out.loss, ref_out.loss, rtol=1e-5, atol=3e-6, name="loss")
    assert_close_norm(h.grad, h64.grad, rtol=1e-4, atol=1e-9, name="hidden grad")
    assert_close_norm(w.grad, w64.grad, rtol=1e-4, atol=1e-9, name="weight grad")
    for name, value in ref_out.metrics.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=name)


ENTROPY_GUESS_OBJECTIVES = [
    ("clip", 0.2, dict(kl_beta=0.05, entropy_coef=0.01)),  # verl's bonus (aggregated like the loss)
    ("cispo", 0.5, dict(loss_type="dapo")),
    ("sapo", 0.8, dict(loss_type="bnpo", kl_beta=0.02, kl_estimator="k1")),
    ("dppo_tv", 0.3, dict(loss_type="dapo")),
]
ENTROPY_GUESS_WEIGHTS = [(False, True), (True, False)]
ENTROPY_GUESS_KINDS = ["estimate", "keep none", "keep all"]
# the fast tier runs one case per objective that still takes every guess and both weight options
ENTROPY_GUESS_CASES = [
    pytest.param(*objective, *weights, guess,
                 marks=() if (i + j + k) % 3 == 0 and j == i % 2 else pytest.mark.slow)
    for i, objective in enumerate(ENTROPY_GUESS_OBJECTIVES)
    for j, weights in enumerate(ENTROPY_GUESS_WEIGHTS)
    for k, guess in enumerate(ENTROPY_GUESS_KINDS)
]


@needs_kernel
@pytest.mark.parametrize("objective, quantile, extra, weights, compact, guess", ENTROPY_GUESS_CASES)
def test_lm_head_top_entropy_mask_runs_fused_and_corrects_the_rows_it_guessed_wrong(objective, quantile, extra,
                                                                                   weights, compact, guess,
                                                                                   monkeypatch):
    """The top-entropy mask on the lm_head: each chunk's objective runs fused under a mask guessed
    from the entropies seen so far; once the batch quantile is known the rows guessed wrong gain or
    lose their objective. Loss, dh, dW and every metric (the mask's too) equal the reference's,
    with rollout weights or without, compact or not, and deferred mode never runs. The guess is
    the running estimate, or forced wrong (every kept row gains its objective in the correction,
    or every dropped row loses it)."""
    import headloss.linear_policy as linear

    if guess != "estimate":  # a guess forced wrong (the correction must then change every such row)
        monkeypatch.setattr(linear, "_guess_threshold",
                            lambda seen, q: torch.tensor(math.inf if guess == "keep none" else -math.inf))
    changed = []  # the rows each correction changes
    original = linear.correct_rows
    monkeypatch.setattr(linear, "correct_rows", lambda run, head, chosen, *a: changed.append(int(chosen.sum()))
                        or original(run, head, chosen, *a))
    gen = generator(101)
    batch, length, width = 6, 9, 8
    hidden = torch.randn(batch, length, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, width, generator=gen, dtype=torch.float64)
    weight = weight * torch.rand(V, 1, generator=gen, dtype=torch.float64) * 2  # entropies spread over rows
    targets = torch.randint(0, V, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.25).long()
    mask[:, 0] = 1
    adv = torch.randn(batch, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None])[..., 0]
    old = logp + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask,
                  ref_logprobs=logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64))
    if weights:
        inputs["importance_weights"] = torch.rand(batch, length, generator=gen, dtype=torch.float64) + 0.5
    policy = Policy(objective=objective, top_entropy_quantile=quantile, **{"loss_type": "grpo", **extra})
    spec = LossSpec(cross_entropy=None, policy=policy)
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    out = headloss.linear_head_loss(h, w, targets, spec, chunk_bytes=7 * V * 4, compact=compact, **fp32)
    (2.0 * out.loss).backward()
    assert out.route == "lm_head:entropy-guess"
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_out = head_loss(h64 @ w64.T, targets, spec, backend="torch", **inputs)
    (2.0 * ref_out.loss).backward()
    assert_close_norm(out.loss, ref_out.loss, rtol=1e-5, atol=3e-6, name="loss")
    assert_close_norm(h.grad, h64.grad, rtol=1e-4, atol=1e-9, name="hidden grad")
    assert_close_norm(w.grad, w64.grad, rtol=1e-4, atol=1e-9, name="weight grad")
    assert set(out.metrics) == set(ref_out.metrics)
    assert "high_entropy/fraction" in out.metrics
    for name, value in ref_out.metrics.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=name)
    assert len(changed) == 1
    counted = int(mask.sum())
    kept = round(float(out.metrics["high_entropy/fraction"]) * counted)
    if guess != "estimate":  # every row the mask keeps, or every one it drops, was guessed wrong
        assert changed[0] == (kept if guess == "keep none" else counted - kept) > 0
    else:  # the running estimate is close: few rows wrong
        assert changed[0] <= counted // 4


LM_HEAD_ROUTES = ("row-local", "sequence", "covariance", "entropy mask", "entropy mask, deferred")


@st.composite
def lm_head_policy_cases(draw, route: str):
    """A policy spec for the lm_head that takes ``route`` (fused; chunks of whole sequences; clip_cov /
    kl_cov and the top-entropy mask as base fused + corrected rows; the top-entropy mask with TRL's
    bonus, deferred), and a batch: [B, T] rows, odd vocabularies, chunks of a few rows."""
    row_local = st.sampled_from(["clip", "cispo", "sapo", "gpg", "dro", "dppo_kl", "reinforce"])
    fields = dict(objective=draw(row_local), entropy_coef=draw(st.sampled_from([0.0, 0.02])),
                  entropy_aggregation="loss")
    if route == "sequence":
        fields.update(draw(st.sampled_from([dict(objective="clip", importance_sampling="sequence"),
                                            dict(objective="sapo", importance_sampling="sequence"),
                                            dict(objective="vespo"), dict(off_policy_mask=0.05)])))
    elif route == "covariance":
        fields["objective"] = draw(st.sampled_from(["kl_cov", "clip_cov"]))
    elif route.startswith("entropy mask"):
        fields["top_entropy_quantile"] = draw(st.sampled_from([0.25, 0.6]))
        if route.endswith("deferred"):
            fields.update(entropy_coef=0.02, entropy_aggregation="token-mean")
    policy = Policy(
        loss_type=draw(st.sampled_from(["grpo", "bnpo", "dapo", "seq-mean-token-sum"])),
        kl_beta=draw(st.sampled_from([0.0, 0.04])), kl_estimator=draw(st.sampled_from(["k1", "k3"])),
        dro_beta=0.1, cov_ratio=0.2, eps_high=0.28, convention=draw(st.sampled_from(["trl", "verl"])), **fields)
    spec = LossSpec(cross_entropy=draw(st.sampled_from([None, {"weight": 0.1}])), policy=policy,
                    transform=draw(st.sampled_from([{}, {"temperature": 0.7}])))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 6)))
    return spec, shape, draw(st.integers(3, 29)), draw(st.integers(1, 5)), draw(st.booleans()), \
        draw(st.booleans()), draw(st.integers(0, 10_000))


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("route", LM_HEAD_ROUTES)
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lm_head_matches_the_reference_for_random_policy_specs(route, data):
    """Hypothesis over policy specs and shapes on the fused lm_head, for each of its routes (the
    top-entropy mask's guess and correction among them; the test checks the route was taken): loss,
    dh, dW, db and every metric against the fp64 reference on the materialised logits."""
    spec, (batch, length), vocab, chunk, weights, compact, seed = data.draw(lm_head_policy_cases(route))
    gen = generator(seed)
    hidden = torch.randn(batch, length, 6, generator=gen, dtype=torch.float64)
    # logits within ~+-8: fp32 resolves 1 - p (a saturated softmax's gradient is below fp32's reach)
    scale = 0.2 + 0.3 * torch.rand(vocab, 1, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, 6, generator=gen, dtype=torch.float64) * scale
    bias = 0.1 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.25).long()
    logp = torch.log_softmax(hidden @ weight.T + bias, -1).gather(-1, targets[..., None])[..., 0]
    inputs = dict(advantages=torch.randn(batch, generator=gen, dtype=torch.float64), loss_mask=mask,
                  old_logprobs=logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64),
                  ref_logprobs=logp + 0.2 * torch.randn(batch, length, generator=gen, dtype=torch.float64))
    if weights:
        inputs["importance_weights"] = 0.5 + torch.rand(batch, length, generator=gen, dtype=torch.float64)
    leaves = [t.float().requires_grad_() for t in (hidden, weight, bias)]
    torch.manual_seed(seed)  # clip_cov's draw
    out = headloss.linear_head_loss(*leaves[:2], targets, spec, bias=leaves[2], chunk_bytes=chunk * vocab * 4,
                                    compact=compact,
                                    **{k: v.float() if v.is_floating_point() else v for k, v in inputs.items()})
    (1.5 * out.loss).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    torch.manual_seed(seed)
    ref = head_loss(ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2], targets, spec, backend="torch", **inputs)
    (1.5 * ref.loss).backward()
    routes = {"row-local": {"lm_head:fused"},
              # (a sequence too long for the chunk budget runs deferred)
              "sequence": {"lm_head:sequences+kernels", "lm_head:sequences+torch", "lm_head:deferred+kernels",
                           "lm_head:deferred+torch"},
              "covariance": {"lm_head:covariance"}, "entropy mask": {"lm_head:entropy-guess"},
              "entropy mask, deferred": {"lm_head:deferred+torch"}}
    assert out.route in routes[route], (route, out.route)
    assert_close_norm(out.loss, ref.loss, rtol=1e-5, atol=3e-6, name="loss")
    for name, got, want in zip(("dh", "dW", "db"), leaves, ref_leaves):
        assert_close_norm(got.grad, want.grad, rtol=1e-4, atol=1e-7, name=name)
    assert set(out.metrics) == set(ref.metrics)
    for name, value in ref.metrics.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=name)


@needs_kernel
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"),  # fp16: the same path, the slow tier
                                   pytest.param(torch.float16, id="fp16", marks=pytest.mark.slow)])
def test_lm_head_top_entropy_guessed_route_equals_deferred_mode_in_half_precision(dtype):
    """Half-precision hidden states and head: the guessed-mask route (fused, then corrected) gives
    deferred mode's loss, metrics and gradients on the same inputs (the same chunked logits, so the
    same entropies and mask); the correction's dW update accumulates in the weight's dtype."""
    gen = generator(113)
    batch, length, width = 4, 11, 16
    hidden = torch.randn(batch, length, width, generator=gen).to(dtype)
    weight = (torch.randn(V, width, generator=gen) * 0.7).to(dtype)
    targets = torch.randint(0, V, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.2).long()
    inputs = dict(advantages=torch.randn(batch, generator=gen), loss_mask=mask,
                  old_logprobs=-3.6 + 0.3 * torch.randn(batch, length, generator=gen),
                  ref_logprobs=-3.6 + 0.3 * torch.randn(batch, length, generator=gen))
    spec = LossSpec(cross_entropy=None, policy=Policy(top_entropy_quantile=0.3, kl_beta=0.04, eps_high=0.28))

    def run(route):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = headloss.linear_head_loss(h, w, targets, spec, chunk_bytes=9 * V * 2, route=route, **inputs)
        out.loss.backward()
        assert out.route == route
        return out, h.grad.float(), w.grad.float()

    guessed = run("lm_head:entropy-guess")
    deferred = run("lm_head:deferred+torch")
    assert_close_norm(guessed[0].loss, deferred[0].loss, rtol=1e-5, atol=1e-6, name="loss")
    for name, value in deferred[0].metrics.items():
        assert_close_norm(guessed[0].metrics[name], value, rtol=1e-5, atol=1e-6, name=name)
    assert_close_norm(guessed[1], deferred[1], rtol=2e-2, atol=1e-6, name="hidden grad")
    assert_close_norm(guessed[2], deferred[2], rtol=2e-2, atol=1e-6, name="weight grad")


@pytest.mark.parametrize("n, kept, q", [(50, 0.6, 0.8), (7, 1.0, 0.5), (9, 0.3, 0.0), (5, 0.5, 1.0), (1, 1.0, 0.3)])
def test_masked_quantile_equals_torch_quantile_without_a_host_read(n, kept, q):
    from headloss.policy.masks import masked_quantile

    gen = generator(n)
    values = torch.randn(n, generator=gen).round(decimals=1)  # ties included
    keep = torch.rand(n, generator=gen) < kept
    keep[0] = True
    torch.testing.assert_close(masked_quantile(values, keep, q), torch.quantile(values[keep], q), rtol=0, atol=0)
    assert masked_quantile(values, torch.zeros_like(keep), q) == math.inf


# --- found in review ------------------------------------------------------------------------------


@needs_kernel
def test_vespo_takes_a_sequence_level_rollout_weight_once():
    """rollout_is='sequence' puts the sequence's weight on each token; VESPO's w multiplies it in once,
    so without truncation the token and sequence modes give the same w (a product of the same ratios)."""
    logits, targets, mask, adv, old, _, _ = make_case(79)
    rollout = old + 0.05 * torch.randn(B, T, generator=generator(8), dtype=torch.float64)
    inputs = dict(advantages=adv, old_logprobs=old, rollout_logprobs=rollout, loss_mask=mask)
    got = {level: run_both(logits, targets, LossSpec(cross_entropy=None, policy=Policy(
        objective="vespo", rollout_is=level, rollout_is_max=None, rollout_is_min=0.0)), inputs)
        for level in ("token", "sequence")}
    for backend in ("triton", "torch"):
        (tok_out, tok_grad), (seq_out, seq_grad) = got["token"][backend], got["sequence"][backend]
        assert_close_norm(seq_out.loss, tok_out.loss, rtol=1e-5, atol=1e-7, name=f"{backend} loss")
        assert_close_norm(seq_grad, tok_grad, rtol=1e-5, atol=1e-9, name=f"{backend} grad")


@needs_kernel
def test_verl_gmpo_averages_over_every_sequence_even_with_the_verl_convention():
    """geo_mean's torch.mean counts a fully masked response (its loss is 0), unlike agg_loss."""
    logits, targets, mask, adv, old, _, _ = make_case(83)
    mask[2] = 0
    leaf, log_prob = oracle_logp(logits, targets)
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics = verl_sequence_loss("geo_mean", old, log_prob, adv[:, None].expand(B, T), mask.double(), cfg)
    loss.backward()
    policy = Policy(objective="gmpo", convention="verl", loss_type="seq-mean-token-mean", eps_low=0.2, eps_high=0.28)
    compare(run_both(logits, targets, LossSpec(cross_entropy=None, policy=policy),
                     dict(advantages=adv, old_logprobs=old, loss_mask=mask)), loss.detach(), leaf.grad, {},
            torch.float32)


@needs_kernel
def test_vespo_phi_metric_counts_a_fully_masked_sequence_as_trl_does():
    logits, targets, mask, adv, old, _, _ = make_case(89, noise=0.05)
    mask[1] = 0
    _, logp = oracle_logp(logits, targets)
    phi = trl_vespo_gamma_weights(adv[:, None], logp - old, mask.double(), None)
    got = run_both(logits, targets, LossSpec(cross_entropy=None, policy=Policy(objective="vespo")),
                   dict(advantages=adv, old_logprobs=old, loss_mask=mask))
    for out, _ in got.values():
        assert_close_norm(out.metrics["vespo/phi_seq_mean"], phi.mean(), rtol=1e-5, atol=1e-6, name="phi mean")


@needs_kernel
@pytest.mark.parametrize("convention", ["trl", "verl"])
def test_lm_head_sum_norm_divides_by_the_completion_length_with_completion_ids(convention):
    """shift=True with TRL's completion ids [B, T - 1]: the rows are padded to [B, T], the
    normaliser of seq-mean-token-sum-norm stays the completion length, as on the logits path."""
    gen = generator(97)
    hidden = torch.randn(B, T + 1, 8, generator=gen)
    weight = torch.randn(V, 8, generator=gen) / 2
    _, targets, mask, adv, old, _, _ = make_case(97)
    spec = LossSpec(cross_entropy=None, policy=Policy(loss_type="seq-mean-token-sum-norm", convention=convention))
    inputs = dict(advantages=adv.float(), old_logprobs=old.float(), loss_mask=mask)
    out = headloss.linear_head_loss(hidden, weight, targets, spec, shift=True, **inputs)
    want = head_loss(hidden @ weight.T, targets, spec, shift=True, backend="torch", **inputs)
    assert_close_norm(out.loss, want.loss, rtol=1e-5, atol=1e-7, name="loss")


# --- conventions at their edges -----------------------------------------------------------------
# Each oracle below is the upstream lines, quoted; both paths and every route that can run the call
# (the sequence kernels, the torch ops, the fused epilogue) are held to them.


def trl_clip_metrics(per_token_logps, old_per_token_logps, advantages, mask, cfg):
    """GRPOTrainer._compute_loss (TRL 1.16.0) for the grpo/bnpo/dr_grpo/dapo/luspo branch: its
    coef_1, the delta reassignment and the clip metrics, one process.

        if advantages.dim() == 1: advantages = advantages.unsqueeze(1)
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)   # "sequence"
        log_importance_weights = log_importance_weights.unsqueeze(-1)
        coef_1 = torch.exp(log_importance_weights)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)
        ...
        def masked_seq_mean(x):
            if x.shape[1] == 1:  # when importance_sampling_level == "sequence": already one value per sequence
                return x.squeeze(1)
            return (x * mask).sum(-1) / mask.sum(-1)
        is_low_clipped = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
        is_high_clipped = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        ... global_masked_mean(is_low_clipped.float()) ...
        gathered_low_clip = self.accelerator.gather(masked_seq_mean(is_low_clipped.float()))
        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(gathered_low_clip).item())
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    coef_1 = trl_coef_1(per_token_logps, old_per_token_logps, mask, cfg["importance_sampling_level"])
    if cfg["delta"] is not None:
        coef_1 = torch.clamp(coef_1, max=cfg["delta"])

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    is_low_clipped = (coef_1 < 1 - cfg["epsilon_low"]) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + cfg["epsilon_high"]) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    low_seq, high_seq = masked_seq_mean(is_low_clipped.double()), masked_seq_mean(is_high_clipped.double())
    return {
        "clip_ratio/low_mean": global_masked_mean(is_low_clipped.double(), mask),
        "clip_ratio/high_mean": global_masked_mean(is_high_clipped.double(), mask),
        "clip_ratio/region_mean": global_masked_mean(is_region_clipped.double(), mask),
        "clip_ratio/low_min": low_seq[~low_seq.isnan()].min(),  # trl.trainer.utils.nanmin
        "clip_ratio/high_max": high_seq[~high_seq.isnan()].max(),  # nanmax
    }


TRL_EDGES = {  # case -> (importance_sampling, per-token advantages, a fully masked sequence, delta)
    "sequence-token_advantages": ("sequence", True, False, None),
    "sequence-empty_sequence": ("sequence", False, True, None),
    "sequence-token_advantages-empty_sequence": ("sequence", True, True, None),
    "token-delta_below_the_clip": ("token", False, False, 1.1),
    "token-empty_sequence": ("token", False, True, None),
}


def policy_routes(logits, targets, spec, inputs, backend="triton") -> list[str]:
    """Every route that can run the call (the default first)."""
    from headloss.plan import compile_plan
    from headloss.routes import facts_of, routes_for

    plan = compile_plan(spec, has_targets=True)
    facts = facts_of("logits", backend, logits.device, tuple(targets.shape), inputs, sharded=False)
    return [route.name for route in routes_for(plan, facts)]


@needs_kernel
@pytest.mark.parametrize("case", list(TRL_EDGES))
def test_trl_clip_metrics_follow_compute_loss_at_its_edges(case):
    """Sequence-level ratios with [B, T] advantages (TRL's indicators are [B, T]: token means), a fully
    masked sequence at sequence level (masked_seq_mean gives it 0, so clip_ratio/low_min is 0), and
    ``delta`` below 1 + epsilon_high (the high indicator reads the capped ratio: never clipped)."""
    level, per_token_adv, empty, delta = TRL_EDGES[case]
    logits, targets, mask, adv, old, _, _ = make_case(61, per_token_adv=per_token_adv)
    _, logp = oracle_logp(logits, targets)
    logp = logp.detach()
    if empty:
        mask[1] = 0
    if case == "sequence-empty_sequence":  # every counted sequence low-clipped: A < 0, ratio e^-0.5
        adv = -adv.abs() - 0.1
        old = logp + 0.5
    if delta is not None:  # ratios e^0.5 on A > 0: clipped high by the ratio, not by its cap at delta
        adv = adv.abs() + 0.1
        old = torch.where(torch.arange(T) % 2 == 0, logp - 0.5, old)
    cfg = dict(importance_sampling_level=level, epsilon_low=0.2, epsilon_high=0.28, delta=delta)
    want = trl_clip_metrics(logp, old, adv, mask.double(), cfg)
    if case == "sequence-empty_sequence":
        assert float(want["clip_ratio/low_min"]) == 0.0 and float(want["clip_ratio/low_mean"]) > 0.5
    if delta is not None:
        assert float(want["clip_ratio/high_mean"]) == 0.0 and bool(((old - logp) < -0.3).any())
    spec = LossSpec(cross_entropy=None, policy=Policy(importance_sampling=level, eps_low=0.2, eps_high=0.28,
                                                      delta=delta, loss_type="grpo"))
    inputs = dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    for backend in ("triton", "torch"):
        for route in policy_routes(logits, targets, spec, inputs, backend):
            out = head_loss(logits, targets, spec, backend=backend, route=route, **floats(inputs))
            for name, value in want.items():
                assert_close_norm(out.metrics[name], value, rtol=1e-6, atol=1e-6, name=f"{route} {name}")
    hidden, weight = torch.randn(B, T, 8, generator=generator(3)), torch.randn(V, 8, generator=generator(4))
    lm_want = trl_clip_metrics(torch.log_softmax((hidden @ weight.T).double(), -1).gather(
        -1, targets[..., None])[..., 0], old, adv, mask.double(), cfg)
    out = headloss.linear_head_loss(hidden, weight, targets, spec, **floats(inputs))
    for name, value in lm_want.items():
        assert_close_norm(out.metrics[name], value, rtol=1e-5, atol=1e-6, name=f"{out.route} {name}")


@needs_kernel
def test_verl_gspo_ppo_kl_reads_the_unclamped_log_ratio():
    """compute_policy_loss_gspo clamps nothing at +-20 (``negative_approx_kl = log_prob - old_log_prob``;
    ``ppo_kl = verl_F.masked_mean(-negative_approx_kl, response_mask)``), unlike its token-level
    losses (``negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)``)."""
    logits, targets, mask, adv, old, _, _ = make_case(67)
    leaf, log_prob = oracle_logp(logits, targets)
    old = old.clone()
    old[0, 0], old[1, 0] = log_prob[0, 0].detach() + 25.0, log_prob[1, 0].detach() - 30.0
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    loss, metrics = verl_sequence_loss("gspo", old, log_prob, adv[:, None].expand(B, T), mask.double(), cfg)
    loss.backward()
    assert abs(float(metrics["ppo_kl"].detach())) > 0.2  # the clamp would move it by 15 / 16 tokens
    policy = Policy(importance_sampling="sequence_token", convention="verl", loss_type="seq-mean-token-mean",
                    eps_low=0.2, eps_high=0.28)
    spec, inputs = LossSpec(cross_entropy=None, policy=policy), dict(advantages=adv, old_logprobs=old, loss_mask=mask)
    for route in policy_routes(logits, targets, spec, inputs):
        got = {}
        for backend in ("triton", "torch"):
            leaf_b = logits.detach().clone().requires_grad_()
            out = head_loss(leaf_b, targets, spec, backend=backend, route=route if backend == "triton" else None,
                            **floats(inputs))
            out.loss.backward()
            got[f"{backend} {out.route}"] = (out, leaf_b.grad)
        compare(got, loss.detach(), leaf.grad, {"ppo_kl": metrics["ppo_kl"]}, torch.float32)


VERL_AUX = {  # case -> (verl loss mode, loss_agg_mode): gspo and sapo force seq-mean-token-mean, geo_mean its mean
    "gspo-token-mean": ("gspo", "token-mean"),
    "sapo-token-mean": ("sapo", "token-mean"),
    "sapo-seq-mean-token-sum": ("sapo", "seq-mean-token-sum"),
    "geo_mean-token-mean": ("geo_mean", "token-mean"),
    "geo_mean-seq-mean-token-mean": ("geo_mean", "seq-mean-token-mean"),
}


@needs_kernel
@pytest.mark.parametrize("case", list(VERL_AUX))
def test_verl_kl_and_entropy_losses_aggregate_by_loss_agg_mode(case):
    """verl/workers/utils/losses.py ppo_loss, after the policy loss (whose gspo / sapo force
    ``loss_agg_mode="seq-mean-token-mean"`` and geo_mean takes ``torch.mean(pg_losses)``):

        entropy_loss = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, ...)
        policy_loss -= entropy_coeff * entropy_loss
        kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, ...)
        policy_loss += kl_loss * config.kl_loss_coef

    with a fully masked response (agg_loss's seq-mean modes leave it out; geo_mean's mean counts it)."""
    mode, agg = VERL_AUX[case]
    logits, targets, mask, adv, old, ref, _ = make_case(71, noise=0.4)
    mask[2] = 0
    leaf = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(leaf, -1)
    log_prob = logp_all.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    advs, m = adv[:, None].expand(B, T), mask.double()
    cfg = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=agg, tau_pos=1.0, tau_neg=1.05)
    if mode == "sapo":
        pg_loss, _ = verl_policy_loss("sapo", old, log_prob, advs, m, cfg)
    else:
        pg_loss, _ = verl_sequence_loss(mode, old, log_prob, advs, m, cfg)
    policy_loss = pg_loss - 0.03 * verl_agg_loss(entropy, m, agg)
    policy_loss = policy_loss + verl_agg_loss(verl_kl_penalty(log_prob, ref, "low_var_kl"), m, agg) * 0.1
    policy_loss.backward()
    own = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": agg}[mode]
    if mode == "geo_mean" and agg == "token-mean":
        own = "seq-mean-token-mean"
    policy = Policy(objective={"geo_mean": "gmpo", "gspo": "clip"}.get(mode, mode), convention="verl",
                    importance_sampling="sequence_token" if mode == "gspo" else "token", loss_type=own,
                    kl_entropy_loss_type=None if own == agg else agg, eps_low=0.2, eps_high=0.28,
                    kl_beta=0.1, kl_estimator="k3", kl_clamp=True, entropy_coef=0.03)
    assert policy.separate_kl_entropy
    spec = LossSpec(cross_entropy=None, policy=policy)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask)
    got = run_both(logits, targets, spec, inputs)
    compare(got, policy_loss.detach(), leaf.grad, {}, torch.float32)
    hidden = torch.randn(B, T, 8, generator=generator(5), dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, 8, generator=generator(6), dtype=torch.float64) / 2
    want = head_loss(hidden @ weight.T, targets, spec, backend="torch", **inputs)
    want.loss.backward()
    lm_hidden = hidden.detach().float().requires_grad_()
    out = headloss.linear_head_loss(lm_hidden, weight.float(), targets, spec, **floats(inputs))
    out.loss.backward()
    assert_close_norm(out.loss, want.loss, rtol=1e-5, atol=1e-6, name=f"{out.route} loss")
    assert_close_norm(lm_hidden.grad.double(), hidden.grad, rtol=1e-4, atol=1e-8, name=f"{out.route} grad")


@needs_kernel
def test_verl_kl_and_entropy_aggregation_takes_the_global_counts_of_its_own_loss_type():
    """verl passes one global_batch_info to every agg_loss: token-mean divides by batch_num_tokens,
    seq-mean-token-mean by global_batch_size (each times dp_size); the KL's aggregation takes the
    count of its own loss type."""
    logits, targets, mask, adv, old, ref, _ = make_case(73, noise=0.4)
    leaf, log_prob = oracle_logp(logits, targets)
    m, advs = mask.double(), adv[:, None].expand(B, T)
    pg = verl_agg_loss_global(-log_prob * advs, m, "seq-mean-token-mean", dp_size=2, global_batch_size=5)  # gpg
    kl = verl_agg_loss_global(verl_kl_penalty(log_prob, ref, "low_var_kl"), m, "token-mean", dp_size=2,
                              global_batch_size=5, batch_num_tokens=23)
    (pg + 0.1 * kl).backward()
    policy = Policy(objective="gpg", convention="verl", loss_type="seq-mean-token-mean", kl_entropy_loss_type="dapo",
                    num_processes=2, kl_beta=0.1, kl_estimator="k3", kl_clamp=True)
    spec = LossSpec(cross_entropy=None, policy=policy)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, num_sequences_in_batch=5)
    got = {}
    for backend in ("triton", "torch"):
        leaf_b = logits.detach().clone().requires_grad_()
        out = head_loss(leaf_b, targets, spec, backend=backend, num_items_in_batch=23, **floats(inputs))
        out.loss.backward()
        got[backend] = (out, leaf_b.grad)
    compare(got, (pg + 0.1 * kl).detach(), leaf.grad, {}, torch.float32)
