"""headloss.integrations.trl against stock TRL on a tiny random model (no downloads, no vLLM)."""

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from headloss import LossSpec, ZLoss  # noqa: E402
from headloss.integrations.trl import HeadLossGRPOTrainer, HeadLossSFTTrainer, grpo_spec, sft_spec  # noqa: E402

VOCAB = 61


def tokenizer():
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<pad>"], vocab["<eos>"] = VOCAB - 2, VOCAB - 1
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=VOCAB - 2,
                                      eos_token_id=VOCAB - 1, bos_token_id=None)
    return transformers.LlamaForCausalLM(config)


def prompts():
    gen = torch.Generator().manual_seed(5)
    rows = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (int(n),), generator=gen))
            for n in torch.randint(2, 6, (16,), generator=gen)]
    return datasets.Dataset.from_dict({"prompt": rows})


def reward(completions, **kwargs):
    """Uneven rewards: the count of tokens w0..w19 in the completion."""
    return [float(sum(1 for w in c.split() if w.startswith("w") and w[1:].isdigit() and int(w[1:]) < 20))
            for c in completions]


def grpo_args(tmp_path, **changes):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=2, learning_rate=5e-2, logging_steps=1, report_to=[], use_cpu=True, seed=0, beta=0.04,
                loss_type="dapo", epsilon_high=0.28, temperature=0.9, save_strategy="no", disable_tqdm=True,
                num_iterations=2, gradient_accumulation_steps=2, bf16=False, optim="sgd")
    base.update(changes)
    return trl.GRPOConfig(**base)


def saved_model(tmp_path) -> str:
    """The tiny model on disk: TRL loads its reference model from the policy's path."""
    path = tmp_path / "tiny"
    if not path.exists():
        tiny_model().save_pretrained(path)
    return str(path)


def grpo(tmp_path, cls=HeadLossGRPOTrainer, **changes):
    return cls(model=saved_model(tmp_path), reward_funcs=reward, args=grpo_args(tmp_path, **changes),
               train_dataset=prompts(), processing_class=tokenizer())


EXTRA = {  # case -> (loss_type, GRPOConfig changes)
    "off_policy_mask": ("dapo", dict(off_policy_mask_threshold=0.002)),
    "top_entropy_quantile": ("grpo", dict(top_entropy_quantile=0.5)),
    "top_entropy_quantile+bonus": ("dapo", dict(top_entropy_quantile=0.5, entropy_coef=0.05)),
    "entropy_bonus-dapo": ("dapo", dict(entropy_coef=0.05)),
    "entropy_bonus-grpo": ("grpo", dict(entropy_coef=0.05)),
    "gspo": ("grpo", dict(importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03)),
    "luspo-sequence": ("luspo", dict(importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03)),
    "cispo-sequence": ("cispo", dict(importance_sampling_level="sequence", epsilon_high=0.3)),
}


# the fast tier: one token-level loss type under autocast, and the objectives of their own
# (CISPO, VESPO); the other loss types and EXTRA's options in the slow tier
TRL_FAST = {("dapo", True), ("cispo", False), ("vespo", False)}


@pytest.mark.parametrize("loss_type, bf16", [
    pytest.param(case, bf16, marks=() if (case, bf16) in TRL_FAST else pytest.mark.slow)
    for case, bf16 in [("dapo", False), ("grpo", False), ("bnpo", False), ("dr_grpo", False), ("dapo", True),
                       ("cispo", False), ("sapo", False), ("luspo", False), ("vespo", False),
                       *((case, False) for case in EXTRA)]])
