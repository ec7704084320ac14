"""Every ```python block of README.md and docs/*.md runs as written, on CPU, with tiny shapes.

Each block runs alone, in the repository root, in a namespace holding the names the docs use for a
caller's tensors, model and groups (:data:`PADDED`, built only when a block reads them): padded rows
``[B, T, ...]`` with HF labels, or, for a block that names ``cu_seqlens``, packed rows ``[N, ...]``
(:data:`PACKED`: ``hidden``, ``adv``, ``old``, ``ref``, ``mask`` are then per row). ``spec`` is
``configs/sft_zloss.yaml``, the README's first example; a block that needs another spec names it.
A line ``expr   # 'value': ...`` asserts that expr equals the value shown, and a warning at a
block's call (an input its spec ignores, an old name) fails it. A block that cannot run here (a
CUDA device, a Ray cluster) is skipped only by ``<!-- docs-test: skip (the reason) -->`` on the
line before its fence.
"""

from __future__ import annotations

import ast
import linecache
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import headloss
from headloss import env

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

B, T, V, H = 2, 6, 48, 16
CU_SEQLENS = (0, 5, 11)  # two packed sequences of 5 and 6 rows
N = CU_SEQLENS[-1]

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<what>.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip \((?P<reason>[^)]+)\)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    skip: str | None  # the marker's reason

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The fenced ```python blocks of a markdown file (also indented ones, in list items), each with
    the skip marker on the nearest non-blank line before it. A ``docs-test`` comment that is not a
    well-formed skip is an error, so a typo cannot silently run or skip a block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, close = fence["indent"], re.compile(rf"^{re.escape(fence['indent'])}```\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        assert end is not None, f"{path.name}:{i + 1}: unclosed code fence"
        if fence["lang"] == "python":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker, skip = MARKER.match(before), None
            if marker is not None:
                reason = SKIP.match(marker["what"])
                assert reason is not None, f"{path.name}:{i}: expected '<!-- docs-test: skip (reason) -->'"
                skip = reason["reason"]
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
            blocks.append(Block(path, i + 1, "\n".join(body) + "\n", skip))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


def unbound_names(code: str) -> set[str]:
    """The names a block reads and never assigns: those the namespace has to hold."""
    names = [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name)]
    stored = {node.id for node in names if not isinstance(node.ctx, ast.Load)}
    return {node.id for node in names if isinstance(node.ctx, ast.Load)} - stored


# --- the names the blocks use ---------------------------------------------------------------

def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _leaf(*shape: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen()) * scale).requires_grad_()


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=_gen())


def _logprobs(*shape: int, shift: float = 0.0) -> torch.Tensor:
    return -torch.rand(*shape, generator=_gen()) * 3.0 - 1.0 + shift


def _labels() -> torch.Tensor:
    labels = _ids(B, T)
    labels[:, :2] = -100  # the prompt
    return labels


def _completion_mask() -> torch.Tensor:
    mask = torch.ones(B, T - 1, dtype=torch.int64)
    mask[1, -2:] = 0  # the second completion is shorter
    return mask


def _model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config)


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = _ids(T)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(T, dtype=torch.int64)}


def _args(ns: dict):
    transformers = pytest.importorskip("transformers")
    return transformers.TrainingArguments(output_dir=str(ns["tmp_path"]), report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True, max_steps=1)


def _trainer(ns: dict):
    transformers = pytest.importorskip("transformers")
    return transformers.Trainer(model=ns["model"], args=ns["args"], train_dataset=ns["ds"])


