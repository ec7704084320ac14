"""headloss.integrations.transformers: the generic patch against the stock HF models (tiny random
models built from configs, no downloads), its refusals, undo, generation, and a Trainer run."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import spawn_ranks, tiered, torchrun  # noqa: E402

from headloss import Entropy, LogitTransform, LossSpec, ZLoss  # noqa: E402
from headloss.integrations.transformers import (  # noqa: E402
    HeadLossCallback,
    PatchError,
    attach,
    head_transform,
    patch,
)

VOCAB = 101  # not a power of two
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FULL = LossSpec(z_loss=ZLoss(weight=1e-3), entropy=Entropy(), token_accuracy=True)


def tiny(kind: str, **extra):
    """A tiny random model of ``kind`` (seeded), in fp32 train mode, dropout off."""
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, **extra))
    elif kind == "qwen2_tied":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, tie_word_embeddings=True, **extra))
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "gemma2_softcap":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **SIZES, head_dim=8, final_logit_softcapping=3.0, **extra))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
            output_router_logits=True, router_aux_loss_coef=0.1, **extra))
    elif kind == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**SIZES, logits_scaling=4.0, **extra))
    elif kind == "gemma3_vlm":  # a *ForConditionalGeneration text head (whose forward skips the softcap)
        text = transformers.Gemma3TextConfig(**SIZES, head_dim=8, final_logit_softcapping=3.0, **extra)
        vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2))
    elif kind == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**SIZES, logit_scale=0.25, **extra))
    else:
        raise ValueError(kind)
    model.train()
    return model


def batch(seed: int, b: int = 2, t: int = 9):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 3, (b, t), generator=gen)  # (the last ids are Gemma 3's image tokens)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[1, -2:] = -100  # padding
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -2:] = 0
    return ids, labels, mask


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(mine: dict, stock: dict, rtol: float = 1e-5) -> None:
    assert mine.keys() == stock.keys()
    for name, g in stock.items():
        scale = g.abs().max().clamp_min(1e-12)
        err = (mine[name] - g).abs().max() / scale
        assert err <= rtol, f"{name}: relative error {err:.3g}"


def run(model, ids, labels, mask, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
    out.loss.backward()
    return out, grads(model)


@pytest.mark.parametrize("kind, num_items", tiered(["llama", "qwen2_tied", "gemma2_softcap", "qwen2_moe", "granite",
                                                     "cohere", "gemma3_vlm"], [None, 11], pairs=False))
def test_patched_model_matches_stock_loss_and_gradients(kind, num_items):
    model = tiny(kind)
    ids, labels, mask = batch(1)
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    stock, stock_grads = run(model, ids, labels, mask, **kwargs)
    assert torch.isfinite(stock.loss) and stock.loss > 0
    with patch(model, FULL.model_copy(update={"z_loss": None, "entropy": Entropy(weight=0.0)})) as handle:
        mine, mine_grads = run(model, ids, labels, mask, **kwargs)
        assert mine.logits is None
        assert set(mine.metrics) >= {"ce", "entropy", "token_accuracy", "n_tokens", "loss"}
        assert mine.headloss.loss is not None
        assert handle.metrics.calls == 1
    assert abs(float(mine.loss.detach()) - float(stock.loss.detach())) <= 1e-6 * max(1.0, float(stock.loss.detach()))
    assert_grads_close(mine_grads, stock_grads)
    if kind == "qwen2_moe":  # the router's auxiliary loss is kept
        assert mine.aux_loss is not None and float(mine.aux_loss.detach()) > 0
        assert float(mine.loss.detach()) != pytest.approx(float(mine.metrics["ce"]), abs=1e-4)


def test_transform_read_from_the_config():
    assert head_transform(tiny("gemma2_softcap")) == LogitTransform(softcap=3.0)
    assert head_transform(tiny("granite")) == LogitTransform(logit_scale=0.25)
    assert head_transform(tiny("cohere")) == LogitTransform(logit_scale=0.25)
    assert head_transform(tiny("llama")) == LogitTransform()


def test_z_loss_and_metrics_are_the_specs_on_the_models_logits():
    model = tiny("gemma2_softcap")
    ids, labels, mask = batch(2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # softcapped by the model
    target = labels[:, 1:]
    keep = target != -100
    lp = torch.log_softmax(logits[:, :-1].double(), -1)
    ce = -lp.gather(-1, target.clamp_min(0)[..., None])[..., 0][keep].mean()
    lse = torch.logsumexp(logits[:, :-1].double(), -1)[keep]
    entropy = -(lp.exp() * lp).sum(-1)[keep].mean()
    accuracy = (logits[:, :-1].argmax(-1) == target)[keep].double().mean()
    with patch(model, FULL):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert float(out.metrics["ce"]) == pytest.approx(float(ce), rel=1e-5)
    assert float(out.metrics["z_loss"]) == pytest.approx(float((lse**2).mean()), rel=1e-5)
    assert float(out.metrics["entropy"]) == pytest.approx(float(entropy), rel=1e-5)
    assert float(out.metrics["token_accuracy"]) == pytest.approx(float(accuracy), abs=1e-6)
    assert float(out.loss.detach()) == pytest.approx(float(ce + 1e-3 * (lse**2).mean()), rel=1e-5)


def test_shift_labels_and_ignore_index_are_honoured():
    model = tiny("llama")
    ids, labels, mask = batch(3)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    stock, stock_grads = run(model, ids, labels, mask, shift_labels=shifted)
    with patch(model):
        mine, mine_grads = run(model, ids, labels, mask, shift_labels=shifted)
    assert float(mine.loss.detach()) == pytest.approx(float(stock.loss.detach()), rel=1e-6)
    assert_grads_close(mine_grads, stock_grads)
    other = labels.masked_fill(labels == -100, -1)
    stock, _ = run(model, ids, other, mask, ignore_index=-1)
    with patch(model):
        mine, _ = run(model, ids, other, mask, ignore_index=-1)
    assert float(mine.loss.detach()) == pytest.approx(float(stock.loss.detach()), rel=1e-6)


def test_keep_logits_returns_the_models_logits():
    model = tiny("gemma2_softcap")
    ids, labels, mask = batch(4)
    stock, stock_grads = run(model, ids, labels, mask)
    with patch(model, keep_logits=True):
        mine, mine_grads = run(model, ids, labels, mask)
    torch.testing.assert_close(mine.logits, stock.logits, rtol=0, atol=0)
    assert float(mine.loss.detach()) == pytest.approx(float(stock.loss.detach()), rel=1e-6)
    assert_grads_close(mine_grads, stock_grads)


def test_undo_restores_the_models_own_forward_exactly():
    model = tiny("qwen2_tied")
    before = dict(model.__dict__), dict(model.lm_head.__dict__)
    ids, labels, mask = batch(5)
    stock = model(input_ids=ids, attention_mask=mask, labels=labels)
    handle = patch(model)
    assert "forward" in model.__dict__ and "forward" in model.lm_head.__dict__
    handle.undo()
    handle.undo()  # idempotent
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    assert "_loss_function" not in model.__dict__ and "_headloss_patch" not in model.__dict__
    assert set(model.__dict__) == set(before[0]) and set(model.lm_head.__dict__) == set(before[1])
    again = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(again.logits, stock.logits) and torch.equal(again.loss, stock.loss)
    patch(model).undo()  # patchable again after undo


def test_generate_works_while_patched_and_without_labels_nothing_changes():
    model = tiny("llama").eval()
    ids, _, _ = batch(6)
    stock = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False)
    plain = model(input_ids=ids)
    with patch(model):
        assert torch.equal(model.generate(ids[:, :4], max_new_tokens=4, do_sample=False), stock)
        assert torch.equal(model(input_ids=ids).logits, plain.logits)


class _Doubled(transformers.LlamaForCausalLM):
    """A head transform headloss does not know: refused by the probe."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class _OwnLoss(transformers.LlamaForCausalLM):
    """A model whose loss is not the causal-LM cross-entropy of its logits."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, labels=labels, **kwargs)
        if out.loss is not None:
            out.loss = out.loss * 0.5
        return out


@pytest.mark.parametrize("cls", [_Doubled, _OwnLoss])
def test_a_head_it_cannot_reproduce_is_refused(cls):
    torch.manual_seed(0)
    model = cls(transformers.LlamaConfig(**SIZES))
    with pytest.raises(PatchError, match="refused"):
        patch(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def test_conflicting_spec_transform_and_double_patch_are_errors():
    model = tiny("gemma2_softcap")
    with pytest.raises(PatchError, match="transform"):
        patch(model, LossSpec(transform=LogitTransform(softcap=30.0)))
    with patch(model, LossSpec(transform=LogitTransform(temperature=2.0))) as handle:
        assert handle.spec.transform == LogitTransform(softcap=3.0, temperature=2.0)
        with pytest.raises(PatchError, match="already patched"):
            patch(model)


def test_lora_on_the_lm_head_is_refused_and_lora_elsewhere_works():
    peft = pytest.importorskip("peft")
    model = tiny("llama")
    ids, labels, mask = batch(7)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    stock = lora(input_ids=ids, attention_mask=mask, labels=labels)
    stock.loss.backward()
    stock_grads = grads(lora)
    lora.zero_grad(set_to_none=True)
    with patch(lora):
        mine = lora(input_ids=ids, attention_mask=mask, labels=labels)
        mine.loss.backward()
    assert float(mine.loss.detach()) == pytest.approx(float(stock.loss.detach()), rel=1e-6)
    assert_grads_close(grads(lora), stock_grads)
    head_lora = peft.get_peft_model(tiny("llama"), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(PatchError, match="LoRA"):
        patch(head_lora)


def test_a_model_without_an_lm_head_is_refused():
    model = transformers.LlamaModel(transformers.LlamaConfig(**SIZES))
    with pytest.raises(PatchError):
        patch(model)


# --- Trainer -----------------------------------------------------------------------------------


class _Batches(torch.utils.data.Dataset):
    """8 sequences of uneven lengths (padding labelled -100)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(11)
        self.items = []
        for i in range(8):
            n = 5 + (i * 3) % 7
            ids = torch.randint(0, VOCAB, (12,), generator=gen)
            labels = ids.clone()
            labels[n:] = -100
            mask = (labels != -100).long()
            self.items.append({"input_ids": ids, "labels": labels, "attention_mask": mask})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _train(tmp_path, patched: bool, spec=FULL):
    """3 optimizer steps of 2 micro-batches of 2 uneven sequences; returns (model, trainer, what the
    callbacks after ours saw, the micro-batches in order, the weights at each step's start)."""
    model = tiny("llama")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("patched" if patched else "stock")), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, logging_steps=1, learning_rate=0.05, optim="sgd",
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
        dataloader_drop_last=True, disable_tqdm=True,
    )
    batches, states, seen = [], [], []

    def collate(items):
        out = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batches.append(out)
        return out

    class Record(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batches(), data_collator=collate,
                                   callbacks=[Record()])
    handle = None
    if patched:
        handle = patch(model, spec)
        attach(trainer, handle)
    trainer.train()
    if handle is not None:
        handle.undo()
    return model, trainer, seen, batches, states


