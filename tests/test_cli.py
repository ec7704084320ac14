"""``python -m headloss``: its help, its one-line errors, what explain prints of a spec and what demo
reports (run in-process through ``cli.main``)."""

import re
from pathlib import Path

import pytest

from headloss import LossSpec, Policy, cli
from headloss.policy_tables import OBJECTIVES

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("demo", "explain")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m headloss *argv``."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def help_text(capsys, *command: str) -> str:
    code, out, _ = run(capsys, *command, "--help")
    assert code == 0
    return out


@pytest.mark.parametrize("command", [(), *((name,) for name in COMMANDS)], ids=["headloss", *COMMANDS])
def test_help_has_no_rest_markup(capsys, command):
    assert "``" not in help_text(capsys, *command)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_with_its_default(capsys, command):
    text = " ".join(help_text(capsys, command).split())  # argparse wraps lines
    options = re.findall(r"\[(--[\w-]+)", text)
    assert {"--rows", "--vocab", "--dtype"} <= set(options)
    assert ("--device" in options) == (command == "demo") and ("--seq-len" in options) == (command == "explain")
    for option in options:
        # "--rows ROWS  rows of the batch ... (default: 64)": help text, then the default
        entry = re.search(rf"{option}(?: \S+)? [a-z][^-]*?\(default: [^;)]+", text)
        assert entry is not None, f"{command} {option}: no help text with its default"
    assert "(default: configs/sft_zloss.yaml)" in text  # the positional config


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_as_the_spec_is_one_line_naming_the_argument(capsys, command):
    code, out, err = run(capsys, command, str(ROOT / "configs"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"headloss {command}: error: config: {ROOT / 'configs'} is a directory")


def test_a_directory_given_to_the_library_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match=rf"path: {re.escape(str(tmp_path))} is a directory"):
        LossSpec.from_file(tmp_path)


def explain(config: str) -> str:
    import torch

    return cli.explain(LossSpec.from_file(ROOT / "configs" / config), rows=4096, vocab=32000, dtype=torch.bfloat16)


def test_explain_prints_the_policy_terms_settings():
    grpo, dr_grpo = explain("grpo.yaml"), explain("dr_grpo.yaml")
    assert grpo != dr_grpo
    assert "aggregation dapo (" in grpo and "num_processes=1" in grpo
    assert "aggregation dr_grpo (" in dr_grpo and "max_completion_length=1024" in dr_grpo
    assert "eps_low=0.2, eps_high=0.2" in grpo and "ratio       token (" in grpo
    assert "kl penalty  none (kl_beta=0)" in grpo
    gmpo = explain("verl_gmpo.yaml")
    assert "policy      gmpo (" in gmpo and "convention verl: eps_low=0.4, eps_high=0.4" in gmpo
    assert "kl penalty  kl_beta=0.001, k3 (" in gmpo and "verl's clamps" in gmpo
    assert "ratio       sequence (" in explain("gspo.yaml")
    assert "convention trl: eps_high=5.0" in explain("cispo.yaml")  # TRL's cispo reads the cap only


def test_explain_says_nothing_of_a_policy_where_there_is_none():
    text = explain("sft_zloss.yaml")
    assert "policy" not in text.lower()
    assert re.search(r"^route       fused: \S", text, re.M)


def test_explain_names_every_objectives_own_fields():
    assert set(cli.OBJECTIVE_FIELDS) == set(OBJECTIVES)
    for fields in cli.OBJECTIVE_FIELDS.values():
        assert set(fields) <= set(Policy.model_fields)


def test_demo_prints_the_spec_with_defaults_and_the_rows_it_scores(capsys):
    code, out, _ = run(capsys, "demo", str(ROOT / "configs" / "sft_zloss.yaml"), "--rows", "40", "--vocab", "30",
                       "--device", "cpu")
    assert code == 0, out
    assert "  z_loss: {weight: 0.0001}" in out  # the YAML's weight, equal to the default
    assert "  cross_entropy: {weight: 1.0, label_smoothing: 0.0}" in out
    scored = re.search(r"^(\d+) of 40 rows scored: (\d+) targets are ignore_index \(-100\)$", out, re.M)
    assert scored is not None and int(scored[1]) + int(scored[2]) == 40 and int(scored[2]) > 0
    n_tokens = re.search(r"^metric n_tokens\s+(\S+)", out, re.M)
    assert float(n_tokens[1]) == int(scored[1])
