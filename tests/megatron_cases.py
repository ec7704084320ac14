"""A megatron-core GPTModel's loss, Megatron's own against headloss's patch, on one rank of a tensor-parallel
group: shared by tests/integrations/test_megatron.py (gloo, CPU) and tests/test_gpu.py (NCCL, 2 GPUs)."""

from __future__ import annotations

import warnings

import torch

VOCAB = 102  # Megatron pads the vocabulary to a multiple of the tensor-parallel size (2 and 3 here)
HIDDEN = 24


def init(rank: int, world: int, port: int, backend: str = "gloo") -> torch.device:
    """The process group and Megatron's model-parallel state (tensor parallel over every rank)."""
    from conftest import init_process
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    device = init_process(rank, world, port, backend)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if device.type == "cuda":  # Megatron's CUDA RNG states (its sequence-parallel embedding forks one)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    return device


def model_of(world: int, sequence_parallel: bool, tied: bool, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", vocab: int = VOCAB, hidden: int = HIDDEN, mtp_layers: int = 0):
    """A GPTModel without transformer layers (embedding, final norm, output layer: what the loss sees;
    Megatron's attention needs CUDA), the same weights for every world size; with ``mtp_layers``
    multi-token prediction depths (each: its norms and projection, a transformer layer without attention
    or MLP, its final norm), their losses scaled by 0.3."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    init_method = lambda w: torch.nn.init.normal_(w, std=0.7)  # noqa: E731
    config = TransformerConfig(num_layers=0, hidden_size=hidden, num_attention_heads=6, use_cpu_initialization=True,
                               tensor_model_parallel_size=world, params_dtype=dtype, init_method=init_method,
                               output_layer_init_method=init_method, hidden_dropout=0.0, attention_dropout=0.0,
                               masked_softmax_fusion=False, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16,
                               mtp_num_layers=mtp_layers or None, mtp_loss_scaling_factor=0.3)
    mtp = None
    if mtp_layers:
        layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(module=IdentityOp, params={"attn_mask_type": AttnMaskType.causal})))
        mtp = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=False)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=8192, share_embeddings_and_output_weights=tied,
                     position_embedding_type="learned_absolute", mtp_block_spec=mtp).to(device=device, dtype=dtype)
    if sequence_parallel:  # (torch's LayerNorm refuses it at construction; the norm is per token either way)
        config.sequence_parallel = True
        model.output_layer.sequence_parallel = True
        model.output_layer.allreduce_dgrad = False  # (its input's gradient is reduce-scattered instead)
    return model


def step(model, ids: torch.Tensor, labels: torch.Tensor):
    """The model's per-token loss [b, s] and every parameter's gradient after sum(loss * weights)."""
    b, s = ids.shape
    position = torch.arange(s, device=ids.device)[None].expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=ids.device).triu(1)
    model.zero_grad(set_to_none=True)
    loss = model(ids, position, mask, labels=labels)
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=ids.device).view_as(loss)  # a loss mask's role
    (loss * weights).sum().backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def patched_equals_megatron(rank, world, port, fused, sequence_parallel, tied, backend, dtype, results):
    """results[rank]: the largest differences, patched against Megatron's own, of the loss and of each
    gradient (relative to the gradient's largest entry), and of Megatron's own after restore()."""
    results[rank] = _patched_against_megatron(rank, world, port, fused, sequence_parallel, tied, backend, dtype)


def mtp_patched_equals_megatron(rank, world, port, fused, sequence_parallel, tied, backend, results):
    """patched_equals_megatron's differences with two multi-token prediction depths, in training mode, and
    of the per-depth losses Megatron logs."""
    results[rank] = _patched_against_megatron(rank, world, port, fused, sequence_parallel, tied, backend,
                                              torch.float32, mtp_layers=2)


def _patched_against_megatron(rank, world, port, fused, sequence_parallel, tied, backend, dtype,
                              mtp_layers: int = 0) -> dict:
    from headloss.integrations.megatron import patch_gpt_model

    device = init(rank, world, port, backend)
    if mtp_layers and device.type == "cpu":  # Megatron's tensor-parallel gathers allocate on the current device
        torch.cuda.current_device = lambda: torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    model = model_of(world, sequence_parallel, tied, dtype, device, mtp_layers=mtp_layers)
    want, want_grads = step(model, ids, labels)
    want_logged = _logged_mtp_losses()
    patch = patch_gpt_model(model, fused=fused)
    got, got_grads = step(model, ids, labels)
    got_logged = _logged_mtp_losses()
    assert patch.output is not None and patch.output.loss is not None
    assert len(patch.mtp_outputs) == (mtp_layers if fused else 0)
    patch.restore()
    again, _ = step(model, ids, labels)
    return {
        "loss": float((got - want).abs().max()),
        "restored": float((again - want).abs().max()),
        "grads": {n: float((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                  for n, g in want_grads.items()},
        "names": sorted(got_grads) == sorted(want_grads),
        "logged": None if want_logged is None else float((got_logged - want_logged).abs().max()),
        "logged_values": None if want_logged is None else want_logged.tolist(),
    }


def _logged_mtp_losses() -> torch.Tensor | None:
    """The per-depth multi-token prediction losses Megatron logged since the last call (then cleared)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if "values" not in tracker:
        return None
    values = tracker["values"].detach().float().cpu().clone()
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return values


def verl_swap_equals_megatron(rank, world, port, tied, backend, via_verl, results):
    """verl's Megatron fused forward after install(), against Megatron's own logits. Without sequence
    parallelism dh stays each rank's share, as verl's own kernel leaves it (verl runs tensor parallelism
    with sequence parallelism, whose gather reduce-scatters it): the replicated parameters' gradients
    then sum over the ranks to the reference's. ``via_verl``: through verl's own forward (else its
    head's steps written out: the decoder's output gathered along s, headloss's verl contract)."""
    import torch.distributed as dist

    from headloss.integrations import verl as headloss_verl

    device = init(rank, world, port, backend)
    sequence_parallel = backend == "nccl"
    if via_verl:
        import verl.models.mcore.model_forward_fused as fused_forward

        headloss_verl.install(policy_losses=False, distillation=False)
        assert fused_forward.linear_cross_entropy is headloss_verl.linear_cross_entropy
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 8), generator=gen).to(device)  # verl's packed rows: one batch row
    labels = torch.randint(0, VOCAB, (1, 8), generator=gen).to(device)
    position = torch.arange(8, device=device)[None]
    w_lp, w_ent = (torch.rand(1, 8, generator=gen).to(device) for _ in range(2))

    model = model_of(world, sequence_parallel, tied, device=device)
    logits = model(ids, position, None)  # Megatron's own output layer: [b, s, V / tp]
    parts = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(parts, logits.detach().contiguous())
    whole = torch.cat(parts, -1).double().requires_grad_(True)
    logp = whole.log_softmax(-1)
    want_lp = logp.gather(-1, labels[..., None])[..., 0]
    want_ent = -(logp.exp() * logp).sum(-1)
    (want_lp * w_lp + want_ent * w_ent).sum().backward()
    width = logits.shape[-1]
    logits.backward(whole.grad[..., rank * width:(rank + 1) * width].to(logits.dtype))
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    if via_verl:
        fused_forward.patch_fused_forward(model)
        out = model(ids, position, None, labels=labels)
        log_probs, entropy = out.log_probs, out.entropy
    else:  # _fused_GPTModel_forward's steps
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden = model.decoder(hidden_states=model.embedding(ids, position), attention_mask=None)
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden)
        weight = model.shared_embedding_or_output_weight() if tied else model.output_layer.weight
        log_probs, entropy = headloss_verl.linear_cross_entropy(
            hidden, weight, labels, 1.0, "none", parallel_state.get_tensor_model_parallel_group())
    (log_probs * w_lp + entropy * w_ent).sum().backward()
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    errs = {}
    for name, g in want.items():
        mine = got[name]
        if not sequence_parallel and "output_layer" not in name:
            if "word_embeddings" in name:
                continue  # (each rank's vocabulary rows of a partial dh: no sum to compare)
            dist.all_reduce(mine)
        errs[name] = float((mine - g).abs().max() / g.abs().max())
    results[rank] = {
        "lp": float((log_probs.double() - want_lp).abs().max()),
        "ent": float((entropy.double() - want_ent).abs().max()),
        "names": sorted(got) == sorted(want),
        "grads": errs,
    }