def _tp_group(ns: dict):
    """A 1-rank gloo group in this process (destroyed after the block): every vocab-parallel path runs,
    each rank's shard being the whole vocabulary."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ns["_cleanup"].append(_destroy_group)
    return dist.new_group([0])


def _destroy_group() -> None:
    import torch.distributed as dist

    from headloss.parallel import clear_layouts

    clear_layouts()
    dist.destroy_process_group()


def _dtensor_logits(ns: dict):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    ns["tp_group"]  # noqa: B018  (the process group the mesh needs)
    return DTensor.from_local(ns["logits"], DeviceMesh("cpu", [0]), [Shard(-1)])


def _teacher_top(ns: dict) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.log_softmax(ns["teacher_logits"], -1).topk(8, dim=-1)
    ids = top.indices.clone()
    ids[0, 0, 6:] = -1  # a row with 6 entries
    return ids, top.values


def _actor_config() -> dict:
    """The ``actor`` section of docs/verl.md's config."""
    return {"policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28, "use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001}


Factory = Callable[[dict], object]

PADDED: dict[str, Factory] = {
    "logits": lambda ns: _leaf(B, T, V),  # the model's output, [B, T, V]
    "student_logits": lambda ns: _leaf(B, T, V),
    "teacher_logits": lambda ns: torch.randn(B, T, V, generator=torch.Generator().manual_seed(1)) * 2.0,
    # a sparse teacher: its top-8 ids (padded with -1) and log-probs [B, T, 8], its log-prob of each label
    "teacher_ids": lambda ns: _teacher_top(ns)[0],
    "teacher_logprobs": lambda ns: _teacher_top(ns)[1],
    "teacher_token_logprobs": lambda ns: torch.log_softmax(ns["teacher_logits"], -1).gather(
        -1, ns["labels"].clamp(min=0)[..., None])[..., 0],
    "logits_shard": lambda ns: ns["logits"],  # this rank's columns: all of them on 1 rank
    "dtensor_logits": _dtensor_logits,
    "labels": lambda ns: _labels(),  # HF labels [B, T], -100 on the prompt
    "ids": lambda ns: _ids(B, T),  # the model's input ids
    "mask": lambda ns: torch.ones(B, T, dtype=torch.int64),  # its attention mask
    "completion_ids": lambda ns: _ids(B, T - 1),  # [B, T - 1]: row t against completion_ids[:, t]
    "completion_mask": lambda ns: _completion_mask(),
    "adv": lambda ns: torch.tensor([1.0, -0.5]),  # one advantage per sequence
    "rollout_temperature": lambda ns: torch.tensor([0.7, 1.0]),  # each sequence sampled at its own
    "weights": lambda ns: torch.tensor([[0.5, 1.0, 2.0, 0.0, 1.5, 0.25]]).expand(B, T).contiguous(),
    # K = 4 ids per row to score (-1: none), and a reward for each
    "candidates": lambda ns: torch.randint(-1, V, (B, T, 4), generator=torch.Generator().manual_seed(5)),
    "rewards": lambda ns: torch.randn(B, T, 4, generator=torch.Generator().manual_seed(6)),
    "old": lambda ns: _logprobs(B, T - 1),
    "ref": lambda ns: _logprobs(B, T - 1, shift=0.1),
    "n": lambda ns: int(ns["completion_mask"].sum()),  # num_items_in_batch
    "hidden": lambda ns: _leaf(B, T, H, scale=1.0),
    "lm_head": lambda ns: torch.nn.Linear(H, V, bias=False),
    "weight": lambda ns: ns["lm_head"].weight,
    "weight_shard": lambda ns: ns["lm_head"].weight,
    "spec": lambda ns: headloss.LossSpec.from_file(ROOT / "configs" / "sft_zloss.yaml"),
    "model": lambda ns: _model(),
    "args": _args,
    "ds": lambda ns: _Rows(),
    "trainer": _trainer,
    "transformers": lambda ns: pytest.importorskip("transformers"),
    "tp_group": _tp_group,
    "actor_config": lambda ns: _actor_config(),
}
"""Every name a block may use unbound, by how it is built (padded layout)."""

