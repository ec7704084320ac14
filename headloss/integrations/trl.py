"""TRL's GRPOTrainer and SFTTrainer computing their loss through a headloss LossSpec.

::

    from headloss.integrations.trl import HeadLossGRPOTrainer, HeadLossSFTTrainer

    trainer = HeadLossGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()

Both are subclasses that change one method: the loss (``GRPOTrainer._compute_loss``,
``SFTTrainer.compute_loss``) runs through :func:`headloss.integrations.transformers.patch` on the
policy model -- the model's forward, then :func:`headloss.linear_head_loss` on the hidden states,
with the objective, the entropy, the clip statistics and the KL in the same pass. Generation,
rewards, advantages, the old / reference log-probs and everything else stay TRL's. Losses,
gradients and the logged metrics follow TRL's conventions, names and cross-process reductions:

=============================  ===========================================================
TRL option                     headloss
=============================  ===========================================================
GRPO ``loss_type``             ``Policy.loss_type`` for grpo, bnpo, dr_grpo, dapo (divided
                               by the accumulation steps, or dapo's rescaled
                               ``num_items_in_batch``, exactly as TRL does); cispo:
                               ``objective="cispo"`` (``epsilon_high`` the absolute cap)
                               aggregated as dapo; sapo: ``objective="sapo"``
                               (``sapo_temperature_pos/neg``) aggregated as grpo; luspo:
                               ``loss_type="seq-mean-token-sum"``
``epsilon`` / ``epsilon_high``  ``Policy.eps_low`` / ``eps_high``
``delta``                      ``Policy.delta``
``beta``                       ``Policy.kl_beta`` with the k3 estimator
``use_bias_correction_kl``     ``Policy.kl_importance_correction``
``max_completion_length``      ``Policy.max_completion_length`` (dr_grpo)
``temperature``                ``LogitTransform.temperature`` (the model's own head transform,
                               e.g. Gemma's softcap, is read from its config)
vLLM importance sampling       ``importance_weights`` = TRL's ``importance_sampling_ratio``
MoE router aux loss            added as TRL adds it
SFT ``loss_type`` nll / dft    ``CrossEntropy`` / ``DFT``
SFT ``label_smoothing_factor`` ``CrossEntropy.label_smoothing``
=============================  ===========================================================

Also mapped: vespo (``objective="vespo"``, ``vespo_k/lambda_pos/neg``, the vLLM ratio folded
into phi as TRL does, aggregated as dapo); ``off_policy_mask_threshold`` (``Policy.off_policy_mask``,
with TRL's ``sampling_per_token_logps`` as ``rollout_logprobs``); ``top_entropy_quantile``
(``Policy.top_entropy_quantile``; over several processes the quantile is of all their tokens, as
TRL's, through ``entropy_quantile_group``: one host wait per call); a static entropy
bonus (``entropy_coef``, and ``use_adaptive_entropy``'s controller: ``entropy_aggregation=
"token-mean"``, divided by the accumulation steps as TRL does; ``policy_loss`` and ``entropy_coef``
logged as TRL logs them).

``importance_sampling_level="sequence"`` (GSPO): ``Policy.importance_sampling="sequence"``, its clip
fractions means over sequences as TRL's.

Refused with an error naming the option (no mapping yet): SFT's ``compute_loss_func`` and DeepSpeed
sequence parallelism.

Pass ``spec=`` to score more than TRL's loss (z-loss, say): its extra metrics are logged too.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer, SFTTrainer

from ..spec import DFT, CrossEntropy, Entropy, LogitTransform, LossSpec, Policy
from .transformers import HeadPatch, patch

__all__ = ["HeadLossGRPOTrainer", "HeadLossSFTTrainer", "grpo_spec", "sft_spec"]

_TRL_NAMES = {"token_accuracy": "mean_token_accuracy"}
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                 "mm_token_type_ids", "spatial_shapes", "image_position_ids")
"""Extra model inputs of a generation batch that GRPOTrainer's own loss passes to the model (whole
batch: this loss does not split it)."""


_LOSS_TYPES = {  # TRL loss_type -> (Policy.objective, Policy.loss_type)
    "grpo": ("clip", "grpo"), "bnpo": ("clip", "bnpo"), "dr_grpo": ("clip", "dr_grpo"), "dapo": ("clip", "dapo"),
    "cispo": ("cispo", "dapo"), "sapo": ("sapo", "grpo"), "luspo": ("clip", "seq-mean-token-sum"),
    "vespo": ("vespo", "dapo"),
}
_PER_STEP = ("grpo", "bnpo", "dr_grpo", "seq-mean-token-sum")
"""Policy loss types TRL divides by the accumulation steps (dapo's normaliser includes them)."""


def grpo_spec(trainer) -> LossSpec:
    """The LossSpec of a GRPOTrainer's objective (its attributes, as its __init__ set them)."""

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"{option}: {why} has no headloss mapping yet; use trl.GRPOTrainer for it")

    if trainer.loss_type not in _LOSS_TYPES:
        refuse("loss_type", f"{trainer.loss_type!r}")
    if trainer.importance_sampling_level not in ("token", "sequence"):
        refuse("importance_sampling_level", f"{trainer.importance_sampling_level!r}")
    args = trainer.args
    bonus = getattr(trainer, "_entropy_bonus_enabled", False)
    objective, loss_type = _LOSS_TYPES[trainer.loss_type]
    policy = Policy(
        vespo_k_pos=getattr(args, "vespo_k_pos", 2.0), vespo_lambda_pos=getattr(args, "vespo_lambda_pos", 3.0),
        vespo_k_neg=getattr(args, "vespo_k_neg", 3.0), vespo_lambda_neg=getattr(args, "vespo_lambda_neg", 2.0),
        off_policy_mask=trainer.off_policy_mask_threshold, top_entropy_quantile=trainer.top_entropy_quantile,
        entropy_coef=float(trainer.entropy_coef) if bonus else 0.0, entropy_aggregation="token-mean",
        importance_sampling=trainer.importance_sampling_level,
        objective=objective, loss_type=loss_type, eps_low=trainer.epsilon_low, eps_high=trainer.epsilon_high,
        sapo_tau_pos=getattr(args, "sapo_temperature_pos", 1.0),
        sapo_tau_neg=getattr(args, "sapo_temperature_neg", 1.05),
        delta=getattr(args, "delta", None), kl_beta=trainer.beta, kl_estimator="k3",
        kl_importance_correction=bool(getattr(args, "use_bias_correction_kl", False)),
        max_completion_length=trainer.max_completion_length if trainer.loss_type == "dr_grpo" else None,
        num_processes=1,
    )
    return LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0), policy=policy,
                    transform=LogitTransform(temperature=trainer.temperature))