def _recomputed(state, micro_batches) -> dict[str, float]:
    """Token-weighted CE, z-loss, entropy and accuracy of one step's micro-batches, in fp64."""
    model = tiny("llama")
    model.load_state_dict(state)
    ces, zs, ents, accs = [], [], [], []
    with torch.no_grad():
        for mb in micro_batches:
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1].double()
            target = mb["labels"][:, 1:]
            keep = target != -100
            lp = torch.log_softmax(logits, -1)
            ces.append(-lp.gather(-1, target.clamp_min(0)[..., None])[..., 0][keep])
            zs.append(torch.logsumexp(logits, -1)[keep] ** 2)
            ents.append(-(lp.exp() * lp).sum(-1)[keep])
            accs.append((logits.argmax(-1) == target)[keep].double())
    cat = lambda xs: torch.cat(xs)  # noqa: E731
    return {"ce": float(cat(ces).mean()), "z_loss": float(cat(zs).mean()), "entropy": float(cat(ents).mean()),
            "token_accuracy": float(cat(accs).mean()), "n_tokens": float(cat(ces).numel())}


@pytest.mark.slow
def test_trainer_with_gradient_accumulation_trains_like_stock(tmp_path):
    stock_model, stock_trainer, _, stock_batches, _ = _train(tmp_path, patched=False, spec=LossSpec())
    ce_model, ce_trainer, _, ce_batches, _ = _train(tmp_path, patched=True, spec=LossSpec())
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in stock_batches]
    assert len(set(counts)) > 1, "the micro-batches should hold uneven token counts"
    for b, c in zip(stock_batches, ce_batches):
        assert torch.equal(b["input_ids"], c["input_ids"])
    for (name, p), q in zip(stock_model.named_parameters(), ce_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    stock_losses = [h["loss"] for h in stock_trainer.state.log_history if "loss" in h]
    ce_losses = [h["loss"] for h in ce_trainer.state.log_history if "loss" in h]
    assert len(stock_losses) == 3 and ce_losses == pytest.approx(stock_losses, rel=1e-5)


@pytest.mark.slow
def test_trainer_callback_logs_token_weighted_step_metrics(tmp_path):
    _, trainer, seen, batches, states = _train(tmp_path, patched=True)
    logged = [h for h in trainer.state.log_history if "ce" in h]
    assert len(logged) == 3 and len(states) == 3 and len(batches) >= 6  # the loader may fetch one ahead
    assert [s["ce"] for s in seen if "ce" in s] == [h["ce"] for h in logged]  # later callbacks see them
    for step, values in enumerate(logged):
        expected = _recomputed(states[step], batches[2 * step: 2 * step + 2])
        for name, value in expected.items():
            assert values[name] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, name)
        # the Trainer's loss is the step's token mean of CE + 1e-3 z-loss
        assert values["loss"] == pytest.approx(expected["ce"] + 1e-3 * expected["z_loss"], rel=1e-5)


