"""LossSpec as data: defaults, serialisation round trips, config files, immutability, coercion."""

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from pydantic import ValidationError
from strategies import CI, invalid_spec_dicts, valid_specs

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss
from headloss.spec import OUTPUT_NAMES

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))

SPECS = {
    "default": LossSpec(),
    "everything": LossSpec(
        cross_entropy=CrossEntropy(weight=0.9, label_smoothing=0.1),
        z_loss=ZLoss(weight=2e-4),
        entropy=Entropy(weight=-0.01),
        token_accuracy=True,
        outputs=("entropy", "predicted_tokens", "logprobs", "lse", "token_loss"),
        differentiable_outputs=True,
        transform=LogitTransform(logit_scale=0.5, softcap=30.0, temperature=0.7),
        ignore_index=-1,
        reduction="none",
    ),
    "entropy_only": LossSpec(cross_entropy=None, entropy=Entropy(weight=0.0), outputs=("entropy",)),
    "sum_with_z_loss": LossSpec(z_loss=ZLoss(), reduction="sum", ignore_index=0),
}


def test_default_spec_is_mean_cross_entropy():
    spec = LossSpec()
    assert spec.cross_entropy == CrossEntropy(weight=1.0, label_smoothing=0.0)
    assert spec.z_loss is None and spec.entropy is None
    assert spec.reduction == "mean" and spec.ignore_index == -100
    assert spec.outputs == () and not spec.token_accuracy and not spec.differentiable_outputs
    assert spec.transform.is_identity
    assert list(spec.terms) == ["cross_entropy"] and spec.needs_targets


@pytest.mark.parametrize("name", list(SPECS))
def test_yaml_round_trip_gives_an_equal_spec(name, tmp_path):
    spec = SPECS[name]
    path = tmp_path / "spec.yaml"
    path.write_text(spec.to_yaml())
    assert LossSpec.from_file(path) == spec
    yml = tmp_path / "spec.yml"
    yml.write_text(spec.to_yaml())
    assert LossSpec.from_file(str(yml)) == spec


@pytest.mark.parametrize("name", list(SPECS))
def test_json_round_trip_gives_an_equal_spec(name, tmp_path):
    spec = SPECS[name]
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    assert LossSpec.from_file(path) == spec
    assert json.loads(spec.to_json()) == spec.to_dict()


@pytest.mark.parametrize("name", list(SPECS))
def test_dict_round_trip_gives_an_equal_spec(name):
    spec = SPECS[name]
    data = spec.to_dict()
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # plain data, no Python objects
    assert LossSpec.model_validate(data) == spec
    assert LossSpec.coerce(data) == spec


def test_yaml_keeps_the_field_order_of_the_model():
    keys = [line.split(":")[0] for line in SPECS["everything"].to_yaml().splitlines() if not line[0].isspace()]
    assert keys[:4] == ["cross_entropy", "z_loss", "dft", "entropy"]


@pytest.mark.parametrize(
    "name,text",
    [("empty.yaml", ""), ("comments.yaml", "# nothing set\n"), ("blank.yml", "\n  \n"), ("empty.json", ""),
     ("blank.json", "  \n")],
)
def test_a_spec_file_without_a_spec_is_an_error_naming_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: the file holds no spec .* write {{}} for the default"):
        LossSpec.from_file(path)


def test_an_explicit_empty_mapping_is_the_default_spec(tmp_path):
    for name in ("default.yaml", "default.json"):
        (tmp_path / name).write_text("{}\n")
        assert LossSpec.from_file(tmp_path / name) == LossSpec()
    assert LossSpec.coerce({}) == LossSpec()


@pytest.mark.parametrize(
    "name,text,line",
    [("bad.yaml", "cross_entropy:\n  weight: [1,\n", 3), ("tabs.yaml", "z_loss:\n\tweight: 1\n", 2),
     ("bad.json", '{\n  "z_loss": {"weight": }\n}', 2), ("trailing.json", '{"z_loss": {}},', 1)],
)
def test_invalid_yaml_or_json_raises_value_error_naming_the_file_and_line(tmp_path, name, text, line):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name}: invalid (YAML|JSON) at line {line}\b"):
        LossSpec.from_file(path)


def test_a_missing_spec_file_raises_file_not_found_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml: cannot read the spec file"):
        LossSpec.from_file(tmp_path / "missing.yaml")


