"""Every policy objective, fwd+bwd, bf16, V=128256, in one run beside Liger-Kernel and TRL.

  logits  the trainer-shaped call: the model's [B, L + 1, V] logits (B=8, L=1024) scored against
          the completion ids with shift=True, eps 0.2 / 0.28, k3 KL beta 0.04, entropy metric;
          every row-local objective runs in the fused kernel's epilogue (target: within 3% of
          clip/dapo), sequence-level ones (GSPO-style ratios) in deferred mode.
          Peer: Liger triton_grpo_loss (full logits, no entropy) for the loss types it has.
  linear  the fused lm_head: hidden [8192, 4096] x weight [128256, 4096] (target: <= 1.20 x the
          3-GEMM floor, measured in the same run; deferred mode recomputes the logits in backward:
          a fourth GEMM). Peers: TRL 1.16's ChunkedLogProbFunction (its
          fused-head log-probs + entropy) with the objective in torch, for clip and cispo; Liger's
          LigerFusedLinearGRPOLoss (its defaults: compiled loss math, an eager chunked log-prob
          backward in fp32 GEMMs; no entropy) for the loss types it has.

  python -m benchmarks.bench_objectives [--cases logits linear] [--only SUBSTRING ...] [--name STEM]

``--only``: the objectives whose name contains one of these (clip and the floor always run).
On the lm_head, a top-entropy row's note says how many rows its guessed mask got wrong (the rows
the correction recomputes). Writes $OUT (or ./results)/STEM.{json,csv,png} (STEM: bench_objectives);
prints a table (ratio to clip on the logits path, to the GEMM floor on the linear path).
"""

from __future__ import annotations

import argparse

import torch

import headloss
from benchmarks.bench_terms import grpo_batch
from benchmarks.common import Row, import_trl, measure, out_dir_default, pyplot, write_rows

V, H = 128256, 4096
TRL_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
BETA = 0.04
BASE = dict(loss_type="dapo", kl_beta=BETA, kl_estimator="k3", eps_low=0.2, eps_high=0.28)
OBJECTIVES = {  # name -> Policy fields over BASE
    "clip": {},
    "cispo": dict(objective="cispo", eps_high=5.0),
    "cispo-verl": dict(objective="cispo", convention="verl"),
    "sapo": dict(objective="sapo", loss_type="grpo"),
    "gpg": dict(objective="gpg"),
    "dro": dict(objective="dro", dro_beta=0.1),
    "dppo_tv": dict(objective="dppo_tv", eps_low=0.15, eps_high=0.15),
    "dppo_kl": dict(objective="dppo_kl", eps_low=0.05, eps_high=0.05),
    "clip, verl k3+ (clamped)": dict(convention="verl", dual_clip_c=3.0, kl_clamp=True, kl_grad="k2"),
    "clip, rollout IS token truncate": dict(rollout_is="token", rollout_is_max=2.0),
    "clip, TRL entropy bonus": dict(entropy_coef=0.01, entropy_aggregation="token-mean"),
    # a sequence or batch statistic between the stats and the gradient pass: deferred mode on the
    # logits; on the lm_head, sequence statistics run chunk by chunk of whole sequences
    "clip, sequence-level (GSPO, sequence statistic)": dict(importance_sampling="sequence"),
    "clip, sequence_token (verl gspo, sequence statistic)": dict(importance_sampling="sequence_token",
                                                                 loss_type="grpo"),
    "gmpo (sequence statistic)": dict(objective="gmpo", loss_type="grpo"),
    "vespo (sequence statistic)": dict(objective="vespo"),
    "kl_cov (batch statistic)": dict(objective="kl_cov"),
    "clip_cov (batch statistic)": dict(objective="clip_cov"),
    "clip, off-policy mask (sequence statistic)": dict(off_policy_mask=0.5),
    "clip, top entropy 0.2 (batch statistic)": dict(top_entropy_quantile=0.2),
    "clip, top entropy 0.5 (batch statistic)": dict(top_entropy_quantile=0.5),
}
LIGER = {"clip": "dapo", "cispo": "cispo", "sapo": "sapo"}
LIGER_LINEAR = {**LIGER, "vespo (sequence statistic)": "vespo"}  # LigerFusedLinearGRPOLoss's loss_type


