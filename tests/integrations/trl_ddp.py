"""2-process GRPO and SFT runs (gloo, CPU), stock TRL and headloss's, for tests/integrations/test_trl.py:
``torchrun --nproc-per-node 2 tests/integrations/trl_ddp.py OUT_DIR`` (with the tiny model saved in
OUT_DIR/tiny) prints one RESULT line on rank 0."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRITON_INTERPRET", "1")

import test_trl  # noqa: E402
import trl  # noqa: E402
from conftest import end_of_script  # noqa: E402
from test_trl import grpo, sft  # noqa: E402

from headloss.integrations.trl import HeadLossGRPOTrainer, HeadLossSFTTrainer  # noqa: E402


def logs(trainer):
    return [{k: v for k, v in h.items() if isinstance(v, (int, float)) and k != "step_time"}
            for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    from pathlib import Path

    out = Path(sys.argv[1]) / f"rank{os.environ.get('RANK', 0)}"
    # the tiny model was saved by the launching test: under torch.distributed only rank 0 would write it
    test_trl.saved_model = lambda _path: str(Path(sys.argv[1]) / "tiny")
    result = {}
    extra = {"grpo": {}, "gspo": dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=0.02,
                                      epsilon_high=0.03), "vespo": dict(loss_type="vespo"),
             "top_entropy": dict(top_entropy_quantile=0.5),
             "top_entropy+bonus": dict(top_entropy_quantile=0.5, entropy_coef=0.05)}
    for name, make in (("grpo", grpo), ("gspo", grpo), ("vespo", grpo), ("top_entropy", grpo),
                       ("top_entropy+bonus", grpo), ("sft", sft)):
        runs = {}
        for label, cls in (("stock", trl.GRPOTrainer if name != "sft" else trl.SFTTrainer),
                           ("mine", HeadLossGRPOTrainer if name != "sft" else HeadLossSFTTrainer)):
            if name != "sft":
                trainer = make(out / name / label, cls=cls, ddp_backend="gloo", max_steps=2, **extra[name])
            else:
                trainer = make(out / name / label, cls, ddp_backend="gloo", max_steps=2)
            trainer.train()
            runs[label] = (logs(trainer), {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        err = max(float((runs["mine"][1][n] - w).abs().max()) for n, w in runs["stock"][1].items())
        result[name] = {"err": err, "stock": runs["stock"][0], "mine": runs["mine"][0]}
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({"world": int(os.environ.get("WORLD_SIZE", 1)), **result}))
    end_of_script()