def test_callback_without_transformers_objects_reads_an_accumulator():
    from headloss.metrics import MetricsAccumulator

    acc = MetricsAccumulator()
    cb = HeadLossCallback(acc)
    assert isinstance(cb, transformers.TrainerCallback)
    logs = {"loss": 1.0}
    cb.on_log(None, type("S", (), {"log_history": []})(), None, logs=logs)
    assert logs == {"loss": 1.0}  # nothing accumulated: nothing added


# --- FSDP2 ---------------------------------------------------------------------------------------


def _fsdp2_rank(rank: int, world: int, port: int, tied: bool, lora: bool, results) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, tie_word_embeddings=tied))
        if lora:  # trl #6065: PEFT adapters (trainable) beside frozen sharded weights
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                               init_lora_weights=False))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.base_model.model if lora else model).model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids, labels, mask = batch(20 + rank)  # each rank its own data
        stock = model(input_ids=ids, attention_mask=mask, labels=labels)
        stock.loss.backward()
        stock_grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        handle = patch(model, FULL.model_copy(update={"z_loss": None}))
        mine = model(input_ids=ids, attention_mask=mask, labels=labels)
        mine.loss.backward()
        mine_grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        handle.undo()
        assert sorted(mine_grads) == sorted(stock_grads) and mine_grads
        err = max(float((mine_grads[n] - g).abs().max() / g.abs().max()) for n, g in stock_grads.items())
        lm_head = model.get_output_embeddings()
        results[rank] = (float(stock.loss.detach()), float(mine.loss.detach()), err, type(lm_head.weight).__name__)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tied, lora", [(False, False), (True, False), (False, True)],
                         ids=["untied", "tied", "lora"])