PACKED: dict[str, Factory] = {
    **PADDED,
    "cu_seqlens": lambda ns: torch.tensor(CU_SEQLENS, dtype=torch.int32),
    "input_ids": lambda ns: _ids(N),  # the packed stream's ids
    "rolled_labels": lambda ns: torch.roll(ns["input_ids"], -1),  # verl's labels
    "hidden": lambda ns: _leaf(N, H, scale=1.0),
    "adv_per_sequence": lambda ns: torch.tensor([1.0, -0.5]),
    "adv": lambda ns: torch.tensor([1.0, -0.5]).repeat_interleave(torch.tensor([5, 6])),  # per row
    "old": lambda ns: _logprobs(N),
    "ref": lambda ns: _logprobs(N, shift=0.1),
    "mask": lambda ns: (torch.arange(N) % 5 >= 2).to(torch.int64),  # the response rows
    "response_rows": lambda ns: ns["mask"],
    "temperature": lambda ns: 1.0,
}
"""Packed rows [N, ...]: for a block that names ``cu_seqlens``."""


SHOWN = re.compile(r"#\s*(?P<value>'[^']*'|\"[^\"]*\")")


def checked(code: str, compare: bool = True) -> ast.Module:
    """The block's code, where a one-line expression whose comment opens with a string literal
    (``out.route   # 'fused': ...``) asserts that the expression equals it: what the docs show is
    what the call returns. The docs show a kernel call's values (routes): ``compare`` is off where
    CPU tensors take the plain-torch path (no TRITON_INTERPRET)."""
    tree, lines = ast.parse(code), code.splitlines()
    if not compare:
        return tree
    for i, node in enumerate(tree.body):
        if not (isinstance(node, ast.Expr) and node.lineno == node.end_lineno):
            continue
        shown = SHOWN.match(lines[node.lineno - 1][node.end_col_offset:].strip())
        if shown is None:
            continue
        value = ast.Constant(ast.literal_eval(shown["value"]))
        call = ast.Call(ast.Name("_shown", ast.Load()), [node.value, value], [])
        tree.body[i] = ast.copy_location(ast.Expr(call), node)
    return ast.fix_missing_locations(tree)


def _shown(got, shown) -> None:
    assert got == shown, f"the docs show {shown!r}, the call gives {got!r}"


def _source_name(block: Block) -> str:
    """A file name for the block's code, registered with linecache: a traceback shows the block's
    lines, numbered from its first line (``README.md:87 block``, line 1 = the line after the fence)."""
    name = f"{block.id} block"
    linecache.cache[name] = (len(block.code), None, block.code.splitlines(keepends=True), name)
    return name


class Namespace(dict):
    """A block's globals: a name of the layout is built on first use."""

    def __init__(self, factories: dict[str, Factory], **given):
        super().__init__(given, __name__="__docs__", headloss=headloss, torch=torch, _cleanup=[], _shown=_shown)
        self.factories = factories

    def __missing__(self, name: str):
        if name not in self.factories:
            raise KeyError(name)
        self[name] = value = self.factories[name](self)
        return value


def test_the_docs_have_blocks():
    """The collector finds the blocks (a broken fence pattern would otherwise pass every file)."""
    by_file = {block.path.name for block in BLOCKS}
    assert {"README.md", "policy.md", "runtime.md", "verl.md", "integrations.md", "vocab-parallel.md"} <= by_file
    assert sum(block.skip is None for block in BLOCKS) >= 12


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_block_runs(block: Block, tmp_path, monkeypatch):
    if block.skip is not None:
        pytest.skip(block.skip)
    monkeypatch.chdir(ROOT)
    used = unbound_names(block.code)
    ns = Namespace(PACKED if "cu_seqlens" in used else PADDED, tmp_path=tmp_path)
    try:
        for name in sorted(used & set(ns.factories)):  # built first: a function's globals skip __missing__
            ns[name]  # noqa: B018
        with warnings.catch_warnings():
            # a warning at the block's own call, or from headloss itself, fails it (a doc passing an input its spec
            # ignores, an old name)
            warnings.filterwarnings("error", module=r"__docs__$|headloss(\.|$)")
            exec(compile(checked(block.code, env.INTERPRETER), _source_name(block), "exec"), ns)  # noqa: S102
    finally:
        for cleanup in ns["_cleanup"]:
            cleanup()
