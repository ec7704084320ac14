"""A 2-process DDP Trainer run (gloo, CPU), stock and patched, for tests/integrations/test_transformers.py:
``torchrun --nproc-per-node 2 tests/integrations/hf_ddp.py OUT_DIR`` prints one RESULT line on rank 0."""

import json
import os
import sys

import torch  # noqa: F401  (before transformers)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402
from conftest import end_of_script  # noqa: E402
from test_transformers import _Batches, tiny  # noqa: E402

from headloss import Entropy, LossSpec, ZLoss  # noqa: E402
from headloss.integrations.transformers import attach, patch  # noqa: E402


def train(out_dir: str, patched: bool):
    model = tiny("llama")
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, str(int(patched))), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=2, logging_steps=1, learning_rate=0.05, optim="sgd",
        lr_scheduler_type="constant", report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0,
        dataloader_drop_last=True, disable_tqdm=True, average_tokens_across_devices=True, ddp_backend="gloo",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batches())
    if patched:
        handle = patch(model, LossSpec(z_loss=ZLoss(weight=0.0), entropy=Entropy(weight=0.0), token_accuracy=True))
        attach(trainer, handle)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, [h for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    stock_weights, stock_logs = train(sys.argv[1], False)
    weights, logs = train(sys.argv[1], True)
    err = max(float((weights[n] - w).abs().max()) for n, w in stock_weights.items())
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({
            "err": err, "world": int(os.environ.get("WORLD_SIZE", 1)), "stock": [h["loss"] for h in stock_logs],
            "mine": [h["loss"] for h in logs], "ce": [h.get("ce") for h in logs],
            "accuracy": [h.get("token_accuracy") for h in logs],
        }))
    end_of_script()