def test_fsdp2_sharded_model_matches_stock(tied, lora):

    results = spawn_ranks(_fsdp2_rank, 2, tied, lora)
    for rank in (0, 1):
        stock, mine, err, weight_type = results[rank]
        assert weight_type == "DTensor"  # the weight is sharded outside the forward
        assert mine == pytest.approx(stock, rel=1e-6)
        assert err <= 1e-5, (rank, err)


@pytest.mark.slow
def test_ddp_trainer_on_two_processes_trains_like_stock(tmp_path):
    """average_tokens_across_devices (the Trainer scales the loss in place by the world size), the
    model output through DDP's pytree round trip, and the callback's cross-rank reduction."""

    result = torchrun("integrations/hf_ddp.py", tmp_path, timeout=600)
    assert result["world"] == 2
    assert result["err"] <= 1e-6
    assert result["mine"] == pytest.approx(result["stock"], rel=1e-6)
    # the logged CE is the step's token mean over both ranks: the Trainer's own loss here
    assert result["ce"] == pytest.approx(result["stock"], rel=1e-5)
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"])


@pytest.mark.slow
def test_trainer_evaluate_and_predict_work_on_a_patched_model(tmp_path):
    model = tiny("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=_Batches())
    stock = trainer.evaluate()["eval_loss"]
    handle = patch(model, FULL)
    callback = attach(trainer, handle)
    assert "metrics" in model.config.keys_to_ignore_at_inference
    mine = trainer.evaluate()  # the callback adds the eval metrics to what evaluate() logs and returns
    assert mine["eval_loss"] == pytest.approx(stock + 1e-3 * mine["eval_z_loss"], rel=1e-5)
    assert 0.0 <= mine["eval_token_accuracy"] <= 1.0
    # token-weighted over the eval set; the Trainer's eval_loss is a mean of batch means
    assert mine["eval_ce"] == pytest.approx(stock, rel=1e-3) and mine["eval_ce"] != stock
    trainer.predict(_Batches())  # collects outputs across batches: the extra fields stay out of "logits"
    handle.undo()
    assert "metrics" not in (getattr(model.config, "keys_to_ignore_at_inference", None) or [])
    assert callback.eval is handle.eval_metrics


def test_a_failing_probe_leaves_the_model_as_it_was():
    model = tiny("llama")

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    model.model.forward = broken
    with pytest.raises(RuntimeError, match="device lost"):
        patch(model)
    assert model.training and "forward" not in model.lm_head.__dict__ and "_headloss_patch" not in model.__dict__


def test_a_model_with_dropout_in_train_mode_is_probed_in_eval_mode_and_left_training():
    model = tiny("llama", attention_dropout=0.5)  # the probe's two runs differ in train mode
    assert model.training
    with patch(model) as handle:
        assert handle.active and model.training
        ids, labels, mask = batch(9)
        model.eval()
        stock = model(input_ids=ids, attention_mask=mask, labels=labels)  # (the patched forward, eval: no dropout)
    want = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert float(stock.loss.detach()) == pytest.approx(float(want.loss.detach()), rel=1e-5)


def test_undo_keeps_a_wrapper_installed_over_the_patch():
    model = tiny("llama")
    ids, labels, mask = batch(8)
    stock = model(input_ids=ids, attention_mask=mask, labels=labels)
    handle = patch(model)
    inner = model.forward

    def outer(*args, **kwargs):  # what accelerate's autocast wrapper does to an instance
        return inner(*args, **kwargs)

    model.forward = outer
    handle.undo()
    assert model.forward is outer  # kept: undo does not drop someone else's wrapper
    again = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert again.logits is not None and torch.equal(again.loss, stock.loss)  # ours passes through now


@pytest.mark.slow
def test_token_weights_reach_the_patched_loss_through_inputs():
    """``handle.inputs(token_weights=...)``: the patched model's loss weighs each row's cross-entropy (row t, which
    predicts labels[:, t + 1]) and divides by the counted tokens, as the stock logits' weighted loss does."""
    model = tiny("llama")
    ids, labels, mask = batch(2)
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) * 2
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    per_row = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                                reduction="none").view(ids.shape[0], -1)
    counted = (labels[:, 1:] != -100).float()
    want = (per_row * w[:, :-1] * counted).sum() / counted.sum()
    want.backward()
    stock_grads = grads(model)
    with patch(model, LossSpec(token_weights={"normalize": "tokens"})) as handle, handle.inputs(token_weights=w):
        mine, mine_grads = run(model, ids, labels, mask)
    assert abs(float(mine.loss.detach()) - float(want.detach())) <= 1e-5 * float(want.detach())
    assert_grads_close(mine_grads, stock_grads, rtol=1e-4)
