"""What headloss reads of a Hugging Face causal LM to stand in for its head: the model under a PEFT
wrapper, its lm_head (checked reproducible), the logit transform its config implies (Gemma's softcap,
Cohere's logit scale), its forward's ``labels`` position; and the spec merged with that transform.
headloss.integrations.transformers patches the model with them.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..spec import LogitTransform, LossSpec
from ..transform import transformed_logits


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


def probe_stock(model, head, spec: LossSpec) -> tuple:
    """The patch-time probe through the stock model (eval mode, 6 random ids, the first label ignored):
    (its output, the ids, the labels, the spec to use). The lm_head must be ``hidden @ weight.T + bias`` and
    the logits its output under ``spec``'s transform -- or under none, where the config names a transform
    the forward does not apply (Gemma 3's multimodal wrapper ignores final_logit_softcapping): the spec
    returned then scores what the model computes. A PatchError otherwise."""
    device = head.weight.device
    if device.type == "meta":
        raise PatchError("model: its weights are on the meta device; load them first, or pass verify=False")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.weight.shape[0], (1, 6), generator=gen).to(device)
    labels = ids.clone()
    labels[0, 0] = -100
    seen: dict[str, torch.Tensor] = {}

    def hook(_module, inputs, output):
        seen["hidden"], seen["z"] = inputs[0].detach(), output.detach()

    was_training = model.training
    handle = head.register_forward_hook(hook)
    try:
        model.eval()
        with torch.no_grad():
            try:
                stock = model(input_ids=ids, labels=labels, use_cache=False)
            except TypeError:
                stock = model(input_ids=ids, labels=labels)
    finally:
        handle.remove()
        model.train(was_training)
    name = type(model).__name__
    if "hidden" not in seen:
        raise PatchError(f"{name}: its forward never called get_output_embeddings()")
    hidden, z = seen["hidden"], seen["z"]
    plain = F.linear(hidden, head.weight, getattr(head, "bias", None))
    if not torch.allclose(plain.float(), z.float(), **tolerance(z.dtype)):
        raise PatchError(f"{name}: its lm_head ({type(head).__name__}) is not hidden @ weight.T + bias; headloss "
                         "cannot reproduce it")
    logits = getattr(stock, "logits", None)
    if logits is None:
        raise PatchError(f"{name}: its output has no logits to check the head's transform against")

    def matches(candidate: LossSpec) -> bool:
        expected = transformed_logits(z.float(), candidate, torch.float32) * candidate.transform.temperature
        return torch.allclose(logits.float(), expected, **tolerance(logits.dtype))

    if matches(spec):
        return stock, ids, labels, spec
    unscaled = LogitTransform(temperature=spec.transform.temperature)
    plain_spec = LossSpec.model_validate({**dict(spec), "transform": unscaled})
    if spec.transform.logit_scale == 1.0 and spec.transform.softcap is None or not matches(plain_spec):
        raise PatchError(f"{name}: its logits are not the lm_head's output under the transform headloss read from "
                         f"its config ({spec.transform}); it applies something else to them, so it is refused "
                         "rather than mis-scored")
    return stock, ids, labels, plain_spec


def check_stock_loss(model, stock, labels) -> None:
    """The stock probe's loss is the causal-LM cross-entropy of its logits (plus a MoE router's auxiliary
    loss, as the model adds it), or a PatchError: headloss stands in for that loss only."""
    name = type(model).__name__
    if stock.loss is None:
        raise PatchError(f"{name}: its forward returned no loss for labels")
    logits = stock.logits[:, :-1].double()
    target = labels[:, 1:].to(logits.device)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    aux = getattr(stock, "aux_loss", None)
    if aux is not None:
        expected = expected + getattr(model, "router_aux_loss_coef", 0.0) * aux.double()
    if not torch.allclose(stock.loss.double(), expected, **tolerance(stock.logits.dtype)):
        raise PatchError(f"{name}: its loss for labels ({float(stock.loss):.6g}) is not the causal-LM cross-entropy "
                         f"of its logits ({float(expected):.6g}); refused rather than mis-scored")
