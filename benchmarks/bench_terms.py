"""Distillation and GRPO cases, fwd+bwd, bf16, V=128256, one run: headloss vs torch eager,
torch.compile, Liger-Kernel and TRL.

  distill  N=8192: student CE + forward KL(teacher || student), 0.5 / 0.5, T=1
           Liger: its in-place CE + LigerKLDIVLoss on torch log-softmaxes
  grpo     B=8, T=1024: TRL's dapo loss, beta 0.04 (k3), eps 0.2, plus the entropy, KL and clip
           metrics a trainer logs; Liger: triton_grpo_loss (+ a chunked entropy pass; and alone)
  forms    N=8192: each divergence (forward KL, reverse KL, JSD) with the teacher's logits and with
           its probabilities (teacher: probs, validated and validate=False), CE 0.5 + divergence
           0.5; and the GRPO case with a per-row temperature, validated and validate=False
  weights  N=8192: CE, and CE 0.5 + forward KL 0.5, with and without per-token weights (token_weights,
           a weighted mean; validated and validate=False); torch eager and torch.compile's weighted CE;
           and the GRPO case with and without them
  trainer  the same GRPO step the way trainers call it, from the model's [B, L + 1, V] logits
           against the completion ids [B, L] (eps 0.2 / 0.28): headloss shift=True (default
           arguments, and with inplace_grad), headloss on logits[:, :-1] (a slice: autograd's
           slice backward allocates and fills a full-size gradient), Liger triton_grpo_loss (full
           logits, no entropy), TRL 1.16's fused log-prob + entropy kernel with its loss in torch

  python -m benchmarks.bench_terms

Writes $OUT (or ./results)/bench_terms.{json,csv,png}; prints a table with the ratio to the floor
(distill: student and teacher read twice + gradient written once; grpo: 2 reads + 1 write).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import headloss
from benchmarks.bench_head import chunked_entropy, restorable_leaf
from benchmarks.common import Row, copy_bandwidth_gbs, measure, out_dir_default, pyplot, write_rows

V = 128256
BETA, EPS = 0.04, 0.2
DISTILL_SPEC = headloss.LossSpec(
    cross_entropy={"weight": 0.5}, distillation={"weight": 0.5, "divergence": "forward_kl"}
)
GRPO_SPEC = headloss.LossSpec(
    cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": BETA, "kl_estimator": "k3", "eps_low": EPS,
                                "eps_high": EPS},
)
DISTILL_PROBS_SPEC = headloss.LossSpec(
    cross_entropy={"weight": 0.5}, distillation={"weight": 0.5, "divergence": "forward_kl", "teacher": "probs"}
)
ROW_TEMPERATURE = headloss.LogitTransform(per_row_temperature=True)
DISTILL_ROW_T_SPEC = DISTILL_SPEC.model_copy(update={"transform": ROW_TEMPERATURE})
GRPO_ROW_T_SPEC = GRPO_SPEC.model_copy(update={"transform": ROW_TEMPERATURE})
"""The same calls with each row at its own temperature (the call's ``temperature``): its cost beside the
plain call in the same run (the specs made once, outside the timed steps)."""


def torch_distill(x, t, y):
    s_logp = torch.log_softmax(x.float(), dim=-1)
    with torch.no_grad():
        t_logp = torch.log_softmax(t.float(), dim=-1)
    valid = y != -100
    n = valid.sum().clamp(min=1)
    ce = F.nll_loss(s_logp, y, ignore_index=-100, reduction="sum") / n
    kl = (F.kl_div(s_logp, t_logp, reduction="none", log_target=True).sum(-1) * valid).sum() / n
    return 0.5 * ce + 0.5 * kl


def torch_grpo(x, ids, adv, old, ref, mask):
    """TRL GRPOTrainer._compute_loss (dapo, beta, k3) and the metrics it logs."""
    logp_all = torch.log_softmax(x.float(), dim=-1)
    logp = logp_all.gather(-1, ids[..., None])[..., 0]
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - EPS, 1 + EPS)
    per_token = -torch.min(ratio * adv[:, None], clipped * adv[:, None])
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = per_token + BETA * kl
    count = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / count
    with torch.no_grad():
        entropy = (-(logp_all.exp() * logp_all).sum(-1) * mask).sum() / count
        low = ((ratio < 1 - EPS) & (adv[:, None] < 0)).float()
        high = ((ratio > 1 + EPS) & (adv[:, None] > 0)).float()
        stats = torch.stack([(kl * mask).sum() / count, entropy, (low * mask).sum() / count,
                             (high * mask).sum() / count])
    return loss, stats


def distill_case(rows: list[Row], n: int, cfg: dict, names) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    teacher = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    y[torch.rand(n, device="cuda", generator=gen) < 0.05] = -100
    x, setup = restorable_leaf(pristine)
    temperatures = 0.6 + 0.8 * torch.rand(n, device="cuda", generator=gen)
    teacher_probs = torch.softmax(teacher.float(), -1).to(torch.bfloat16)
    compiled = torch.compile(torch_distill)
    table = {
        "torch-eager": lambda: torch_distill(x, teacher, y).backward(),
        "torch-compile": lambda: compiled(x, teacher, y).backward(),
        "headloss": lambda: headloss.head_loss(x, y, DISTILL_SPEC, teacher_logits=teacher,
                                               inplace_grad=True).loss.backward(),
        "headloss, per-row temperature": lambda: headloss.head_loss(
            x, y, DISTILL_ROW_T_SPEC, teacher_logits=teacher, temperature=temperatures,
            inplace_grad=True).loss.backward(),
        "headloss, teacher probabilities": lambda: headloss.head_loss(
            x, y, DISTILL_PROBS_SPEC, teacher_probs=teacher_probs, inplace_grad=True).loss.backward(),
    }
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.kl_div import LigerKLDivLossFunction

        def liger():
            s_logp = torch.log_softmax(x.float(), dim=-1)
            with torch.no_grad():
                t_logp = torch.log_softmax(teacher.float(), dim=-1)
            kl = LigerKLDivLossFunction.apply(s_logp, t_logp, "batchmean", True, 1e-10)
            ce = LigerCrossEntropyFunction.apply(x, y, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]
            (0.5 * ce + 0.5 * kl).backward()

        table["liger CE + KLDiv"] = liger

        def liger_probs():  # Liger's KL with the teacher's probabilities (log_target=False)
            s_logp = torch.log_softmax(x.float(), dim=-1)
            kl = LigerKLDivLossFunction.apply(s_logp, teacher_probs.float(), "batchmean", False, 1e-10)
            ce = LigerCrossEntropyFunction.apply(x, y, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]
            (0.5 * ce + 0.5 * kl).backward()

        table["liger CE + KLDiv, teacher probabilities"] = liger_probs
    except Exception as exc:
        print(f"liger unavailable: {exc}")
    for name, step in table.items():
        if not names or name in names:
            measure(rows, "distill", name, "N", n, step, setup, config={**cfg, "N": n, "V": V})
            torch.cuda.empty_cache()


def forms_case(rows: list[Row], n: int, cfg: dict, names) -> None:
    """What a teacher given as probabilities and a per-row temperature cost beside the same call
    without them (the time of the step; the specs made once, outside the timed steps)."""
    _forms_distill(rows, n, cfg, names)
    torch.cuda.empty_cache()
    _forms_grpo(rows, 8, 1024, cfg, names)


def _forms_distill(rows: list[Row], n: int, cfg: dict, names) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    teacher = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    teacher_probs = torch.softmax(teacher.float(), -1).to(torch.bfloat16)
    x, setup = restorable_leaf(pristine)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        given = {"weight": 0.5, "divergence": divergence}
        logits_spec = headloss.LossSpec(cross_entropy={"weight": 0.5}, distillation=given)
        probs_spec = headloss.LossSpec(cross_entropy={"weight": 0.5}, distillation={**given, "teacher": "probs"})
        table = {
            "teacher logits": lambda spec=logits_spec: headloss.head_loss(
                x, y, spec, teacher_logits=teacher, inplace_grad=True).loss.backward(),
            "teacher probabilities": lambda spec=probs_spec: headloss.head_loss(
                x, y, spec, teacher_probs=teacher_probs, inplace_grad=True).loss.backward(),
            "teacher probabilities, validate=False": lambda spec=probs_spec: headloss.head_loss(
                x, y, spec, teacher_probs=teacher_probs, validate=False, inplace_grad=True).loss.backward(),
        }
        for name, step in table.items():
            if not names or name in names:
                measure(rows, f"distill {divergence}", name, "N", n, step, setup, config={**cfg, "N": n, "V": V})


SFT_SPEC = headloss.LossSpec()
WEIGHTED = headloss.TokenWeights()
SFT_WEIGHTED_SPEC = SFT_SPEC.model_copy(update={"token_weights": WEIGHTED})
DISTILL_WEIGHTED_SPEC = DISTILL_SPEC.model_copy(update={"token_weights": WEIGHTED})
GRPO_WEIGHTED_SPEC = GRPO_SPEC.model_copy(update={"token_weights": WEIGHTED})
"""The same calls with per-token weights (the call's ``token_weights``), made once outside the timed steps."""


def torch_weighted_ce(x, y, w):
    per_token = F.cross_entropy(x.float(), y, ignore_index=-100, reduction="none")
    return (per_token * w).sum() / (w * (y != -100)).sum()


def weights_case(rows: list[Row], n: int, cfg: dict, names) -> None:
    """What per-token weights cost beside the same call without them."""
    _weights_logits(rows, n, cfg, names)
    torch.cuda.empty_cache()
    _weights_grpo(rows, 8, 1024, cfg, names)


def _weights_logits(rows: list[Row], n: int, cfg: dict, names) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    teacher = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    y[torch.rand(n, device="cuda", generator=gen) < 0.05] = -100
    w = 2 * torch.rand(n, device="cuda", generator=gen)
    x, setup = restorable_leaf(pristine)
    compiled = torch.compile(torch_weighted_ce)
    for case, plain, weighted, given in (("sft", SFT_SPEC, SFT_WEIGHTED_SPEC, {}),
                                         ("distill", DISTILL_SPEC, DISTILL_WEIGHTED_SPEC, {"teacher_logits": teacher})):
        given = {**given, "inplace_grad": True}
        table = beside("token weights",
                       lambda spec=plain, given=given, **kw: headloss.head_loss(x, y, spec, **given, **kw),
                       lambda spec=weighted, given=given, **kw: headloss.head_loss(x, y, spec, token_weights=w,
                                                                                   **given, **kw))
        if case == "sft":
            table["torch-eager weighted CE"] = lambda: torch_weighted_ce(x, y, w).backward()
            table["torch-compile weighted CE"] = lambda: compiled(x, y, w).backward()
        for name, step in table.items():
            if not names or name in names:
                measure(rows, f"weights {case}", name, "N", n, step, setup, config={**cfg, "N": n, "V": V})
                torch.cuda.empty_cache()


def _weights_grpo(rows: list[Row], batch: int, length: int, cfg: dict, names) -> None:
    w = 2 * torch.rand((batch, length), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    _grpo_beside(rows, "weights grpo", ("token weights", GRPO_WEIGHTED_SPEC, {"token_weights": w}), (batch, length),
                 cfg, names)


SELECTED_SPEC = SFT_SPEC.model_copy(update={"outputs": ("selected_logprobs",)})
DEFERRED_SPEC = SFT_SPEC.model_copy(update={"outputs": ("logprobs",), "differentiable_outputs": True})
DEFERRED_SELECTED_SPEC = SFT_SPEC.model_copy(update={"outputs": ("logprobs", "selected_logprobs"),
                                                      "differentiable_outputs": True})
"""The calls with the selected ids' log-probs (the call's ``selected_ids``), made once outside the timed steps."""


def torch_selected(x, y, ids):
    """torch eager: the cross-entropy and the selected ids' log-probs (-1: none) from one log_softmax."""
    logp = torch.log_softmax(x.float(), -1)
    picked = torch.where(ids >= 0, logp.gather(-1, ids.clamp(min=0)), 0.0)
    return F.nll_loss(logp, y, ignore_index=-100), picked


def selected_case(rows: list[Row], n: int, cfg: dict, names) -> None:
    """What the selected ids' log-probs cost beside the same call without them: K = 8 and 64, their values
    only (fused mode), and with their gradient (deferred mode, against the deferred call whose per-token
    log-probs take a gradient)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    y[torch.rand(n, device="cuda", generator=gen) < 0.05] = -100
    x, setup = restorable_leaf(pristine)
    for k in (8, 64):
        ids = torch.randint(-1, V, (n, k), device="cuda", generator=gen)
        g = torch.randn(n, k, device="cuda", generator=gen)
        g_tok = torch.randn(n, device="cuda", generator=gen)
        table = beside(f"selected K={k}",
                       lambda **kw: headloss.head_loss(x, y, SFT_SPEC, inplace_grad=True, **kw),
                       lambda ids=ids, **kw: headloss.head_loss(x, y, SELECTED_SPEC, selected_ids=ids,
                                                                inplace_grad=True, **kw))

        def deferred(selected: bool, ids=ids, g=g, g_tok=g_tok):
            def run():
                if selected:
                    out = headloss.head_loss(x, y, DEFERRED_SELECTED_SPEC, selected_ids=ids, inplace_grad=True)
                    total = out.loss + (out.logprobs * g_tok).sum() + (out.selected_logprobs * g).sum()
                else:
                    out = headloss.head_loss(x, y, DEFERRED_SPEC, inplace_grad=True)
                    total = out.loss + (out.logprobs * g_tok).sum()
                total.backward()
            return run

        table["deferred, gradient on logprobs"] = deferred(False)
        table[f"deferred, gradient on logprobs + selected K={k}"] = deferred(True)

        def eager(ids=ids, g=g):
            loss, picked = torch_selected(x, y, ids)
            (loss + (picked * g).sum()).backward()

        table[f"torch-eager CE + selected K={k}"] = eager
        for name, step in table.items():
            if not names or name in names:
                measure(rows, f"selected K={k}", name, "N", n, step, setup, config={**cfg, "N": n, "V": V, "K": k})
                torch.cuda.empty_cache()


TOPK_SPECS = {k: SFT_SPEC.model_copy(update={"student_topk": k, "outputs": ("topk_ids", "topk_logprobs")})
              for k in (8, 64)}
"""The calls with the student's top-k (student_topk), made once outside the timed steps."""


def topk_case(rows: list[Row], n: int, cfg: dict, names) -> None:
    """What the student's top-k costs beside the same call without it (k 8 and 64; the issue's budget: 10% and
    25%), and torch's log_softmax + topk after the same CE."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pristine = torch.randn(n, V, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    y = torch.randint(0, V, (n,), device="cuda", generator=gen)
    y[torch.rand(n, device="cuda", generator=gen) < 0.05] = -100
    x, setup = restorable_leaf(pristine)
    for k, spec in TOPK_SPECS.items():
        table = beside(f"top-{k}", lambda **kw: headloss.head_loss(x, y, SFT_SPEC, inplace_grad=True, **kw),
                       lambda spec=spec, **kw: headloss.head_loss(x, y, spec, inplace_grad=True, **kw))

        def eager(k=k):
            logp = torch.log_softmax(x.float(), -1)
            logp.detach().topk(k, dim=-1)
            F.nll_loss(logp, y, ignore_index=-100).backward()

        table[f"torch-eager CE + topk({k})"] = eager
        for name, step in table.items():
            if not names or name in names:
                measure(rows, f"top-k {k}", name, "N", n, step, setup, config={**cfg, "N": n, "V": V, "k": k})
                torch.cuda.empty_cache()


def _forms_grpo(rows: list[Row], batch: int, length: int, cfg: dict, names) -> None:
    temperatures = torch.linspace(0.7, 1.3, batch, device="cuda")
    _grpo_beside(rows, "grpo", ("per-row temperature", GRPO_ROW_T_SPEC, {"temperature": temperatures}),
                 (batch, length), cfg, names, num_items=True)


def _grpo_beside(rows: list[Row], case: str, option: tuple, size: tuple[int, int], cfg: dict, names,
                 num_items: bool = False) -> None:
    """The GRPO step (grpo_batch) beside the same step with ``option`` (its name, spec and inputs), each
    validated and with validate=False; ``num_items``: num_items_in_batch is the completion mask's sum."""
    name, spec, given = option
    batch, length = size
    pristine, ids, adv, old, ref, mask = grpo_batch(1, batch, length)
    x, setup = restorable_leaf(pristine[:, :-1])
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, inplace_grad=True)
    if num_items:
        inputs["num_items_in_batch"] = mask.sum()
    table = beside(name, lambda **kw: headloss.head_loss(x, ids, GRPO_SPEC, **inputs, **kw),
                   lambda **kw: headloss.head_loss(x, ids, spec, **given, **inputs, **kw))
    for provider, step in table.items():
        if not names or provider in names:
            measure(rows, case, provider, "N", batch * length, step, setup,
                    config={**cfg, "B": batch, "T": length, "V": V})


def beside(option: str, plain, given) -> dict:
    """Timed steps of a call beside the same call with ``option``: ``plain`` / ``given`` (keyword arguments
    -> the call's output), each validated and with validate=False, the backward of its loss."""
    return {"plain": lambda: plain().loss.backward(), option: lambda: given().loss.backward(),
            "plain, validate=False": lambda: plain(validate=False).loss.backward(),
            f"{option}, validate=False": lambda: given(validate=False).loss.backward()}


def grpo_batch(seed: int, batch: int, length: int, vocab: int = V):
    """The model's [B, L + 1, V] logits, completion ids, advantages, old / ref log-probs near the
    current ones, and a completion mask ending each sequence at 90% of L."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pristine = torch.randn(batch, length + 1, vocab, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    ids = torch.randint(0, vocab, (batch, length), device="cuda", generator=gen)
    adv = torch.randn(batch, device="cuda", generator=gen)
    with torch.no_grad():
        logp = torch.log_softmax(pristine[:, :-1].float(), -1).gather(-1, ids[..., None])[..., 0]
    old = logp + 0.1 * torch.randn(logp.shape, device="cuda", generator=gen)
    ref = logp + 0.1 * torch.randn(logp.shape, device="cuda", generator=gen)
    mask = torch.ones(batch, length, device="cuda")
    mask[:, int(length * 0.9):] = 0
    return pristine, ids, adv, old, ref, mask


def grpo_case(rows: list[Row], batch: int, length: int, cfg: dict, names) -> None:
    pristine, ids, adv, old, ref, mask = grpo_batch(1, batch, length)
    x_full = torch.empty_like(pristine).requires_grad_()  # Liger wants [B, L + 1, V]
    x = torch.empty_like(pristine[:, :-1]).requires_grad_()

    def setup():
        x.grad = x_full.grad = None
        with torch.no_grad():
            x.copy_(pristine[:, :-1])
            x_full.copy_(pristine)

    compiled = torch.compile(torch_grpo)
    n_items = mask.sum()
    temperatures = torch.linspace(0.7, 1.3, batch, device="cuda")  # one per sequence
    table = {
        "torch-eager": lambda: torch_grpo(x, ids, adv, old, ref, mask)[0].backward(),
        "torch-compile": lambda: compiled(x, ids, adv, old, ref, mask)[0].backward(),
        "headloss": lambda: headloss.head_loss(
            x, ids, GRPO_SPEC, advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask,
            num_items_in_batch=n_items, inplace_grad=True).loss.backward(),
        "headloss, per-row temperature": lambda: headloss.head_loss(
            x, ids, GRPO_ROW_T_SPEC, advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask,
            num_items_in_batch=n_items, temperature=temperatures, inplace_grad=True).loss.backward(),
    }
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def liger(with_entropy: bool):
            def step():
                if with_entropy:
                    chunked_entropy(x_full.detach()[:, :-1].reshape(-1, V), ids.reshape(-1))
                loss, _ = triton_grpo_loss(x_full, old, ref, ids, adv, mask, temperature=1.0, beta=BETA,
                                           eps_low=EPS, eps_high=EPS, inplace=True, loss_type="dapo",
                                           reduce=True, num_items_in_batch=n_items)
                loss.backward()

            return step

        table["liger triton_grpo_loss"] = liger(False)
        table["liger triton_grpo_loss + entropy"] = liger(True)
    except Exception as exc:
        print(f"liger unavailable: {exc}")
    for name, step in table.items():
        if not names or name in names:
            measure(rows, "grpo", name, "N", batch * length, step, setup,
                    config={**cfg, "B": batch, "T": length, "V": V})
            torch.cuda.empty_cache()


TRAINER_SPEC = headloss.LossSpec(
    cross_entropy=None, policy={"loss_type": "dapo", "kl_beta": BETA, "kl_estimator": "k3", "eps_low": EPS,
                                "eps_high": 0.28},
)


def trl_logprob_entropy():
    """TRL 1.16's fused selective log-softmax + entropy kernel, loaded from its file (importing the
    trl package pulls accelerate and datasets)."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("trl is not installed")
    path = f"{spec.submodule_search_locations[0]}/kernels/logprob_entropy.py"
    module_spec = importlib.util.spec_from_file_location("trl_logprob_entropy", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.selective_log_softmax_and_entropy


def trainer_case(rows: list[Row], batch: int, length: int, cfg: dict, names) -> None:
    pristine, ids, adv, old, ref, mask = grpo_batch(2, batch, length)
    logits = torch.empty_like(pristine).requires_grad_()  # the model's output: [B, L + 1, V]

    def setup():
        logits.grad = None
        with torch.no_grad():
            logits.copy_(pristine)

    n_items = mask.sum()
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, num_items_in_batch=n_items)
    table = {
        "headloss shift=True": lambda: headloss.head_loss(logits, ids, TRAINER_SPEC, shift=True,
                                                          **inputs).loss.backward(),
        "headloss shift=True, inplace_grad": lambda: headloss.head_loss(
            logits, ids, TRAINER_SPEC, shift=True, inplace_grad=True, **inputs).loss.backward(),
        "headloss on logits[:, :-1]": lambda: headloss.head_loss(logits[:, :-1], ids, TRAINER_SPEC,
                                                                 **inputs).loss.backward(),
    }
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        def liger():
            loss, _ = triton_grpo_loss(logits, old, ref, ids, adv, mask, temperature=1.0, beta=BETA, eps_low=EPS,
                                       eps_high=0.28, inplace=True, loss_type="dapo", reduce=True,
                                       num_items_in_batch=n_items)
            loss.backward()

        table["liger triton_grpo_loss (no entropy)"] = liger
    except Exception as exc:
        print(f"liger unavailable: {exc}")
    try:
        fused = trl_logprob_entropy()

        def trl():
            per_token_logps, entropy = fused(logits[:, :-1], ids)
            ratio = torch.exp(per_token_logps - old)
            per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - EPS, 1 + 0.28) * adv[:, None])
            kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            loss = ((per_token + BETA * kl) * mask).sum() / n_items
            with torch.no_grad():
                torch.stack([(entropy * mask).sum() / n_items, (kl * mask).sum() / n_items])
            loss.backward()

        table["TRL 1.16 logprob+entropy kernel + torch loss"] = trl
    except Exception as exc:
        print(f"TRL kernel unavailable: {type(exc).__name__}: {exc}")
    for name, step in table.items():
        if not names or name in names:
            measure(rows, "trainer", name, "N", batch * length, step, setup,
                    config={**cfg, "B": batch, "L": length, "V": V})
            torch.cuda.empty_cache()


