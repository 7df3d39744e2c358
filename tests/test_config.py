"""Values, not only keys, are checked before anything loads: every numeric setting has a range
(core.checks.RANGES, and each algorithm's own `ranges` for its section), NaN and infinity are
refused everywhere, and each mistake is one line naming the key, the value, the valid range and
what the setting is (the first sentence of its schema comment)."""

import dataclasses
import typing

import pytest
from omegaconf import OmegaConf

from rlnotes.algos.registry import REGISTRY
from rlnotes.commands.check import check
from rlnotes.commands.cli import UsageError, main
from rlnotes.commands.validate import validate
from rlnotes.core.checks import CHECKED_ELSEWHERE, RANGES, meaning_of
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import TrainConfig


def one_line(overrides):
    with pytest.raises(UsageError) as err:
        check(list(overrides), multirun=False, config_dir=None)
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


# The values that gave tracebacks or silently odd runs, through the real command-line check.
@pytest.mark.parametrize("overrides, expected", [
    (["algo.beta=-0.1"], "algo.beta=-0.1 must be at least 0 (the weight of the KL penalty"),
    (["algo.beta=nan"], "algo.beta=nan is not a number; it must be at least 0"),
    (["algo=dpo", "algo.beta=0"], "algo.beta=0 must be greater than 0 (the strength of DPO's implicit KL"),
    (["optim.lr=inf"], "optim.lr=inf is not finite; it must be in (0, 1] (AdamW's step size"),
    (["optim.lr=1e6", "optim.eps=0"], "optim.lr=1e+06 must be in (0, 1]"),
    (["optim.eps=0"], "optim.eps=0 must be greater than 0 (added to AdamW's denominator; 0 divides 0 by 0"),
    (["algo.clip_eps=5"], "algo.clip_eps=5 must be in (0, 1) (the clip range of the ratio"),
    (["algo=ppo", "algo.clip_eps=5"], "algo.clip_eps=5 must be in (0, 1)"),
    (["hardware.threads=0"], "hardware.threads=0 must be at least 1 (torch threads per process; null = torch's"),
    (["model.lora.r=0"], "model.lora.r=0 must be at least 1 (the rank of LoRA's update"),
    (["model.lora.alpha=-1"], "model.lora.alpha=-1 must be greater than 0"),
    (["model.lora.dropout=1"], "model.lora.dropout=1 must be in [0, 1)"),
    (["rollout.temperature=0"], "rollout.temperature=0 must be greater than 0"),
    (["algo=ppo", "algo.lam=1.5"], "algo.lam=1.5 must be in [0, 1] (GAE's lambda)"),
    (["reward.fallback=nan"], "reward.fallback=nan is not a finite number"),
    (["seed=1180591620717411303424"], "seed=1180591620717411303424 must be in [-9223372036854775808, "
                                      "18446744073709551616) (seed of sampling"),  # torch.manual_seed's range
    (["model.tiny.init_seed=-9223372036854775809"], "model.tiny.init_seed=-9223372036854775809 must be in ["),
])
def test_a_bad_value_fails_in_one_line_naming_key_value_and_range(overrides, expected):
    assert expected in one_line(overrides)