def test_grpo_loss_gradient_and_metrics_equal_trls_on_the_same_batch(tmp_path, loss_type, bf16):
    """fp32, and under TRL's bf16 autocast (CPU): the GEMMs round to bf16 in a different order
    there, so gradients agree to bf16 precision only."""
    case = loss_type
    loss_type, extra = EXTRA.get(case, (case, {}))
    options = dict(delta=1.5 if loss_type == "bnpo" else None, **extra)
    if loss_type == "cispo":
        options.setdefault("epsilon_high", 1.05)  # CISPO's cap is absolute (TRL recommends 5.0): some above it
    if loss_type == "sapo":
        options.update(sapo_temperature_pos=2.0, sapo_temperature_neg=0.7)
    trainer = grpo(tmp_path, loss_type=loss_type, bf16=bf16, **options)
    tol = 3e-2 if bf16 else 1e-4
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # as train() sets it
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._prepare_inputs(batch)
    assert inputs["old_per_token_logps"] is not None and inputs["ref_per_token_logps"] is not None
    with torch.no_grad():  # the policy moved since the rollout: ratios away from 1, some clipped
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)

    def run(method):
        trainer._metrics["train"].clear()
        model.zero_grad(set_to_none=True)
        loss = method(trainer, model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}

    stock_loss, stock_grads, stock_metrics = run(trl.GRPOTrainer._compute_loss)
    mine_loss, mine_grads, mine_metrics = run(HeadLossGRPOTrainer._compute_loss)
    assert float(mine_loss) == pytest.approx(float(stock_loss), rel=tol / 10, abs=1e-7)
    for name, g in stock_grads.items():
        err = (mine_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err <= tol, (name, float(err))
    assert set(mine_metrics) == set(stock_metrics)
    for name, values in stock_metrics.items():
        assert mine_metrics[name] == pytest.approx(values, rel=tol / 10, abs=1e-6), name
    clipped = {"cispo": "cispo_clip_ratio", "sapo": "entropy", "vespo": "vespo/phi_seq_mean"}.get(
        loss_type, "clip_ratio/region_mean")
    assert stock_metrics[clipped][0] > 0, "the batch should clip some ratios, or the test is weak"



EDGES = {  # case -> (GRPOConfig changes, how the batch is changed)
    "sequence-token_advantages": (dict(importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03),
                                  "token_advantages"),
    "sequence-empty_completion": (dict(importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.03),
                                  "all_low_clipped"),
    "token-delta_below_the_clip": (dict(delta=1.05, epsilon_high=0.28), "all_high_clipped"),
}


@pytest.mark.slow  # (TRL's GRPO loss, gradient and metrics on one batch: the fast tier's test_grpo_loss_...)
@pytest.mark.parametrize("case", list(EDGES))
def test_grpo_clip_metrics_equal_trls_at_their_edges(tmp_path, case):
    """TRL's own _compute_loss on batches at the edges of its clip metrics: [B, T] advantages under
    sequence-level ratios (its indicators are [B, T]: token means), a fully masked completion with every
    other one low-clipped (masked_seq_mean gives it 0: clip_ratio/low_min 0), and delta below
    1 + epsilon_high (the high indicator reads the ratio capped at delta: 0)."""
    options, change = EDGES[case]
    trainer = grpo(tmp_path, loss_type="grpo", **options)
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    adv, old, mask = inputs["advantages"], inputs["old_per_token_logps"], inputs["completion_mask"]
    with torch.no_grad():  # the policy moved since the rollout: ratios away from 1
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    if change == "token_advantages":
        inputs["advantages"] = adv[:, None] + torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    elif change == "all_low_clipped":  # A < 0 and every ratio e^-0.5
        inputs["advantages"] = -adv.abs() - 0.1
        inputs["old_per_token_logps"] = old + 0.5
        mask[1] = 0
    else:  # A > 0 and every ratio e^0.5, above 1 + epsilon_high but capped at delta
        inputs["advantages"] = adv.abs() + 0.1
        inputs["old_per_token_logps"] = old - 0.5

    def run(method):
        trainer._metrics["train"].clear()
        model.zero_grad(set_to_none=True)
        loss = method(trainer, model, inputs)
        loss.backward()
        return loss.detach(), {k: list(v) for k, v in trainer._metrics["train"].items()}

    stock_loss, stock_metrics = run(trl.GRPOTrainer._compute_loss)
    mine_loss, mine_metrics = run(HeadLossGRPOTrainer._compute_loss)
    assert float(mine_loss) == pytest.approx(float(stock_loss), rel=1e-5, abs=1e-7)
    for name, values in stock_metrics.items():
        assert mine_metrics[name] == pytest.approx(values, rel=1e-5, abs=1e-6), name
    if change != "all_high_clipped":  # (there every ratio is above 1 + epsilon_high: TRL counts none of them)
        assert stock_metrics["clip_ratio/region_mean"][0] > 0, "the batch should clip some ratios, or the test is weak"
    if change == "all_low_clipped":
        assert stock_metrics["clip_ratio/low_min"] == [0.0] and stock_metrics["clip_ratio/low_mean"][0] > 0.5
    if change == "all_high_clipped":
        assert stock_metrics["clip_ratio/high_mean"] == [0.0]

@pytest.mark.slow
def test_grpo_two_training_steps_match_trl(tmp_path):
    stock = grpo(tmp_path / "stock", cls=trl.GRPOTrainer)
    stock.train()
    mine = grpo(tmp_path / "mine")
    mine.train()
    for (name, p), q in zip(stock.model.named_parameters(), mine.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    stock_logs = [h for h in stock.state.log_history if "loss" in h]
    mine_logs = [h for h in mine.state.log_history if "loss" in h]
    assert len(stock_logs) == len(mine_logs) == 2
    skip = {"step_time"}  # wall time
    for s, m in zip(stock_logs, mine_logs):
        assert set(m) == set(s)
        for key, value in s.items():
            if key in skip or not isinstance(value, (int, float)):
                continue
            assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def fake_trainer(**changes):
    """The attributes grpo_spec reads from a GRPOTrainer (no model)."""
    attributes = dict(loss_type="dr_grpo", importance_sampling_level="token", top_entropy_quantile=1.0,
                      off_policy_mask_threshold=None, _entropy_bonus_enabled=False, epsilon_low=0.1,
                      epsilon_high=0.3, beta=0.02, max_completion_length=64, temperature=0.7,
                      args=type("A", (), dict(delta=2.0, use_bias_correction_kl=True))())
    return type("T", (), {**attributes, **changes})()


@pytest.mark.parametrize("changes, option", [
    (dict(loss_type="no-such-type"), "loss_type"),
    (dict(importance_sampling_level="group"), "importance_sampling_level"),
])
def test_grpo_options_without_a_mapping_are_refused(changes, option):
    with pytest.raises(ValueError, match=f"{option}: .* has no headloss mapping yet"):
        grpo_spec(fake_trainer(**changes))


def test_sft_refuses_deepspeed_sequence_parallelism(tmp_path, monkeypatch):
    import headloss.integrations.trl as integration
    from headloss.integrations.trl import refuse_sequence_parallel

    def accelerator(**config):
        return type("Acc", (), {"parallelism_config": type("P", (), config)() if config else None})()

    refuse_sequence_parallel(accelerator())
    refuse_sequence_parallel(accelerator(sp_enabled=False, sp_backend="deepspeed"))
    refuse_sequence_parallel(accelerator(sp_enabled=True, sp_backend="other"))
    with pytest.raises(ValueError, match="parallelism_config: DeepSpeed sequence parallelism"):
        refuse_sequence_parallel(accelerator(sp_enabled=True, sp_backend="deepspeed"))
    # the trainer asks it about its own accelerator
    seen = []
    monkeypatch.setattr(integration, "refuse_sequence_parallel", seen.append)
    trainer = sft(tmp_path, HeadLossSFTTrainer)
    assert seen == [trainer.accelerator]


@pytest.mark.slow
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_grpo_adaptive_entropy_training_matches_trl(tmp_path, quantile):
    """TRL's adaptive entropy controller: two optimizer steps (accumulation 2), the coefficient moved
    by the window's entropy against the target (with the top-entropy mask: of its tokens), the same
    weights and logs as stock TRL."""
    options = dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=4.5, entropy_coef_delta=0.02,
                   max_steps=3, top_entropy_quantile=quantile)
    stock = grpo(tmp_path / "stock", cls=trl.GRPOTrainer, **options)
    stock.train()
    mine = grpo(tmp_path / "mine", **options)
    mine.train()
    assert mine.entropy_coef == pytest.approx(stock.entropy_coef) and stock.entropy_coef != 0.05
    assert mine._last_world_entropy == pytest.approx(stock._last_world_entropy, rel=1e-5)
    for (name, p), q in zip(stock.model.named_parameters(), mine.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    stock_logs = [h for h in stock.state.log_history if "loss" in h]
    mine_logs = [h for h in mine.state.log_history if "loss" in h]
    for s, m in zip(stock_logs, mine_logs):
        assert set(m) == set(s)
        for key, value in s.items():
            if key != "step_time" and isinstance(value, (int, float)):
                assert m[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_grpo_spec_maps_the_config():
    spec = grpo_spec(fake_trainer())
    p = spec.policy
    assert (p.loss_type, p.eps_low, p.eps_high, p.delta, p.kl_beta, p.kl_importance_correction,
            p.max_completion_length) == ("dr_grpo", 0.1, 0.3, 2.0, 0.02, True, 64)
    assert spec.transform.temperature == 0.7 and spec.cross_entropy is None


# --- SFT ---------------------------------------------------------------------------------------


def sft_dataset():
    gen = torch.Generator().manual_seed(7)
    rows = [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (int(n),), generator=gen))
            for n in torch.randint(3, 12, (12,), generator=gen)]
    return datasets.Dataset.from_dict({"text": rows})


def sft(tmp_path, cls, spec=None, **changes):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=5e-2, logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                disable_tqdm=True, max_length=16, optim="sgd", bf16=False)
    args.update(changes)
    kwargs = {} if spec is None else {"spec": spec}
    return cls(model=tiny_model(), args=trl.SFTConfig(**args), train_dataset=sft_dataset(),
               processing_class=tokenizer(), **kwargs)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`label_smoothing_factor` is deprecated:FutureWarning")  # TRL's own