def sft_spec(args) -> LossSpec:
    """The LossSpec of an SFTConfig's loss, with TRL's logged entropy and token accuracy."""
    smoothing = float(getattr(args, "label_smoothing_factor", 0.0) or 0.0)
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type == "dft":
        if smoothing:
            raise ValueError("label_smoothing_factor: TRL does not smooth the dft loss; set it to 0")
        return LossSpec(cross_entropy=None, dft=DFT(), entropy=Entropy(weight=0.0), token_accuracy=True)
    if loss_type != "nll":
        raise ValueError(f"loss_type: {loss_type!r} has no headloss mapping yet; use trl.SFTTrainer for it")
    return LossSpec(cross_entropy=CrossEntropy(label_smoothing=smoothing), entropy=Entropy(weight=0.0),
                    token_accuracy=True)


def _global_means(accelerator, metrics: dict[str, torch.Tensor], names, count=None) -> dict[str, float]:
    """Means over every process (TRL's global_masked_mean), all names with one reduce: of this
    process's means weighted by its token count, or by ``count`` (its sequences, say)."""
    n = (metrics["n_tokens"] if count is None else torch.as_tensor(count, device=metrics["n_tokens"].device)
         ).to(torch.float32)
    stack = torch.stack([n] + [metrics[k].to(torch.float32) * n for k in names])
    totals = accelerator.reduce(stack, reduction="sum").tolist()
    count = max(totals[0], 1.0)
    return {k: v / count for k, v in zip(names, totals[1:])}


class HeadLossGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose loss is a headloss LossSpec (see the module doc for the mapping).

    Extra arguments: ``spec`` (default: :func:`grpo_spec` of the config), ``patch_options`` (for
    :func:`headloss.integrations.transformers.patch`, e.g. ``chunk_bytes``).
    """

    def __init__(self, *args, spec: LossSpec | None = None, patch_options: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.headloss_spec = spec if spec is not None else grpo_spec(self)
        if self.headloss_spec.policy is None:
            raise ValueError("spec: HeadLossGRPOTrainer needs a spec with a policy term")
        self.headloss: HeadPatch = patch(self.model, self.headloss_spec, **(patch_options or {}))
        self._call_specs: dict = {}

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        keep = completion_ids.size(1)
        self._sequences = completion_ids.size(0)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        bonus = getattr(self, "_entropy_bonus_enabled", False)
        spec = self._spec_for_call(mode, self._bonus_coef() if bonus else None)
        self.headloss.spec = spec
        policy = spec.policy
        num_items = None
        if policy.loss_type == "dapo":  # TRL's rescaling of the generation batch's token count
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = inputs["importance_sampling_ratio"]
            if weights.dim() == 2 and weights.shape[1] == 1:
                weights = weights.expand_as(mask)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": completion_ids,
                        "logits_to_keep": keep + 1, "use_cache": False}
        for key in _MODEL_INPUTS:  # vision-language policies: their image inputs, as TRL passes them
            if inputs.get(key) is not None:
                model_inputs[key] = inputs[key]
        if num_items is not None:
            model_inputs["num_items_in_batch"] = num_items
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        with self.headloss.inputs(
            entropy_quantile_group=self._quantile_group(policy),
            advantages=inputs["advantages"], old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps") if policy.kl_beta != 0.0 else None,
            loss_mask=mask, importance_weights=weights,
            rollout_logprobs=inputs.get("sampling_per_token_logps") if policy.off_policy_mask is not None else None,
        ), self.accelerator.autocast():
            outputs = model(**model_inputs)
        result = self.headloss.last
        loss = result.loss
        if bonus:  # TRL logs the loss before the bonus, and the coefficient per optimizer step
            bonus_entropy = result.metrics["high_entropy/entropy" if policy.top_entropy_quantile < 1.0 else "entropy"]
            policy_loss = result.loss.detach() + policy.entropy_coef * bonus_entropy
            self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
            if self.use_adaptive_entropy and mode == "train":
                self._adapt_entropy_coef(result.metrics)
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        if policy.loss_type in _PER_STEP and mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:
            normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / normalizer
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item())
        self._log_metrics(mode, result.metrics, policy)
        return loss

    def _quantile_group(self, policy: Policy):
        """TRL's top-entropy quantile is over every process's tokens (accelerator.gather)."""
        if policy.top_entropy_quantile == 1.0 or self.accelerator.num_processes == 1:
            return None
        return torch.distributed.group.WORLD

    def _bonus_coef(self) -> float:
        """TRL's applied entropy coefficient: the static one, or the adaptive controller's when the
        last window's entropy was at or below the target (0 otherwise)."""
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def _adapt_entropy_coef(self, metrics: dict[str, torch.Tensor]) -> None:
        """TRL's adaptive controller: the window's token-weighted entropy over every process (of the
        top-entropy mask's tokens when it is on, TRL's effective mask), at each optimizer-step
        boundary, moves the coefficient by entropy_coef_delta within [min, max]."""
        n = metrics["n_tokens"].to(torch.float32)
        entropy = metrics["entropy"].float()
        if "high_entropy/fraction" in metrics:
            n = n * metrics["high_entropy/fraction"].float()
            entropy = metrics["high_entropy/entropy"].float()
        stats = torch.stack([entropy * n, n]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if self.accelerator.sync_gradients:
            window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
            world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
            args = self.args
            if world_entropy <= args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            self._last_world_entropy = world_entropy
            self._entropy_window_stats = None

    def _spec_for_call(self, mode: str, coef: float | None) -> LossSpec:
        """The spec of this call. With TRL's entropy bonus (``coef``: its applied coefficient), the
        bonus is divided by the accumulation steps in training: the whole loss is for the per-step
        loss types, dapo's normaliser is not."""
        spec = self.headloss_spec
        if coef is None:
            return spec
        policy = spec.policy
        if policy.loss_type not in _PER_STEP and mode == "train":
            coef = coef / self.current_gradient_accumulation_steps
        key = (spec, coef)
        if key not in self._call_specs:
            self._call_specs[key] = spec.model_copy(
                update={"policy": policy.model_copy(update={"entropy_coef": coef})})
        return self._call_specs[key]

    def _log_metrics(self, mode: str, metrics: dict[str, torch.Tensor], policy: Policy) -> None:
        """TRL's names per objective: the clip statistics for the clip family, cispo_clip_ratio for
        cispo (the share of A > 0 tokens above the cap: clip_ratio/high_mean here), none for sapo."""
        clip_family = policy.objective == "clip"
        clip_names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") if clip_family else ()
        by_sequence = policy.importance_sampling == "sequence"  # TRL: those clip means are over sequences
        names = [k for k in ("kl", "entropy") if k in metrics and (k != "kl" or policy.kl_beta != 0.0)]
        extra = [k for k in metrics if k not in names and k not in _POLICY_INTERNAL]
        clip_means = list(clip_names) + (["clip_ratio/high_mean"] if policy.objective == "cispo" else [])
        values = _global_means(self.accelerator, metrics, names + extra + ([] if by_sequence else clip_means))
        if by_sequence:
            values.update(_global_means(self.accelerator, metrics, clip_means, count=self._sequences))
        for k in names + extra + list(clip_names):
            self._metrics[mode][_TRL_NAMES.get(k, k)].append(values[k])
        if policy.objective == "cispo":
            self._metrics[mode]["cispo_clip_ratio"].append(values["clip_ratio/high_mean"])
        if policy.objective == "vespo":  # TRL: a mean over the sequences of every process
            self._metrics[mode]["vespo/phi_seq_mean"].append(
                _global_means(self.accelerator, metrics, ["vespo/phi_seq_mean"], count=self._sequences)[
                    "vespo/phi_seq_mean"])
        has = metrics["n_tokens"].reshape(1) > 0
        for k, reduce, empty in (("clip_ratio/low_min", torch.min, float("inf")),
                                 ("clip_ratio/high_max", torch.max, float("-inf"))):
            if k in metrics and clip_family:  # TRL's nanmin / nanmax: a process without tokens has no sequence mean
                value = torch.where(has, metrics[k].reshape(1).float(), empty)
                result = float(reduce(self.accelerator.gather(value)))
                self._metrics[mode][k].append(result if abs(result) != float("inf") else float("nan"))


_POLICY_INTERNAL = ("loss", "n_tokens", "clip_ratio/low_min", "clip_ratio/high_max", "clip_ratio/low_mean",
                    "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio/mean", "ratio/min", "ratio/max",
                    "logprob/mean", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "vespo/phi_seq_mean",
                    "high_entropy/fraction", "high_entropy/entropy")
"""The policy metrics TRL does not log under these names (the ones it does are picked per objective)."""


def refuse_sequence_parallel(accelerator) -> None:
    """DeepSpeed (Ulysses) sequence parallelism: TRL lets the model reduce its own loss across the
    sequence shards, which a headloss head does not do yet."""
    config = getattr(accelerator, "parallelism_config", None)
    if getattr(config, "sp_enabled", False) and getattr(config, "sp_backend", None) == "deepspeed":
        raise ValueError("parallelism_config: DeepSpeed sequence parallelism (sp_backend='deepspeed') has no headloss "
                         "mapping yet; use trl.SFTTrainer")


class HeadLossSFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` whose loss is a headloss LossSpec: TRL's nll or dft loss (and label
    smoothing), its ``entropy`` and ``mean_token_accuracy`` from the same pass, no logits.

    Extra arguments: ``spec`` (default: :func:`sft_spec` of the config; its other metrics are
    logged too), ``patch_options``.
    """

    def __init__(self, *args, spec: LossSpec | None = None, patch_options: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.compute_loss_func is not None:
            raise ValueError("compute_loss_func: HeadLossSFTTrainer computes the loss itself; use trl.SFTTrainer")
        refuse_sequence_parallel(self.accelerator)
        self.headloss_spec = spec if spec is not None else sft_spec(self.args)
        self._log_all = spec is not None  # TRL's own metrics only, unless the user asked for more
        self.label_smoother = None  # the spec's CrossEntropy.label_smoothing does it
        self.headloss: HeadPatch = patch(self.model, self.headloss_spec, **(patch_options or {}))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        inputs = {**inputs, "use_cache": False}
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        if "labels" not in inputs:
            raise ValueError("inputs: HeadLossSFTTrainer needs labels from the collator")
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        result = self.headloss.last
        loss = result.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(outputs.aux_loss).mean().item())
        names = [k for k in result.metrics if k not in ("loss", "n_tokens")
                 and (self._log_all or k in ("entropy", "token_accuracy"))]
        values = _global_means(self.accelerator, result.metrics, names)
        for k in names:
            self._metrics[mode][_TRL_NAMES.get(k, k)].append(values[k])
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            else:
                tokens = self.accelerator.gather_for_metrics(
                    torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)).sum().item()
            self._total_train_tokens += tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if return_outputs:
            raise ValueError("return_outputs: the headloss head builds no logits; evaluate with prediction_loss_only")
        return loss