def test_the_command_prints_it_as_one_error_line(capsys):
    assert main(["train", "optim.lr=inf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: optim.lr=inf is not finite; it must be in (0, 1]") and "\n" not in err


# ---------------------------------------------------------------------------------------------
# Every range of the table, on both sides, against the real validate


def numeric_fields(schema, prefix):
    """{key: int or float} of every numeric field of a schema dataclass, nested ones included."""
    out = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if typing.get_origin(kind) is typing.Union and len(args) == 1 else kind
        if kind in (int, float):
            out[f"{prefix}{f.name}"] = kind
        elif dataclasses.is_dataclass(kind):
            out.update(numeric_fields(kind, f"{prefix}{f.name}."))
    return out


FIELDS = numeric_fields(TrainConfig, "")
ALGO_FIELDS = {name: numeric_fields(algo.schema, "algo.") for name, algo in REGISTRY.items()}
SEEDS = ("seed", "data.seed", "model.tiny.init_seed")


def test_every_numeric_setting_has_a_range_and_every_range_a_setting():
    unchecked = {k for k in FIELDS if not k.startswith("reward.")} - set(RANGES) - set(CHECKED_ELSEWHERE) - set(SEEDS)
    unchecked |= {f"algo={name}: {key}" for name, fields in ALGO_FIELDS.items() for key in fields
                  if key not in REGISTRY[name].ranges and key not in CHECKED_ELSEWHERE}
    assert not unchecked, f"numeric settings without a range: {sorted(unchecked)}"
    assert not set(RANGES) - set(FIELDS), "ranges of keys no schema has"
    assert all(set(algo.ranges) <= set(ALGO_FIELDS[name]) for name, algo in REGISTRY.items()), \
        "an algorithm's ranges of keys its schema lacks"


def bad_values(spec, kind):
    """Values just outside `spec` on each bounded side, and NaN and infinity for a float."""
    step = 1 if kind is int else 0.5
    if spec.startswith(">"):
        bound = kind(float(spec.lstrip(">= ")))
        out = [bound - step if spec.startswith(">=") else bound]
    else:
        low, high = (kind(float(x)) for x in spec[1:-1].split(","))
        out = [low - step if spec[0] == "[" else low, high + step if spec[-1] == "]" else high]
    return out + ([float("nan"), float("inf"), float("-inf")] if kind is float else [])


def cases():
    for name, fields in ALGO_FIELDS.items():
        ranges = REGISTRY[name].ranges
        for key, kind in fields.items():
            if key in ranges:
                yield from ((name, key, kind, ranges[key], v) for v in bad_values(ranges[key], kind))
    for key, kind in FIELDS.items():
        if key in RANGES:
            yield from (("grpo", key, kind, RANGES[key], v) for v in bad_values(RANGES[key], kind))


CASES = list(cases())


@pytest.fixture(scope="module")
def configs():
    """The composed config of each algorithm, as `rlnotes train algo=NAME` checks it."""
    from tests.conftest import compose

    return {name: compose(f"algo={name}") for name in REGISTRY}


def test_every_range_is_tested():
    ranges = {*RANGES, *(f"{name}:{key}" for name, algo in REGISTRY.items() for key in algo.ranges)}
    tested = {key if key in RANGES else f"{name}:{key}" for name, key, *_ in CASES}
    assert tested == ranges and len(CASES) > 2 * len(ranges)


@pytest.mark.parametrize("algo, key, kind, spec, value", CASES, ids=[f"{c[0]}-{c[1]}={c[4]}" for c in CASES])
def test_a_value_outside_its_range_is_refused(configs, algo, key, kind, spec, value):
    cfg = configs[algo].copy()
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    shown = format(value, "g") if kind is float else str(value)
    text = str(err.value)
    assert text.startswith(f"{key}={shown} ") and spec.strip("<>= ") in text and "\n" not in text, text
    assert text.endswith(f" ({meaning_of(key, REGISTRY[algo].schema)})"), text  # what the schema says it is


@pytest.mark.parametrize("overrides", [
    ["algo.beta=0", "optim.lr=1", "optim.beta1=0", "rollout.top_p=1", "hardware.threads=1", "model.lora.dropout=0"],
    ["algo=ppo", "algo.gamma=0", "algo.lam=1", "algo.entropy_coef=0", "algo.clip_eps=0.999"],
    ["algo=reinforce", "algo.baseline_momentum=0", "algo.vf_coef=0", "hardware.threads=null"],
    ["algo=dpo", "algo.beta=1e-3", "algo.label_smoothing=0.49", "optim.weight_decay=0", "optim.max_grad_norm=null"],
])
def test_values_at_the_edges_of_their_ranges_pass(overrides):
    check(overrides, multirun=False, config_dir=None)
