"""verl: headloss as verl's fused head and as its policy losses (docs/verl.md).

* :func:`linear_cross_entropy` -- verl's fused-head contract (``verl.utils.kernel.
  linear_cross_entropy``): hidden states, the lm_head weight, the rolled labels, a temperature,
  ``reduction="none"`` and an optional tensor-parallel group -> fp32 per-token log-probs and
  entropy with gradient. Vocab-parallel with one collective per chunk (verl's kernel makes three
  all-reduces); dh stays each rank's share, as verl's (the caller's layer reduces it). Given the
  packed boundaries (``cu_seqlens`` or ``position_ids``), a sequence's last row is not scored
  against the next sequence's first token: its log-prob and entropy are 0.
* :func:`install` -- points verl at it: its FSDP fused forward (``use_fused_kernels=True`` with
  ``fused_kernel_options.impl_backend=triton``) and Megatron's ``output_processor`` hook call
  :func:`linear_cross_entropy` with the packed position ids, and verl's loss modes run through
  headloss. ``external_lib=headloss.integrations.verl_plugin`` (or ``VERL_USE_EXTERNAL_MODULES``)
  calls it in every worker; the ``verl.plugins`` entry point registers the ``headloss_<mode>``
  losses only.
* :func:`policy_loss_fn` -- a verl policy loss (``register_policy_loss``'s signature) for each of
  verl's loss modes, from verl's config keys, returning verl's metric names as device scalars
  (verl's own losses call ``.item()`` on each; verl's ``Metric`` container reads them when it
  stores them).
* :func:`forward_kl_topk` -- verl's distillation from the teacher's top-k
  (``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``, its logits processor's step)
  without the [B, T, V] log-softmax: the per-token KL, student and teacher mass from one head pass;
  :func:`install` puts it in verl's place. :func:`distillation_loss_fn` runs verl's single-sample
  estimator losses (``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``, and ``+`` forms)
  with headloss's estimators, registered as ``headloss_<name>`` (docs/distillation.md).
* :func:`policy_for` / :func:`policy_spec` -- verl's actor config as a headloss ``Policy`` (the
  policy loss alone) or a ``LossSpec`` with verl's ``ppo_loss`` around it (entropy bonus, KL loss),
  for an engine that calls :func:`headloss.linear_head_loss` on the hidden states: the policy loss
  inside the head pass, gradient in forward, three GEMMs.

verl's engines do not let a plugin reach the whole loss from the hidden states: the FSDP engine's
``forward_step`` (``verl/workers/engine/fsdp/transformer_impl.py``) calls the model with
``input_ids``, ``position_ids``, ``temperature`` and ``shift_labels`` only and hands the loss
function the log-probs; Megatron's ``output_processor_context`` (``FusedOutputProcessorContext``)
holds the temperature only. The fused policy loss needs the micro-batch's ``old_log_probs``,
``advantages`` and ``response_mask`` at the head, a hook neither engine has.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..api import linear_head_loss
from ..bounded import memoize
from ..chunks import DEFAULT_CHUNK_BYTES
from ..packed import packed_rows, packed_targets
from ..policy.logprobs import policy_loss
from ..spec import VERL_ESTIMATORS, Entropy, LogitTransform, LossSpec, Policy
from .verl_distill import (
    DISTILLATION_ESTIMATORS,
    distillation_loss_fn,
    forward_kl_topk,
    install_distillation,
)
from .verl_distill import (
    config_value as _get,
)

__all__ = ["DISTILLATION_ESTIMATORS", "KL_LOSS_TYPES", "LOSS_MODES", "distillation_loss_fn", "forward_kl_topk",
           "install", "linear_cross_entropy", "policy_counts", "policy_for", "policy_loss_fn", "policy_spec"]

_PG = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
LOSS_MODES: dict[str, tuple[str, ...]] = {  # verl loss_mode -> the metrics its compute_policy_loss_* returns
    "vanilla": _PG, "dppo_tv": _PG, "dppo_kl": _PG, "gspo": _PG, "sapo": _PG, "gpg": (),
    "clip_cov": ("pg_clipfrac", "ppo_kl"), "kl_cov": ("ppo_kl",), "geo_mean": _PG, "dro": ("ppo_kl",),
    "cispo": _PG,
}
"""verl's loss modes that headloss runs (verl 0.9: ``verl/trainer/ppo/core_algos.py``); bypass_mode
stays verl's (its rollout-correction metrics and rejection sampling are verl's own)."""

KL_LOSS_TYPES: dict[str, tuple[str, bool]] = VERL_ESTIMATORS  # verl kl_loss_type -> (kl_estimator, kl_clamp)

_IGNORE = -100


def _clip_ratios(config: Any) -> tuple[float, float]:
    base = _get(config, "clip_ratio", 0.2)
    low, high = _get(config, "clip_ratio_low"), _get(config, "clip_ratio_high")
    return float(base if low is None else low), float(base if high is None else high)


def policy_for(config: Any, loss_mode: str | None = None, loss_agg_mode: str | None = None) -> Policy:
    """verl's policy loss ``loss_mode`` (default: ``config.policy_loss.loss_mode``) under the actor
    ``config`` (an ActorConfig, a DictConfig of ``actor_rollout_ref.actor`` or a dict) as a
    ``Policy``: its clip ratios, ``clip_ratio_c``, ``tau_pos`` / ``tau_neg``, the ``policy_loss``
    keys of clip_cov, kl_cov and dro, and ``loss_agg_mode`` with the config's ``global_batch_info``
    (``dp_size``). Errors name the config key."""
    pl = _get(config, "policy_loss")
    mode = loss_mode if loss_mode is not None else _get(pl, "loss_mode", "vanilla")
    if mode not in LOSS_MODES:
        raise ValueError(f"policy_loss.loss_mode: headloss runs {sorted(LOSS_MODES)}, got {mode!r}")
    agg = loss_agg_mode if loss_agg_mode is not None else _get(config, "loss_agg_mode", "token-mean")
    if agg not in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        raise ValueError(f"loss_agg_mode: expected one of verl's agg_loss modes, got {agg!r}")
    low, high = _clip_ratios(config)
    fields: dict[str, Any] = dict(convention="verl", eps_low=low, eps_high=high)
    info = _get(config, "global_batch_info") or {}
    dp_size = int(_get(info, "dp_size", 1) or 1)
    if mode == "sapo":
        agg = "seq-mean-token-mean"  # compute_policy_loss_sapo aggregates so whatever loss_agg_mode says
    if mode == "geo_mean":
        fields.update(objective="gmpo", loss_type="seq-mean-token-mean")  # torch.mean over the call's sequences
        return Policy(**fields)
    fields["loss_type"] = "dapo" if agg in ("token-mean", "token-sum") else agg
    fields["num_processes"] = dp_size
    if mode == "vanilla":
        fields.update(objective="clip", dual_clip_c=float(_get(config, "clip_ratio_c", 3.0)))
    elif mode in ("dppo_tv", "dppo_kl"):
        fields.update(objective=mode, dppo_ratio_cap=float(_get(config, "clip_ratio_c", 20.0)))
    elif mode == "gspo":
        fields.update(objective="clip", importance_sampling="sequence_token")
    elif mode == "sapo":
        fields.update(objective="sapo", sapo_tau_pos=float(_get(config, "tau_pos", 1.0)),
                      sapo_tau_neg=float(_get(config, "tau_neg", 1.05)))
    elif mode == "clip_cov":
        fields.update(objective="clip_cov", cov_ratio=float(_get(pl, "clip_cov_ratio", 0.0002) or 0.0002),
                      clip_cov_lb=float(_get(pl, "clip_cov_lb", 1.0)), clip_cov_ub=float(_get(pl, "clip_cov_ub", 5.0)))
    elif mode == "kl_cov":
        fields.update(objective="kl_cov", cov_ratio=float(_get(pl, "kl_cov_ratio", 0.0002) or 0.0002),
                      kl_cov_coef=float(_get(pl, "ppo_kl_coef", 1.0)))
    elif mode == "dro":
        beta = _get(pl, "dro_beta")
        if beta is None:
            raise ValueError("policy_loss.dro_beta: required by loss_mode 'dro'")
        fields.update(objective="dro", dro_beta=float(beta))
    else:
        fields["objective"] = mode  # gpg, cispo
    return Policy(**fields)


def policy_counts(config: Any, policy: Policy, loss_agg_mode: str | None = None) -> dict[str, Any]:
    """The call's counts from verl's ``global_batch_info`` (dp_size, batch_num_tokens,
    global_batch_size, loss_scale_factor) as agg_loss reads them, for the aggregations ``policy``
    runs (its loss type, and the KL's and entropy's apart): ``num_items_in_batch``,
    ``num_sequences_in_batch`` and ``norm_length``."""
    info = _get(config, "global_batch_info") or {}
    dp_size = int(_get(info, "dp_size", 1) or 1)
    agg = loss_agg_mode if loss_agg_mode is not None else _get(config, "loss_agg_mode", "token-mean")
    kinds = set() if policy.objective == "gmpo" else {policy.loss_type}  # geo_mean: a mean over the call's
    if policy.separate_kl_entropy:
        kinds.add(policy.kl_entropy_loss_type or policy.loss_type)
    counts: dict[str, Any] = {}
    if "dapo" in kinds:
        if agg == "token-sum":  # the masked sum x dp_size: dapo's sum x num_processes / num_items_in_batch
            counts["num_items_in_batch"] = 1.0
        else:
            tokens = _get(info, "batch_num_tokens")
            if tokens is None and dp_size > 1:
                raise ValueError("global_batch_info.batch_num_tokens: required by token-mean when dp_size > 1")
            if tokens is not None:
                counts["num_items_in_batch"] = tokens
    if any(kind.startswith("seq-mean") for kind in kinds):
        sequences = _get(info, "global_batch_size")
        if sequences is None and dp_size > 1:
            raise ValueError("global_batch_info.global_batch_size: required by the seq-mean modes when dp_size > 1")
        if sequences is not None and policy.objective == "gmpo":
            raise ValueError("global_batch_info.global_batch_size: geo_mean's loss is a mean over the micro-batch's "
                             "sequences; its KL and entropy over the global batch are not supported")
        if sequences is not None:
            counts["num_sequences_in_batch"] = sequences
        factor = _get(info, "loss_scale_factor", _get(config, "loss_scale_factor"))
        if factor is not None and "seq-mean-token-sum-norm" in kinds:
            counts["norm_length"] = int(factor)
    return counts


def policy_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """verl's policy loss ``loss_mode`` run by headloss, with register_policy_loss's signature:
    ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights) -> (loss, metrics)``; the metrics are verl's names (``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, those the mode returns) as device scalars."""
    if loss_mode not in LOSS_MODES:
        raise ValueError(f"loss_mode: headloss runs {sorted(LOSS_MODES)}, got {loss_mode!r}")
    names = LOSS_MODES[loss_mode]

    def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: torch.Tensor | None = None):
        if config is None:
            raise ValueError("config: verl's actor config is required (its clip ratios and global_batch_info)")
        policy = policy_for(config, loss_mode, loss_agg_mode)
        out = policy_loss(log_prob, policy, advantages=advantages, old_logprobs=old_log_prob,
                          loss_mask=response_mask, importance_weights=rollout_is_weights,
                          **policy_counts(config, policy, loss_agg_mode))
        return out.loss, {f"actor/{name}": out.metrics[name] for name in names}

    compute_policy_loss.__name__ = compute_policy_loss.__qualname__ = f"headloss_{loss_mode}"
    compute_policy_loss.__doc__ = f"verl's {loss_mode!r} policy loss, computed by headloss."
    return compute_policy_loss