@pytest.mark.parametrize("changes", [{}, {"loss_type": "dft"}, {"label_smoothing_factor": 0.1}],
                         ids=["nll", "dft", "smoothing"])
def test_sft_training_matches_trl_and_logs_its_metrics(tmp_path, changes):
    stock = sft(tmp_path / "stock", trl.SFTTrainer, **changes)
    stock.train()
    mine = sft(tmp_path / "mine", HeadLossSFTTrainer, **changes)
    mine.train()
    for (name, p), q in zip(stock.model.named_parameters(), mine.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    stock_logs = [h for h in stock.state.log_history if "loss" in h]
    mine_logs = [h for h in mine.state.log_history if "loss" in h]
    assert len(stock_logs) == len(mine_logs) == 2
    for s, m in zip(stock_logs, mine_logs):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm"):
            assert m[key] == pytest.approx(s[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_sft_with_a_richer_spec_logs_its_extra_metrics(tmp_path):
    spec = LossSpec(z_loss=ZLoss(weight=1e-3), entropy={"weight": 0.0}, token_accuracy=True)
    trainer = sft(tmp_path, HeadLossSFTTrainer, spec=spec)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all({"z_loss", "ce", "entropy", "mean_token_accuracy"} <= set(h) for h in logs)


def test_sft_spec_maps_the_config():
    nll = sft_spec(type("A", (), {"loss_type": "nll", "label_smoothing_factor": 0.1})())
    assert nll.cross_entropy.label_smoothing == 0.1
    assert sft_spec(type("A", (), {"loss_type": "dft", "label_smoothing_factor": 0.0})()).dft is not None
    with pytest.raises(ValueError, match="loss_type"):
        sft_spec(type("A", (), {"loss_type": "chunked_nll", "label_smoothing_factor": 0.0})())


@pytest.mark.slow
def test_two_processes_reduce_metrics_as_trl_does(tmp_path):
    """GRPO and SFT on 2 gloo processes (DDP): weights and every logged value equal stock TRL's,
    whose metrics are reduced across processes (gather / reduce) as it does, and whose top-entropy
    quantile is over both processes' tokens."""
    from conftest import torchrun

    tiny_model().save_pretrained(tmp_path / "tiny")
    result = torchrun("integrations/trl_ddp.py", tmp_path)
    assert result["world"] == 2
    # gspo, vespo: sequence means across processes; top_entropy: TRL's quantile over both processes'
    # tokens (the lm_head's guessed-mask route; with the bonus, deferred mode)
    for name in ("grpo", "gspo", "vespo", "top_entropy", "top_entropy+bonus", "sft"):
        run = result[name]
        assert run["err"] <= 1e-5, name
        assert len(run["stock"]) == len(run["mine"]) == 2
        for stock, mine in zip(run["stock"], run["mine"]):
            assert set(mine) == set(stock), name
            for key, value in stock.items():
                assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