def spec_of(name: str) -> headloss.LossSpec:
    return headloss.LossSpec(cross_entropy=None, entropy={"weight": 0.0}, policy={**BASE, **OBJECTIVES[name]})


def chosen(names: list[str] | None) -> list[str]:
    return [n for n in OBJECTIVES if names is None or n == "clip" or any(part in n for part in names)]


def corrected_rows(step) -> str:
    """The rows one call's top-entropy correction recomputed (linear_policy.correct_rows), as a note."""
    import headloss.linear_policy as engine

    counts, original = [], engine.correct_rows

    def counting(run, head, rows, *rest):
        counts.append(int(rows.sum()))
        return original(run, head, rows, *rest)

    engine.correct_rows = counting
    try:
        step()
    finally:
        engine.correct_rows = original
    return f"{counts[0]} rows corrected" if counts else "no correction (deferred)"


def logits_case(rows: list[Row], batch: int, length: int, names: list[str] | None = None) -> None:
    pristine, ids, adv, old, ref, mask = grpo_batch(2, batch, length)
    logits = torch.empty_like(pristine).requires_grad_()

    def setup():
        logits.grad = None
        with torch.no_grad():
            logits.copy_(pristine)

    n_items = mask.sum()
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, num_items_in_batch=n_items,
                  rollout_logprobs=old + 0.01)
    cfg = {"B": batch, "L": length, "V": V, "dtype": "bf16"}
    for name in chosen(names):
        spec = spec_of(name)
        measure(rows, "logits", f"headloss {name}", "N", batch * length,
                lambda spec=spec: headloss.head_loss(logits, ids, spec, shift=True, **inputs).loss.backward(),
                setup, config=cfg)
        torch.cuda.empty_cache()
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as exc:
        print(f"liger unavailable: {exc}")
        return
    for name, loss_type in LIGER.items():
        if name not in chosen(names):
            continue
        fields = {**BASE, **OBJECTIVES[name]}

        def liger(loss_type=loss_type, fields=fields):
            loss, _ = triton_grpo_loss(logits, old, ref, ids, adv, mask, temperature=1.0, beta=BETA,
                                       eps_low=fields["eps_low"], eps_high=fields["eps_high"], inplace=True,
                                       loss_type=loss_type, reduce=True, num_items_in_batch=n_items)
            loss.backward()

        measure(rows, "logits", f"liger triton_grpo_loss {name} (no entropy)", "N", batch * length, liger, setup,
                config=cfg)
        torch.cuda.empty_cache()