def policy_spec(config: Any, temperature: float = 1.0) -> LossSpec:
    """The LossSpec of verl's ``ppo_loss`` (verl/workers/utils/losses.py) under the actor ``config``:
    the policy loss (:func:`policy_for`), minus ``entropy_coeff`` x the entropy aggregated by
    ``loss_agg_mode``, plus ``kl_loss_coef`` x the ``kl_loss_type`` KL when ``use_kl_loss``; the
    entropy logged. For :func:`headloss.linear_head_loss` on the hidden states (with
    :func:`policy_counts`' counts)."""
    policy = policy_for(config)
    agg = _get(config, "loss_agg_mode", "token-mean")
    if agg == "seq-mean-token-sum-norm":
        raise ValueError("loss_agg_mode: seq-mean-token-sum-norm divides by verl's padded response length, which a "
                         "head pass over packed rows does not see; policy_loss_fn runs it")
    update: dict[str, Any] = {"entropy_aggregation": "loss"}
    kind = "dapo" if agg in ("token-mean", "token-sum") else agg
    coef = float(_get(config, "entropy_coeff", 0.0) or 0.0)
    if coef:
        update["entropy_coef"] = coef
    if _get(config, "use_kl_loss", False):
        name = _get(config, "kl_loss_type", "low_var_kl")
        grad = "k2" if name.endswith("+") and name not in ("mse", "k2") else "estimator"
        base = name[:-1] if name.endswith("+") else name
        if base not in KL_LOSS_TYPES:
            raise ValueError(f"kl_loss_type: headloss runs {sorted(KL_LOSS_TYPES)} (and their '+' forms), "
                             f"got {name!r}")
        estimator, clamp = KL_LOSS_TYPES[base]
        update.update(kl_beta=float(_get(config, "kl_loss_coef", 0.001)), kl_estimator=estimator, kl_clamp=clamp,
                      kl_grad=grad)
    if kind != policy.loss_type or policy.objective == "gmpo":
        update["kl_entropy_loss_type"] = kind
    return LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0), policy=policy.model_copy(update=update),
                    transform=LogitTransform(temperature=float(temperature)))