def floor_ms(case: str, n: int, copy_gbs: float) -> float:
    streams = 5 if "distill" in case else 3  # distill: 2 student + 2 teacher reads + 1 write
    return streams * n * V * 2 / (copy_gbs * 1e9) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", nargs="*")
    parser.add_argument("--stem", default="bench_terms")
    parser.add_argument("--cases", nargs="*", default=["distill", "grpo", "trainer"],
                        help="distill, grpo, trainer, forms, weights, selected, topk")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    cfg = {"dtype": "bf16", "copy_GBps": round(copy_gbs, 1), "headloss": headloss.__version__}
    rows: list[Row] = []
    cases = {"distill": lambda: distill_case(rows, 8192, cfg, args.providers),
             "grpo": lambda: grpo_case(rows, 8, 1024, cfg, args.providers),
             "trainer": lambda: trainer_case(rows, 8, 1024, cfg, args.providers),
             "forms": lambda: forms_case(rows, 8192, cfg, args.providers),
             "weights": lambda: weights_case(rows, 8192, cfg, args.providers),
             "selected": lambda: selected_case(rows, 8192, cfg, args.providers),
             "topk": lambda: topk_case(rows, 8192, cfg, args.providers)}
    for case in args.cases:
        cases[case]()
    out = out_dir_default()
    js, cs = write_rows(rows, out, args.stem)
    mem = {(r.case, r.provider): r.p50 for r in rows if r.metric == "memory"}
    print(f"\ncopy rate {copy_gbs:.0f} GB/s")
    wc = max([9] + [len(r.case) + 1 for r in rows])
    wp = max([36] + [len(r.provider) + 1 for r in rows])
    print(f"{'case':<{wc}}{'provider':<{wp}}{'p50 ms':>9}{'x floor':>9}{'extra GB':>10}  note")
    for r in rows:
        if r.metric == "time":
            t = f"{r.p50:9.3f}{r.p50 / floor_ms(r.case, r.x, copy_gbs):9.2f}" if r.p50 else f"{'-':>9}{'-':>9}"
            m = mem.get((r.case, r.provider))
            mem_cell = f"{m:10.3f}" if m is not None else f"{'-':>10}"
            print(f"{r.case:<{wc}}{r.provider:<{wp}}{t}{mem_cell}  {r.note}")
    _plot(rows, copy_gbs, out / f"{args.stem}.png")
    print(f"\nwrote {js}, {cs}")


TITLES = {"distill": "CE + forward KL, N=8192, V=128256", "grpo": "GRPO dapo+KL+entropy, B=8 T=1024",
          "trainer": "GRPO from [B, L+1, V] logits", "weights sft": "CE, N=8192, V=128256",
          "weights distill": "CE + forward KL, N=8192, V=128256", "weights grpo": "GRPO dapo+KL+entropy, B=8 T=1024"}


def _plot(rows: list[Row], copy_gbs: float, path) -> None:
    plt = pyplot()
    cases = list(dict.fromkeys(r.case for r in rows if r.metric == "time" and r.p50))
    if not cases:
        return
    fig, axes = plt.subplots(1, len(cases), figsize=(6.5 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        times = [r for r in rows if r.case == case and r.metric == "time" and r.p50]
        ax.barh([r.provider for r in times], [r.p50 for r in times], color="tab:blue")
        ax.axvline(floor_ms(case, times[0].x, copy_gbs), color="k", ls="--", label="floor")
        ax.set_xscale("log")
        ax.set_xlabel("fwd+bwd ms (median)")
        ax.set_title(TITLES.get(case, f"{case}, CE 0.5 + divergence 0.5, N=8192, V=128256"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
