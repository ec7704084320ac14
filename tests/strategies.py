"""Hypothesis strategies shared by the property tests: random valid specs, cases (a spec with a batch
shape, dtype and options), and invalid spec dicts with the field they break. Derandomized (``CI``),
so every run draws the same cases."""

import math

from conftest import DTYPES
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from headloss import CrossEntropy, Entropy, LogitTransform, LossSpec, ZLoss
from headloss.spec import OUTPUT_NAMES

TEACHERLESS_OUTPUTS = tuple(name for name in OUTPUT_NAMES if not name.startswith("overlap_"))  # (a top-k teacher's)

CI = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _weight(low: float, high: float):
    return st.just(0.0) | st.floats(low, high, allow_nan=False, allow_infinity=False)


@st.composite
def valid_specs(draw) -> LossSpec:
    ce = draw(st.none() | st.builds(
        CrossEntropy,
        weight=_weight(0.05, 2.0),
        label_smoothing=st.just(0.0) | st.floats(0.01, 1.0),
    ))
    z = draw(st.none() | st.builds(ZLoss, weight=_weight(1e-4, 0.1)))
    entropy = draw(st.none() | st.builds(Entropy, weight=_weight(-0.5, 0.5)))
    token_accuracy = draw(st.booleans())
    outputs = tuple(draw(st.lists(st.sampled_from(TEACHERLESS_OUTPUTS), unique=True)))
    if not (ce or z or entropy or token_accuracy or outputs):
        ce = CrossEntropy()
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    if reduction == "none" and not (ce or z or entropy):
        reduction = "mean"
    transform = draw(st.builds(
        LogitTransform,
        logit_scale=st.just(1.0) | st.floats(0.5, 2.0),
        softcap=st.none() | st.floats(1.0, 30.0),
        temperature=st.just(1.0) | st.floats(0.5, 2.0),
    ))
    asks_topk = "topk_ids" in outputs or "topk_logprobs" in outputs
    return LossSpec(
        cross_entropy=ce,
        z_loss=z,
        entropy=entropy,
        token_accuracy=token_accuracy,
        student_topk=draw(st.integers(1, 64)) if asks_topk else draw(st.none() | st.integers(1, 64)),
        outputs=outputs,
        differentiable_outputs=draw(st.booleans()),
        transform=transform,
        ignore_index=draw(st.sampled_from([-100, -1, 0])),
        reduction=reduction,
    )


@st.composite
def cases(draw):
    spec = draw(valid_specs())
    vocab = draw(st.integers(1, 200))
    if draw(st.booleans()):
        token_shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    else:
        token_shape = (draw(st.integers(1, 9)),)
    strided = len(token_shape) == 2 and draw(st.booleans())
    has_targets = spec.needs_targets or draw(st.booleans())
    return dict(
        spec=spec,
        vocab=vocab,
        token_shape=token_shape,
        strided=strided,
        has_targets=has_targets,
        dtype=draw(st.sampled_from(DTYPES)),
        scale=draw(st.floats(0.5, 4.0)),
        ignore_frac=draw(st.sampled_from([0.0, 0.3])),
        num_items=draw(st.none() | st.integers(1, 20)) if spec.reduction == "mean" else None,
        inplace_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


BAD_VALUES = {
    ("cross_entropy", "weight"): [-1.0, math.nan, math.inf, "heavy"],
    ("cross_entropy", "label_smoothing"): [-0.01, 1.5, math.nan, math.inf],
    ("z_loss", "weight"): [-1e-4, math.nan, math.inf],
    ("entropy", "weight"): [math.nan, math.inf, -math.inf, "some"],
    ("transform", "logit_scale"): [0.0, -1.0, math.nan, math.inf],
    ("transform", "softcap"): [0.0, -3.0, math.nan, math.inf],
    ("transform", "temperature"): [0.0, -0.5, math.nan, math.inf],
    ("reduction",): ["avg", "MEAN", 1],
    ("outputs",): [["logits"], ["lse", "lse"], [3]],
    ("ignore_index",): [1.5, "none", None],
    ("token_accuracy",): ["sometimes", 2],
    ("differentiable_outputs",): ["maybe", 3],
    ("cross_entropy",): [5, "ce"],
}


@st.composite
def invalid_spec_dicts(draw) -> tuple[dict, str]:
    """A valid spec's dict with one field broken: (data, the name the error must contain)."""
    data = draw(valid_specs()).to_dict()
    if draw(st.booleans()):
        path = draw(st.sampled_from(sorted(BAD_VALUES)))
        value = draw(st.sampled_from(BAD_VALUES[path]))
        if len(path) == 2:
            parent = data[path[0]] if isinstance(data.get(path[0]), dict) else {}
            data[path[0]] = {**parent, path[1]: value}
        else:
            data[path[0]] = value
        return data, ".".join(path)
    key = draw(st.from_regex(r"[a-z]{2,10}_xx", fullmatch=True))
    nested = [name for name, value in data.items() if isinstance(value, dict)]
    where = draw(st.sampled_from([None, *nested]))
    target = data if where is None else data[where]
    target[key] = draw(st.integers() | st.text(max_size=5) | st.none())
    return data, key