# --- the fused head -------------------------------------------------------------------------

_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("headloss_verl_positions",
                                                                                 default=None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none", dist_process_group: Any = None, *,
                         cu_seqlens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy``: (log p(labels), entropy) of ``hidden @ weight.T /
    temperature``, fp32, shaped like ``labels`` (``reduction="sum"`` / ``"mean"`` reduce the
    log-probs, as verl's kernel does), with gradient to ``hidden`` and ``weight``.

    ``dist_process_group``: ``weight`` is this rank's rows of the vocabulary; the outputs are the
    whole vocabulary's, ``weight``'s gradient this rank's rows and ``hidden``'s this rank's share
    (verl's contract: the caller reduces it). ``cu_seqlens`` / ``position_ids`` (packed rows): the
    last row of each sequence gets log-prob and entropy 0 and no gradient; inside verl's forward
    the position ids come from the model call (:func:`install`)."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a positive number, got {temperature!r}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        raise ValueError("labels: expected an integer tensor of token ids")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden[..., 0].numel() != labels.numel():
        raise ValueError(f"labels: expected one per row of hidden {tuple(getattr(hidden, 'shape', ()))}, got shape "
                         f"{tuple(labels.shape)}")
    if position_ids is None and cu_seqlens is None:
        position_ids = _POSITIONS.get()
    targets = labels.reshape(-1).long()
    if cu_seqlens is not None or position_ids is not None:
        packed = packed_rows(targets.numel(), targets.device, cu_seqlens, position_ids)
        if cu_seqlens is None and targets.numel():  # position ids: the local rows' last one stays scored (under
            # sequence parallelism the next row is another rank's, and the labels were rolled over the whole stream)
            packed = packed._replace(last=torch.cat([packed.last[:-1], packed.last.new_zeros(1)]))
        targets = packed_targets(targets, packed, False, _IGNORE, "async")
    spec = _head_spec(float(temperature))
    out = linear_head_loss(hidden.reshape(-1, hidden.shape[-1]), weight, targets, spec, group=dist_process_group,
                           hidden_grad="partial", chunk_bytes=chunk_bytes)
    logprobs, entropy = out.logprobs.view(labels.shape), out.entropy.view(labels.shape)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy


@memoize("verl.head_spec", 64, "the log-prob and entropy spec of linear_cross_entropy by temperature")
def _head_spec(temperature: float) -> LossSpec:
    return LossSpec(cross_entropy=None, outputs=["logprobs", "entropy"], differentiable_outputs=True,
                    ignore_index=_IGNORE, transform=LogitTransform(temperature=temperature))


# --- installing into verl -------------------------------------------------------------------

_FORWARDS = ("verl.models.transformers.dense_common", "verl.models.transformers.qwen2_vl",
             "verl.models.transformers.qwen3_vl", "verl.models.transformers.qwen3_5",
             "verl.models.transformers.glm4v")
_USERS = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")


def _with_positions(forward: Callable) -> Callable:
    """verl's fused forward, handing its packed position ids to :func:`linear_cross_entropy`."""
    if getattr(forward, "_headloss", False):
        return forward
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        try:
            positions = signature.bind_partial(*args, **kwargs).arguments.get("position_ids")
        except TypeError:
            positions = None
        packed = isinstance(positions, torch.Tensor) and (positions.dim() == 1 or positions.dim() == 2
                                                          and positions.shape[0] == 1)  # not [B, T], not mrope's
        token = _POSITIONS.set(positions if packed else None)
        try:
            return forward(*args, **kwargs)
        finally:
            _POSITIONS.reset(token)

    wrapped._headloss = True
    return wrapped


def register_losses(override: bool = False) -> list[str]:
    """Register headloss's run of each verl loss mode as ``headloss_<mode>`` (and under verl's own
    name with ``override``); returns the registered names."""
    from verl.trainer.ppo import core_algos

    names = []
    for mode in LOSS_MODES:
        fn = policy_loss_fn(mode)
        for name in (f"headloss_{mode}", mode) if override else (f"headloss_{mode}",):
            core_algos.register_policy_loss(name)(fn)
            names.append(name)
    return names


def install(fused_head: bool = True, policy_losses: bool = True, distillation: bool = True) -> None:
    """Point verl at headloss in this process: ``fused_head`` replaces verl's
    ``linear_cross_entropy`` (the FSDP fused forwards, with their packed position ids, and the
    Megatron output processor); ``policy_losses`` registers headloss's run of each loss mode under
    verl's own name and as ``headloss_<mode>``; ``distillation`` puts :func:`forward_kl_topk` in the
    place of verl's FSDP top-k step and registers the estimator losses as ``headloss_<name>``.
    Idempotent."""
    if policy_losses:
        register_losses(override=True)
    if distillation:
        install_distillation()
    if not fused_head:
        return
    import importlib

    kernel = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    kernel.linear_cross_entropy = linear_cross_entropy
    for name in _FORWARDS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a model family whose dependencies are not installed
            continue
        if hasattr(module, "forward_with_triton_backend"):
            module.forward_with_triton_backend = _with_positions(module.forward_with_triton_backend)
    for name in _USERS:  # modules that bound verl's function at import (only if already imported)
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "linear_cross_entropy"):
            module.linear_cross_entropy = linear_cross_entropy
