"""A full HF training step (forward, backward, AdamW) of a Llama-3.2-1B-shaped model, bf16.

Providers, each in a process of its own (Liger patches the model classes):

  stock          HF's own forward and loss (full logits, upcast to fp32)
  liger-flce     Liger-Kernel's fused linear cross-entropy only (apply_liger_kernel_to_llama with
                 rope/rms_norm/swiglu off): the same model body, a different head
  liger          apply_liger_kernel_to_llama() defaults (also its RoPE, RMSNorm and SwiGLU kernels)
  trl-fused      TRL 1.16's add_fused_lm_head (CE from its fused log-prob head)
  headloss       headloss.integrations.transformers.patch with the full SFT spec
                 (CE + z-loss 1e-4 + token accuracy + entropy metric)
  headloss-ce    the patch with plain CE
  liger-body+headloss  Liger's RoPE, RMSNorm and SwiGLU kernels with the headloss patch as the head
                 (what a user combining both gets; compare with ``liger``)

Each process: 20 AdamW steps (lr 1e-5) from the same init on one fixed batch, recording the
cross-entropy at every step (for headloss's full spec its ``ce`` metric: its loss adds the z-loss),
then --steps timed steps (CUDA events, median) and the peak memory allocated over them.

  python -m benchmarks.bench_hf [--providers ...] [--batch 4] [--seq 4096] [--layers 16]

Writes $OUT (or ./results)/bench_hf.{json,csv,png}; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from benchmarks.common import Row, gpu_name, out_dir_default, pyplot, write_rows

PROVIDERS = ("stock", "liger-flce", "liger", "trl-fused", "headloss", "headloss-ce", "liger-body+headloss")


def build(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda", generator=gen)
    labels = ids.clone()
    labels[:, : args.seq // 8] = -100  # a prompt
    return model, ids, labels


def run_provider(args) -> dict:
    name = args.run
    model, ids, labels = build(args)
    n_items = (labels[:, 1:] != -100).sum()
    if name.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        if name == "liger-body+headloss":
            apply_liger_kernel_to_llama(cross_entropy=False, fused_linear_cross_entropy=False, model=model)
        elif name == "liger-flce":
            apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                        fused_linear_cross_entropy=True, model=model)
        else:
            apply_liger_kernel_to_llama(model=model)
    extra = {}
    if name == "trl-fused":
        from benchmarks.common import import_trl

        import_trl("trl.trainer.utils").add_fused_lm_head(model)
        extra = {"fused_lm_head": True}
    if "headloss" in name:
        import headloss
        from headloss.integrations.transformers import patch

        spec = headloss.LossSpec() if name == "headloss-ce" else headloss.LossSpec(
            z_loss={"weight": 1e-4}, entropy={"weight": 0.0}, token_accuracy=True)
        patch(model, spec, **({"chunk_bytes": args.chunk_mb << 20} if args.chunk_mb else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        out = model(input_ids=ids, labels=labels, num_items_in_batch=n_items, **extra)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # the CE itself: the full spec's loss adds 1e-4 z-loss, which stock does not have
        metrics = getattr(out, "metrics", None)
        return metrics["ce"] if metrics and "ce" in metrics else out.loss.detach()

    losses = [float(step()) for _ in range(20)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    peak = torch.cuda.max_memory_allocated()
    return {"provider": name, "p50": ms[len(ms) // 2], "p20": ms[len(ms) // 5], "p80": ms[(4 * len(ms)) // 5],
            "peak_gb": peak / 1e9, "state_gb": base / 1e9, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk-mb", type=int, default=0, help="headloss patch chunk_bytes in MiB (0: default)")
    parser.add_argument("--stem", default="bench_hf")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # one provider, in this process
    args = parser.parse_args(argv)
    if args.run:
        print("RESULT " + json.dumps(run_provider(args)), flush=True)
        return
    results = []
    for name in args.providers:
        cmd = [sys.executable, "-m", "benchmarks.bench_hf", "--run", name, "--batch", str(args.batch), "--seq",
               str(args.seq), "--layers", str(args.layers), "--steps", str(args.steps), "--chunk-mb",
               str(args.chunk_mb)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            print(f"{name}: failed: {' | '.join(tail)}", flush=True)
            continue
        result = json.loads(found[-1][len("RESULT "):])
        results.append(result)
        print(f"{name:12s} step {result['p50']:8.2f} ms  peak {result['peak_gb']:6.2f} GB  "
              f"loss[0] {result['losses'][0]:.4f} loss[19] {result['losses'][-1]:.4f}", flush=True)
    stock = next((r for r in results if r["provider"] == "stock"), None)
    rows: list[Row] = []
    config = {"batch": args.batch, "seq": args.seq, "layers": args.layers, "hidden": 2048, "vocab": 128256,
              "dtype": "bf16", "optimizer": "AdamW", "chunk_mb": args.chunk_mb}
    print(f"\n{'provider':12s} {'step ms':>8s} {'x stock':>8s} {'peak GB':>8s} {'max |dloss| vs stock':>21s}")
    for r in results:
        drift = None
        if stock is not None:
            drift = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], stock["losses"]))
        ratio = r["p50"] / stock["p50"] if stock else float("nan")
        d = f"{100 * drift:20.3f}%" if drift is not None else "                    -"
        print(f"{r['provider']:12s} {r['p50']:8.2f} {ratio:8.3f} {r['peak_gb']:8.2f} {d}")
        note = "" if drift is None else f"max relative loss difference to stock over 20 steps {drift:.2e}"
        rows.append(Row(case="train-step", provider=r["provider"], metric="time", unit="ms", x_name="tokens",
                        x=args.batch * args.seq, p50=r["p50"], p20=r["p20"], p80=r["p80"], note=note,
                        config={**config, "losses": r["losses"]}, gpu=gpu_name()))
        rows.append(Row(case="train-step", provider=r["provider"], metric="memory", unit="GB", x_name="tokens",
                        x=args.batch * args.seq, p50=r["peak_gb"], config=config, gpu=gpu_name()))
    out = out_dir_default()
    write_rows(rows, out, args.stem)
    _plot(results, out / f"{args.stem}.png")


def _plot(results: list[dict], path) -> None:
    try:
        plt = pyplot()
    except Exception as exc:
        print(f"no plot: {exc}")
        return
    if not results:
        return
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    names = [r["provider"] for r in results]
    a.bar(names, [r["p50"] for r in results])
    a.set_ylabel("ms per training step")
    b.bar(names, [r["peak_gb"] for r in results])
    b.set_ylabel("peak GB")
    for r in results:
        c.plot(r["losses"], label=r["provider"])
    c.set_xlabel("step")
    c.set_ylabel("loss")
    c.legend(fontsize=7)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
