"""A megatron-core GPTModel's loss, Megatron's own against headloss's patch, on one rank of a tensor-parallel
group: shared by tests/integrations/test_megatron.py (gloo, CPU) and tests/test_gpu.py (NCCL, 2 GPUs)."""

from __future__ import annotations

import os
import warnings

import torch

VOCAB = 102  # Megatron pads the vocabulary to a multiple of the tensor-parallel size (2 and 3 here)
HIDDEN = 24


def init(rank: int, world: int, port: int, backend: str = "gloo") -> torch.device:
    """The process group and Megatron's model-parallel state (tensor parallel over every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if device.type == "cuda":  # Megatron's CUDA RNG states (its sequence-parallel embedding forks one)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    return device


def model_of(world: int, sequence_parallel: bool, tied: bool, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", vocab: int = VOCAB, hidden: int = HIDDEN):
    """A GPTModel without transformer layers (embedding, final norm, output layer: what the loss sees;
    Megatron's attention needs CUDA), the same weights for every world size."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_method = lambda w: torch.nn.init.normal_(w, std=0.7)  # noqa: E731
    config = TransformerConfig(num_layers=0, hidden_size=hidden, num_attention_heads=6, use_cpu_initialization=True,
                               tensor_model_parallel_size=world, params_dtype=dtype, init_method=init_method,
                               output_layer_init_method=init_method, hidden_dropout=0.0, attention_dropout=0.0,
                               masked_softmax_fusion=False, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False, bf16=dtype == torch.bfloat16)
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=8192, share_embeddings_and_output_weights=tied,
                     position_embedding_type="learned_absolute").to(device=device, dtype=dtype)
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
    from headloss.integrations.megatron import patch_gpt_model

    device = init(rank, world, port, backend)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
    model = model_of(world, sequence_parallel, tied, dtype, device)
    want, want_grads = step(model, ids, labels)
    patch = patch_gpt_model(model, fused=fused)
    got, got_grads = step(model, ids, labels)
    assert patch.output is not None and patch.output.loss is not None
    patch.restore()
    again, _ = step(model, ids, labels)
    results[rank] = {
        "loss": float((got - want).abs().max()),
        "restored": float((again - want).abs().max()),
        "grads": {n: float((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                  for n, g in want_grads.items()},
        "names": sorted(got_grads) == sorted(want_grads),
    }