def megatron_ddp_hook(weight: torch.Tensor, fired: list) -> None:
    """Megatron DDP's backward post-hook on a parameter, as distributed_data_parallel.py writes it (add
    ``param.grad`` into ``main_grad`` unless the layer already did, then drop it); ``fired`` gets the flag
    each time it runs."""
    def hook(param):
        fired.append(param.grad_added_to_main_grad)
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad.data)
        param.grad = None
    weight.register_post_accumulate_grad_hook(hook)


def gradient_accumulation_fusion_equals_megatron(rank, world, port, backend, results):
    """results[rank]: with the output layer's gradient_accumulation_fusion on and a main_grad on its weight (as
    Megatron's DDP gives it, with its backward hook), the patched model's fused loss adds dW into main_grad,
    and main_grad equals the weight gradient of Megatron's own model (fusion off) over two micro-batches;
    every other gradient as Megatron's."""
    from headloss.integrations.megatron import patch_gpt_model

    device = init(rank, world, port, backend)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    model = model_of(world, False, False, torch.float32, device)
    want, want_grads = step(model, ids, labels)
    patch = patch_gpt_model(model, fused=True)
    model.output_layer.gradient_accumulation_fusion = True  # (Megatron's own needs APEX or TE for it)
    weight = model.output_layer.weight
    weight.main_grad = torch.zeros_like(weight)
    fired = []
    megatron_ddp_hook(weight, fired)
    for _ in range(2):
        weight.grad_added_to_main_grad = False
        got, got_grads = step(model, ids, labels)
    patch.restore()
    name = next(n for n, p in model.named_parameters() if p is weight)
    want_w = want_grads.pop(name)
    return_grads = {n: float((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                    for n, g in want_grads.items() if n in got_grads}  # (step zeroes them: the second's)
    results[rank] = {
        "loss": float((got - want).abs().max()),
        "main_grad": float((weight.main_grad / 2 - want_w).abs().max() / want_w.abs().max()),
        "fired": fired, "weight_grad": weight.grad is None, "grads": return_grads,
        "names": sorted(return_grads) == sorted(want_grads),
    }


def ddp_fusion_equals_megatron(rank, world, port, backend, dtype, overlap, results):
    """results[rank]: megatron-core's own DistributedDataParallel around the model (its main_grad buffers,
    fp32 gradient reduction, its backward hooks; ``overlap``: gradient reduction overlapped with backward,
    whose hook asserts every parameter got a gradient), two micro-batches then finish_grad_sync: the patched
    model with the output layer's gradient_accumulation_fusion on against Megatron's own model (fusion off)
    under the same DDP, every parameter's main_grad (relative to its largest entry)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from headloss.integrations.megatron import patch_gpt_model

    device = init(rank, world, port, backend)
    if device.type == "cpu":  # DDP allocates its gradient buffers on the current device
        torch.cuda.current_device = lambda: torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    b, s = ids.shape
    position = torch.arange(s, device=device)[None].expand(b, s)
    mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=device).triu(1)
    main_grads, flags = {}, {}
    for fused in (False, True):
        model = model_of(world, False, False, dtype, device)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=overlap), model)
        patch = None
        if fused:
            patch = patch_gpt_model(model, fused=True)
            model.output_layer.gradient_accumulation_fusion = True  # (Megatron's own needs APEX or TE for it)
        ddp.zero_grad_buffer()
        for micro in range(2):
            loss = ddp(ids, position, mask, labels=labels)
            weights = torch.linspace(0.5 + micro, 1.5, loss.numel(), device=device).view_as(loss)
            (loss.float() * weights).sum().backward()
        ddp.finish_grad_sync()
        weight = model.output_layer.weight
        flags[fused] = (bool(weight.grad_added_to_main_grad), weight.grad is None)
        main_grads[fused] = {n: p.main_grad.detach().float().clone() for n, p in model.named_parameters()}
        if patch is not None:
            patch.restore()
    want, got = main_grads[False], main_grads[True]
    results[rank] = {
        "grads": {n: float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in want.items()},
        "names": sorted(got) == sorted(want) and len(want) > 0,
        "flags": flags,
    }
