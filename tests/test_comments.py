"""Each setting is explained once, by the comment above its field in the schema: every key of every
schema has one, and its first sentence is a short form that closes an error line."""

import dataclasses
import typing

import pytest

from rlnotes.algos.registry import REGISTRY
from rlnotes.core.comments import comment, comments, field_type, summary
from rlnotes.core.schema import AlgoConfig, TrainConfig


def keys(schema, prefix=""):
    """(key, schema, field) of every field of a schema and the dataclasses it nests; the fields of a
    list's items as `key[].field` (reward.functions[].fn)."""
    for f in dataclasses.fields(schema):
        key, kind = prefix + f.name, field_type(schema, f.name)
        yield key, schema, f.name
        item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        if dataclasses.is_dataclass(kind):
            yield from keys(kind, key + ".")
        elif dataclasses.is_dataclass(item):
            yield from keys(item, key + "[].")


def test_every_key_of_the_composed_config_has_a_comment():
    schemas = {"": TrainConfig, **{f"algo={name}: algo.": algo.schema for name, algo in REGISTRY.items()}}
    missing = [f"{where}{key}" for where, schema in schemas.items() for key, cls, name in keys(schema)
               if not comments(cls).get(name)]
    assert not missing, f"fields without a comment above them: {missing}"


def test_a_redeclared_field_keeps_the_comment_of_the_class_it_overrides():
    assert comments(REGISTRY["grpo"].schema)["name"] == comments(AlgoConfig)["name"]
    assert "DeepSeekMath" in comments(REGISTRY["grpo"].schema)["beta"]


def test_a_dotted_key_finds_the_comment_of_a_nested_field():
    assert comment(TrainConfig, "model.lora.r").startswith("The rank of LoRA's update")
    assert comment(TrainConfig, "model.nope") is None and comment(TrainConfig, "seed.x") is None


@pytest.mark.parametrize("text, short", [
    ("Optimizer steps.", "optimizer steps"),
    ("AdamW's step size. More.", "AdamW's step size"),
    ("GAE's lambda. Schulman et al. 2015; RLHF PPO uses 0.95.", "GAE's lambda"),
    ("Digits per operand. arith: of each operand.", "digits per operand"),
    ("Per-token KL estimator (DeepSeekMath uses k3).", "per-token KL estimator (DeepSeekMath uses k3)"),
    ("Drop groups (Yu et al. 2025, Sec. 3.2). Then more.", "drop groups (Yu et al. 2025, Sec. 3.2)"),
    ("Half of Dr. GRPO's loss, e.g. 0.5 of it. Then more.", "half of Dr. GRPO's loss, e.g. 0.5 of it"),
    ("The mass (1.0 = all. Even so). Then more.", "the mass (1.0 = all. Even so)"),
    ("GiB of activations; null = no limit", "GiB of activations; null = no limit"),
])
def test_the_short_form_is_the_first_sentence(text, short):
    assert summary(text) == short