@pytest.mark.skipif(not CONFIGS, reason="no configs/*.yaml in this checkout")
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_file_loads_and_starts_with_a_comment(path):
    text = path.read_text()
    assert text.startswith("#"), f"{path.name} must start with a '#' comment line saying what it is for"
    spec = LossSpec.from_file(path)
    assert LossSpec.coerce(str(path)) == spec
    assert LossSpec.model_validate(yaml.safe_load(spec.to_yaml())) == spec


@pytest.mark.parametrize(
    "assign",
    [
        lambda s: setattr(s, "reduction", "sum"),
        lambda s: setattr(s, "ignore_index", 0),
        lambda s: setattr(s.cross_entropy, "weight", 2.0),
        lambda s: setattr(s.transform, "temperature", 2.0),
    ],
    ids=["reduction", "ignore_index", "nested_weight", "nested_temperature"],
)
def test_spec_is_frozen(assign):
    spec = LossSpec()
    with pytest.raises(ValidationError, match="frozen"):
        assign(spec)
    assert spec == LossSpec()


def test_equal_specs_hash_equal_and_work_as_dict_keys():
    a = LossSpec(z_loss=ZLoss(weight=1e-4), outputs=("lse", "logprobs"))
    b = LossSpec.model_validate({"z_loss": {"weight": 1e-4}, "outputs": ["logprobs", "lse"]})
    assert a == b and hash(a) == hash(b)
    assert len({a, b, LossSpec()}) == 2
    assert {a: 1}[b] == 1
    assert a != LossSpec(z_loss=ZLoss(weight=2e-4), outputs=("lse", "logprobs"))


def test_outputs_are_stored_in_canonical_order():
    spec = LossSpec(outputs=("entropy", "lse", "predicted_tokens"))
    assert spec.outputs == ("predicted_tokens", "lse", "entropy")
    assert OUTPUT_NAMES == ("predicted_tokens", "logprobs", "lse", "token_loss", "entropy", "selected_logprobs",
                            "topk_ids", "topk_logprobs", "overlap_count", "overlap_token_advantage")


def test_coerce_accepts_spec_dict_and_paths(tmp_path):
    spec = SPECS["everything"]
    assert LossSpec.coerce(spec) is spec
    assert LossSpec.coerce(spec.to_dict()) == spec
    path = tmp_path / "s.yaml"
    path.write_text(spec.to_yaml())
    assert LossSpec.coerce(path) == spec
    assert LossSpec.coerce(str(path)) == spec
    with pytest.raises(TypeError, match="spec: expected LossSpec, dict or a path, got list"):
        LossSpec.coerce([("reduction", "sum")])


@pytest.mark.parametrize(
    "spec,needs",
    [
        (LossSpec(), True),
        (LossSpec(cross_entropy=None, token_accuracy=True), True),
        (LossSpec(cross_entropy=None, outputs=("logprobs",)), True),
        (LossSpec(cross_entropy=None, entropy=Entropy(), outputs=("lse", "predicted_tokens")), False),
        (LossSpec(cross_entropy=None, z_loss=ZLoss()), False),
    ],
    ids=["cross_entropy", "token_accuracy", "logprobs", "entropy_lse_argmax", "z_loss"],
)
def test_needs_targets_follows_the_requested_values(spec, needs):
    assert spec.needs_targets is needs


def test_terms_are_the_present_terms_in_fixed_order():
    spec = LossSpec(entropy=Entropy(weight=0.1), z_loss=ZLoss())
    assert list(spec.terms) == ["cross_entropy", "z_loss", "entropy"]
    assert list(LossSpec(cross_entropy=None, entropy=Entropy()).terms) == ["entropy"]


@pytest.mark.parametrize(
    "transform,identity",
    [
        (LogitTransform(), True),
        (LogitTransform(softcap=30.0), False),
        (LogitTransform(temperature=0.5), False),
        (LogitTransform(logit_scale=2.0), False),
    ],
    ids=["default", "softcap", "temperature", "logit_scale"],
)
def test_transform_is_identity_only_with_defaults(transform, identity):
    assert transform.is_identity is identity


@CI
@given(bad=invalid_spec_dicts())
def test_invalid_spec_dicts_raise_validation_error_naming_the_field(bad):
    data, field = bad
    with pytest.raises(ValidationError) as info:
        LossSpec.model_validate(data)
    assert field in str(info.value), f"{field!r} not named in: {info.value}"


@CI
@given(spec=valid_specs())
def test_random_valid_specs_round_trip_through_yaml_and_json(spec):
    assert LossSpec.model_validate(spec.to_dict()) == spec
    assert LossSpec.model_validate(yaml.safe_load(spec.to_yaml())) == spec
    assert LossSpec.model_validate(json.loads(spec.to_json())) == spec
