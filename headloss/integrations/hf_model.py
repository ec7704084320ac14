"""What headloss reads of a Hugging Face causal LM to stand in for its head: the model under a PEFT
wrapper, its lm_head (checked reproducible), the logit transform its config implies (Gemma's softcap,
Cohere's logit scale), its forward's ``labels`` position; and the spec merged with that transform.
headloss.integrations.transformers patches the model with them.
"""

from __future__ import annotations

import inspect

import torch

from ..spec import LogitTransform, LossSpec


class PatchError(ValueError):
    """The model's head cannot be reproduced by headloss (the message says why)."""


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def head_transform(model) -> LogitTransform:
    """The transform a model applies to its lm_head's output, from its config (and attributes)."""
    config = text_config(model.config)
    scale = 1.0
    softcap = getattr(config, "final_logit_softcapping", None)
    cohere = getattr(model, "logit_scale", None)
    if isinstance(cohere, (int, float)) and not isinstance(cohere, bool):
        scale *= float(cohere)
    elif isinstance(getattr(config, "logit_scale", None), (int, float)) and config.model_type.startswith("cohere"):
        scale *= float(config.logit_scale)
    granite = getattr(config, "logits_scaling", None)
    if isinstance(granite, (int, float)) and not isinstance(granite, bool) and granite != 1.0:
        scale /= float(granite)
    inner = getattr(model, "model", None)
    falcon = getattr(inner, "lm_head_multiplier", None)
    if falcon is None:
        falcon = getattr(config, "lm_head_multiplier", None)
    if isinstance(falcon, (int, float)) and not isinstance(falcon, bool):
        scale *= float(falcon)
    return LogitTransform(logit_scale=scale, softcap=float(softcap) if softcap else None)


def causal_lm(model):
    """The model whose forward takes labels: a PEFT wrapper's base model, else the model. (FSDP2's
    fully_shard makes a subclass of the wrapper's class: its bases are read, not its own name.)"""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and not hasattr(model, "get_output_embeddings"):
        return get_base()
    if callable(get_base) and any(cls.__name__.startswith("Peft") for cls in type(model).__mro__):
        return get_base()
    return model


def check_head(head) -> None:
    if head is None:
        raise PatchError("model: get_output_embeddings() is None; headloss patches causal LMs with an lm_head")
    for name in ("lora_A", "base_layer", "lora_embedding_A"):
        if hasattr(head, name):
            raise PatchError(
                "model: the lm_head carries LoRA adapters; merge them (merge_and_unload) or leave lm_head out "
                "of target_modules -- headloss reads the plain weight"
            )
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise PatchError(f"model: the lm_head ({type(head).__name__}) has no 2-D weight")
    if not (weight.is_floating_point() and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        raise PatchError(f"model: the lm_head weight is {weight.dtype} (quantised?); headloss needs a float weight")


def full_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor (FSDP2 outside its forward, tensor parallel) as a full tensor; others as they are."""
    if t is not None and hasattr(t, "full_tensor") and type(t).__name__ == "DTensor":
        return t.full_tensor()
    return t


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def labels_position(forward) -> int | None:
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if p.name == "labels" and p.kind in positional:
            return i
    return None


def restore_attribute(obj, name: str, had: bool, value) -> None:
    if had:
        setattr(obj, name, value)
    else:
        obj.__dict__.pop(name, None)


def merged_spec(spec: LossSpec, model_transform: LogitTransform) -> LossSpec:
    """The user's spec with the model's head transform; a conflicting transform is an error."""
    mine = spec.transform
    if model_transform.logit_scale == 1.0 and model_transform.softcap is None:
        return spec
    if mine.logit_scale != 1.0 or mine.softcap is not None:
        if (mine.logit_scale, mine.softcap) != (model_transform.logit_scale, model_transform.softcap):
            raise PatchError(
                f"spec: its transform ({mine}) differs from the model's head (logit_scale="
                f"{model_transform.logit_scale}, softcap={model_transform.softcap}); leave logit_scale and "
                "softcap unset, the patch reads them from the model"
            )
        return spec
    transform = LogitTransform(logit_scale=model_transform.logit_scale, softcap=model_transform.softcap,
                               temperature=mine.temperature)
    return LossSpec.model_validate({**dict(spec), "transform": transform})