def linear_case(rows: list[Row], n: int, seq: int, names: list[str] | None = None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(n, H, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, device="cuda", generator=gen) / H**0.5 * 2.0).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (n,), device="cuda", generator=gen)
    batch = n // seq
    adv = torch.randn(batch, device="cuda", generator=gen)
    with torch.no_grad():
        logp = torch.cat([torch.log_softmax((hidden[i:i + 1024] @ weight.t()).float(), -1)
                          .gather(-1, ids[i:i + 1024, None])[:, 0] for i in range(0, n, 1024)])
    old = (logp + 0.1 * torch.randn(n, device="cuda", generator=gen)).reshape(batch, seq)
    ref = (logp + 0.1 * torch.randn(n, device="cuda", generator=gen)).reshape(batch, seq)
    mask = torch.ones(batch, seq, device="cuda")
    mask[:, int(seq * 0.9):] = 0
    h3, y2 = hidden.view(batch, seq, H), ids.view(batch, seq)
    n_items = mask.sum()

    def setup():
        hidden.grad = weight.grad = None

    cfg = {"N": n, "H": H, "V": V, "dtype": "bf16"}

    def floor():
        with torch.no_grad():
            logits = hidden @ weight.t()
            hidden.grad = logits @ weight
            weight.grad = logits.t() @ hidden

    measure(rows, "linear", "3-gemm-floor", "N", n, floor, setup, config=cfg, cold_blas=True)
    inputs = dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_mask=mask, num_items_in_batch=n_items,
                  rollout_logprobs=old + 0.01)
    for name in chosen(names):
        spec = spec_of(name)

        def step(spec=spec):
            headloss.linear_head_loss(h3, weight, y2, spec, **inputs).loss.backward()

        note = corrected_rows(step) if "top entropy" in name else ""
        measure(rows, "linear", f"headloss {name}", "N", n, step, setup, config=cfg, cold_blas=True, note=note)
        torch.cuda.empty_cache()
    try:
        ChunkedLogProbFunction = import_trl("trl.kernels.chunked_logprob").ChunkedLogProbFunction
    except Exception as exc:
        print(f"TRL chunked log-prob unavailable: {type(exc).__name__}: {exc}")
        return
    for name in ("clip", "cispo"):
        if name not in chosen(names):
            continue
        fields = {**BASE, **OBJECTIVES[name]}

        def trl(fields=fields, name=name):
            logps, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, TRL_CHUNK, None, 1.0,
                                                              ("entropy",))
            logps, entropy = logps.view(batch, seq), entropy.view(batch, seq)
            ratio = torch.exp(logps - old)
            a = adv[:, None]
            if name == "cispo":
                per_token = -torch.clamp(ratio, max=fields["eps_high"]).detach() * a * logps
            else:
                per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - fields["eps_low"], 1 + fields["eps_high"]) * a)
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            loss = ((per_token + BETA * kl) * mask).sum() / n_items
            with torch.no_grad():
                torch.stack([(entropy * mask).sum() / n_items, (kl * mask).sum() / n_items])
            loss.backward()

        measure(rows, "linear", f"TRL ChunkedLogProbFunction + torch {name}", "N", n, trl, setup, config=cfg,
                cold_blas=True)
        torch.cuda.empty_cache()
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:
        print(f"liger fused-linear GRPO unavailable: {type(exc).__name__}: {exc}")
        return
    for name, loss_type in LIGER_LINEAR.items():
        if name not in chosen(names):
            continue
        fields = {**BASE, **OBJECTIVES[name]}
        module = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_low=fields["eps_low"], epsilon_high=fields["eps_high"],
                                          loss_type=loss_type)

        def liger(module=module):
            loss, _ = module(h3, weight, y2, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old,
                             num_items_in_batch=n_items)
            loss.backward()

        measure(rows, "linear", f"liger LigerFusedLinearGRPOLoss {name} (no entropy)", "N", n, liger, setup,
                config=cfg, cold_blas=True)
        torch.cuda.empty_cache()


def print_table(rows: list[Row]) -> None:
    for case, base_name in (("logits", "headloss clip"), ("linear", "3-gemm-floor")):
        mine = [r for r in rows if r.case == case and r.metric == "time"]
        base = next((r.p50 for r in mine if r.provider == base_name and r.p50), None)
        print(f"\n{case}: ratio to {base_name}")
        print(f"{'provider':52s} {'ms':>9s} {'ratio':>7s}")
        for r in mine:
            ms = f"{r.p50:9.3f}" if r.p50 else "        -"
            ratio = f"{r.p50 / base:7.3f}" if r.p50 and base else "      -"
            print(f"{r.provider:52s} {ms} {ratio} {r.note}")


def plot(rows: list[Row], path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, case in zip(axes, ("logits", "linear")):
        mine = [r for r in rows if r.case == case and r.metric == "time" and r.p50]
        ax.barh([r.provider for r in mine], [r.p50 for r in mine],
                color=["tab:blue" if r.provider.startswith("headloss") else "tab:gray" for r in mine])
        ax.set_xlabel("fwd+bwd ms (median)")
        ax.set_title(f"{case} (bf16, V={V})")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=["logits", "linear"])
    parser.add_argument("--only", nargs="*", default=None, help="objectives whose name contains one of these")
    parser.add_argument("--name", default="bench_objectives", help="the output files' stem")
    args = parser.parse_args()
    rows: list[Row] = []
    if "logits" in args.cases:
        logits_case(rows, 8, 1024, args.only)
    if "linear" in args.cases:
        linear_case(rows, 8192, 1024, args.only)
    out = out_dir_default()
    write_rows(rows, out, args.name)
    plot(rows, out / f"{args.name}.png")
    print_table(rows)


if __name__ == "__main__":
    main()
