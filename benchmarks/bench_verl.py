"""verl's fused head + policy loss vs headloss on packed GRPO rows (fwd+bwd, bf16).

64 sequences of mixed length (64..4096 tokens, 65536 in all, a quarter of each the prompt),
H 4096, V 151936; verl's actor config: loss_mode vanilla, token-mean, clip 0.2 / 0.28, KL loss
low_var_kl 0.001, entropy logged (coefficient 0). In one run:

* ``3-gemm-floor``                 hidden @ W.T, dh, dW (cuBLAS, full logits)
* ``verl``                         verl.utils.kernel.linear_cross_entropy (its Triton kernel) +
                                   its ppo_loss pieces: compute_policy_loss_vanilla, agg_loss of
                                   the entropy, kl_penalty + agg_loss (padded [S, R] responses)
* ``headloss drop-in + verl loss`` headloss.integrations.verl.linear_cross_entropy in verl's place
* ``headloss drop-in + headloss loss`` and the registered ``headloss_vanilla`` policy loss
* ``headloss fused``               one linear_head_loss over the packed rows with
                                   ``policy_spec(config)`` (``cu_seqlens``, ``shift=True``): the
                                   policy loss inside the head pass, gradient in forward

Each row checks its loss against verl's (relative difference, bf16) and the script prints
time and peak memory above the inputs (dW and dh included), with ratios to the floor and to verl.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import types

import torch

from benchmarks.common import Row, measure, out_dir_default, pyplot, write_rows


def import_verl(name: str):
    """A verl module. Without Ray (the GPU image) verl's package __init__ and its worker configs
    (which import Ray) are skipped: the submodules load from the installed package, and the actor
    config is an omegaconf DictConfig, as verl's losses also take."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise
    from omegaconf import DictConfig

    for key in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
        del sys.modules[key]
    pkg = types.ModuleType("verl")
    pkg.__path__ = list(importlib.util.find_spec("verl").submodule_search_locations)
    sys.modules["verl"] = pkg
    workers = types.ModuleType("verl.workers.config")  # core_algos' isinstance(config, ActorConfig)
    workers.ActorConfig = DictConfig
    sys.modules["verl.workers.config"] = workers
    return importlib.import_module(name)


def actor_config(**changes):
    """verl's actor config of the benchmark (loss_mode vanilla, token-mean, clip 0.2 / 0.28, KL loss
    low_var_kl 0.001, entropy coefficient 0): an ActorConfig, or a DictConfig without Ray."""
    fields = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                  loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.001,
                  kl_loss_type="low_var_kl", tau_pos=1.0, tau_neg=1.05)
    fields.update(changes)
    try:
        actor = importlib.import_module("verl.workers.config.actor")
        if not isinstance(actor.ActorConfig, type) or actor.ActorConfig.__module__.startswith("omegaconf"):
            raise ModuleNotFoundError(name="ray")
        config = actor.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    except ModuleNotFoundError:
        from omegaconf import OmegaConf

        config = OmegaConf.create(dict(fields, policy_loss={"loss_mode": "vanilla"}, global_batch_info={}))
    config.global_batch_info.update(dp_size=1)
    return config


def lengths_for(n_seq: int, total: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n_seq`` log-uniform lengths in [low, high] summing to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.empty(n_seq).uniform_(float(torch.tensor(low).log()), float(torch.tensor(high).log()),
                                                generator=gen))
    lengths = (raw * total / raw.sum()).round().long().clamp(low, high)
    i = 0
    while int(lengths.sum()) != total:  # spread the rounding remainder
        step = 1 if int(lengths.sum()) < total else -1
        j = i % n_seq
        if low <= int(lengths[j]) + step <= high:
            lengths[j] += step
        i += 1
    return lengths.tolist()


def make_batch(lengths: list[int], h: int, v: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, s = sum(lengths), len(lengths)
    hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2.0).to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    prompts = [max(1, k // 4) for k in lengths]
    responses = [k - p for k, p in zip(lengths, prompts)]
    r_max = max(responses)
    rows = torch.zeros(s, r_max, dtype=torch.long, device="cuda")  # the packed row scoring each response token
    mask = torch.arange(r_max, device="cuda")[None] < torch.tensor(responses, device="cuda")[:, None]
    for i, (start, p, r) in enumerate(zip(cu[:-1].tolist(), prompts, responses)):
        rows[i, :r] = start + p - 1 + torch.arange(r, device="cuda")
    old = -torch.rand(s, r_max, device="cuda", generator=gen) * 3 - 0.05
    ref = old + 0.1 * torch.randn(s, r_max, device="cuda", generator=gen)
    adv = torch.randn(s, 1, device="cuda", generator=gen).expand(s, r_max).contiguous()
    per_row = {}
    for name, t in (("old", old), ("ref", ref), ("adv", adv)):
        flat = torch.zeros(n, device="cuda")
        flat[rows[mask]] = t[mask]
        per_row[name] = flat
    row_mask = torch.zeros(n, dtype=torch.bool, device="cuda")
    row_mask[rows[mask]] = True
    return dict(hidden=hidden.requires_grad_(), weight=weight.requires_grad_(), ids=ids, cu=cu, rows=rows,
                mask=mask, old=old, ref=ref, adv=adv, per_row=per_row, row_mask=row_mask)


def providers(b: dict, config) -> dict:
    core = import_verl("verl.trainer.ppo.core_algos")
    verl_head = import_verl("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    from headloss import linear_head_loss
    from headloss.integrations import verl as hv

    rolled = torch.roll(b["ids"], -1)
    verl_pg = core.get_policy_loss_fn("vanilla")
    ours_pg = hv.policy_loss_fn("vanilla")
    spec = hv.policy_spec(config)
    counts = hv.policy_counts(config, spec.policy)

    def ppo_loss(log_probs, entropy, pg):  # verl's ppo_loss on its padded [S, R] responses
        log_prob, ent = log_probs[b["rows"]], entropy[b["rows"]]
        loss, metrics = pg(b["old"], log_prob, b["adv"], b["mask"], "token-mean", config, None)
        entropy_loss = core.agg_loss(ent, b["mask"], "token-mean", **config.global_batch_info)
        kld = core.kl_penalty(log_prob, b["ref"], config.kl_loss_type)
        kl_loss = core.agg_loss(kld, b["mask"], "token-mean", **config.global_batch_info)
        return loss - config.entropy_coeff * entropy_loss + config.kl_loss_coef * kl_loss

    def floor():
        h, w = b["hidden"], b["weight"]
        with torch.no_grad():
            logits = h @ w.t()
            h.grad = logits @ w
            w.grad = logits.t() @ h
        return None

    def floor_scored():  # the same GEMMs over the rows that score a response token only
        h, w = b["hidden"], b["weight"]
        with torch.no_grad():
            rows = h[b["row_mask"]]
            logits = rows @ w.t()
            h.grad = torch.zeros_like(h).index_put_((b["row_mask"],), logits @ w)
            w.grad = logits.t() @ rows
        return None

    def verl():
        lp, ent = verl_head(b["hidden"], b["weight"], rolled, 1.0, "none")
        return ppo_loss(lp, ent, verl_pg)

    def drop_in_verl_loss():
        lp, ent = hv.linear_cross_entropy(b["hidden"], b["weight"], rolled, 1.0, "none", cu_seqlens=b["cu"])
        return ppo_loss(lp, ent, verl_pg)

    def drop_in_ours():
        lp, ent = hv.linear_cross_entropy(b["hidden"], b["weight"], rolled, 1.0, "none", cu_seqlens=b["cu"])
        return ppo_loss(lp, ent, ours_pg)

    def fused():
        p = b["per_row"]
        return linear_head_loss(b["hidden"], b["weight"], b["ids"], spec, shift=True, cu_seqlens=b["cu"],
                                advantages=p["adv"], old_logprobs=p["old"], ref_logprobs=p["ref"],
                                loss_mask=b["row_mask"], **counts).loss

    return {"3-gemm-floor": floor, "3-gemm-floor (scored rows)": floor_scored, "verl": verl,
            "headloss drop-in + verl loss": drop_in_verl_loss,
            "headloss drop-in + headloss loss": drop_in_ours, "headloss fused": fused}


def grad_check(rows: list[Row], ns: list[int], h: int, v: int, sparse: bool = False) -> None:
    """dh and dW of the fused heads alone (upstream gradients on log-probs and entropy, rolled
    labels) against a chunked fp32 torch reference, at growing row counts: verl's Triton kernel and
    headloss's drop-in, relative errors as rows. ``sparse``: the upstream gradient of a policy
    loss without entropy bonus (none on the entropy, none on a quarter of the rows)."""
    verl_head = import_verl("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    from headloss.integrations import verl as hv

    for n in ns:
        gen = torch.Generator(device="cuda").manual_seed(n)
        hidden = torch.randn(n, h, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5 * 2.0).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
        g_lp, g_ent = (torch.randn(n, device="cuda", generator=gen) / n for _ in range(2))
        if sparse:
            g_ent.zero_()
            g_lp[torch.rand(n, device="cuda", generator=gen) < 0.25] = 0.0
        ref_dh = torch.empty(n, h, device="cuda")
        w32 = weight.detach().float().requires_grad_()
        for start in range(0, n, 2048):  # fp32 logits, chunk by chunk
            h32 = hidden.detach()[start:start + 2048].float().requires_grad_()
            logp = torch.log_softmax(h32 @ w32.t(), -1)
            lp = logp.gather(-1, labels[start:start + 2048, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            (lp * g_lp[start:start + 2048] + ent * g_ent[start:start + 2048]).sum().backward()
            ref_dh[start:start + 2048] = h32.grad
        ref_dw = w32.grad
        for name, head in (("verl", lambda x, w, y: verl_head(x, w, y, 1.0, "none")),
                           ("headloss drop-in", hv.linear_cross_entropy)):
            hidden.grad = weight.grad = None
            lp, ent = head(hidden, weight, labels)
            (lp.reshape(-1) * g_lp + ent.reshape(-1) * g_ent).sum().backward()
            for what, got, want in (("dh", hidden.grad, ref_dh), ("dW", weight.grad, ref_dw)):
                err = float((got.float() - want).norm() / want.norm())
                rows.append(Row(case="grad-check", provider=name, metric=f"rel_err_{what}", unit="", x_name="N", x=n,
                                p50=err, config={"N": n, "H": h, "V": v, "N*V": n * v, "sparse": sparse}))
                print(f"grad check N {n:6d} H {h} (N*V {n * v:.2e}{', sparse' if sparse else ''}) {name:18s} "
                      f"{what} rel err {err:.2e}")
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--stem", default="bench_verl")
    parser.add_argument("--grad-check", type=int, nargs="*", default=[8192, 16384, 65536],
                        help="row counts of the gradient check of the fused heads")
    parser.add_argument("--grad-check-hidden", type=int, nargs="*", default=[1024])
    parser.add_argument("--grad-check-sparse", action="store_true", help="also with a policy loss's upstream "
                        "gradient (none on the entropy or a quarter of the rows)")
    parser.add_argument("--only-grad-check", action="store_true")
    args = parser.parse_args()
    if args.only_grad_check:
        rows = []
        for h in args.grad_check_hidden:
            for sparse in (False, True) if args.grad_check_sparse else (False,):
                grad_check(rows, args.grad_check, h, args.vocab, sparse)
        write_rows(rows, out_dir_default(), args.stem + "_grads")
        return
    lengths = lengths_for(args.sequences, args.tokens, 64, 4096)
    b = make_batch(lengths, args.hidden, args.vocab)
    config = actor_config()
    table = providers(b, config)
    rows: list[Row] = []
    losses, grads = {}, {}
    for name, fn in table.items():
        b["hidden"].grad = b["weight"].grad = None  # (the previous provider's last timed step left its own)
        if not name.startswith("3-gemm-floor"):
            loss = fn()
            loss.backward()
            losses[name] = float(loss.detach())
            grads[name] = (b["hidden"].grad.float(), b["weight"].grad.float())
        b["hidden"].grad = b["weight"].grad = None

        def step(fn=fn, name=name):
            out = fn()
            if out is not None:
                out.backward()

        def setup():
            b["hidden"].grad = b["weight"].grad = None

        measure(rows, "packed-grpo", name, "tokens", args.tokens, step, setup, cold_blas=True,
                config={"S": args.sequences, "N": args.tokens, "H": args.hidden, "V": args.vocab,
                        "lengths": [min(lengths), max(lengths)]})
        torch.cuda.empty_cache()
    for h in args.grad_check_hidden if args.grad_check else ():
        for sparse in (False, True) if args.grad_check_sparse else (False,):
            grad_check(rows, args.grad_check, h, args.vocab, sparse)
    out = out_dir_default()
    js, cs = write_rows(rows, out, args.stem)
    plot(rows, out / f"{args.stem}.png")
    print_table(rows, losses)
    print("\ngradients: norms, and the relative difference ||a - b|| / ||b|| of each pair")
    for name, (dh, dw) in grads.items():
        print(f"  {name:36s} ||dh|| {float(dh.norm()):.4e}  ||dW|| {float(dw.norm()):.4e}")
    names = list(grads)
    for i, a in enumerate(names):
        for other in names[i + 1:]:
            (ah, aw), (bh, bw) = grads[a], grads[other]
            print(f"  {a} vs {other}: dh {float((ah - bh).norm() / bh.norm()):.2e}  "
                  f"dW {float((aw - bw).norm() / bw.norm()):.2e}")
    print(f"\nwrote {js}, {cs}, {out / (args.stem + '.png')}")


def print_table(rows: list[Row], losses: dict) -> None:
    time = {r.provider: r for r in rows if r.metric == "time"}
    mem = {r.provider: r.p50 for r in rows if r.metric == "memory"}
    floor, verl = time["3-gemm-floor"].p50, time.get("verl")
    scored = time["3-gemm-floor (scored rows)"].p50
    print(f"\n{'provider':36s} {'ms':>9s} {'x floor':>8s} {'x scored':>8s} {'x verl':>7s} {'GB':>7s} "
          f"{'x verl':>7s}  loss")
    for name, r in time.items():
        if r.p50 is None:
            print(f"{name:36s} {r.note}")
            continue
        vt = verl.p50 if verl is not None and verl.p50 else None
        vm = mem.get("verl")
        extra = "" if name not in losses else f"{losses[name]:.6f}"
        print(f"{name:36s} {r.p50:9.2f} {r.p50 / floor:8.3f} {r.p50 / scored:8.3f} "
              f"{'' if vt is None else f'{r.p50 / vt:7.3f}'} "
              f"{mem[name]:7.2f} {'' if not vm else f'{mem[name] / vm:7.3f}'}  {extra}")


def plot(rows: list[Row], path) -> None:
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, label in ((ax_t, "time", "fwd+bwd ms (median)"), (ax_m, "memory", "peak GB above inputs")):
        pts = [(r.provider, r.p50) for r in rows
               if r.metric == metric and r.p50 is not None and r.case != "grad-check"]
        ax.barh([p[0] for p in pts], [p[1] for p in pts])
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    ax_t.set_title("packed GRPO, 64 seqs / 65536 tokens, H 4096, V 151936, bf16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
