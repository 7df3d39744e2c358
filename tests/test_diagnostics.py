"""Batch arithmetic by hand, the config errors it implies, and each diagnostics warning: its
condition on hand-made histories, and a tiny run built to trigger it (a healthy run triggers none)."""

import io

import pytest
from rich.console import Console

from rlnotes.algos.registry import REGISTRY
from rlnotes.commands.check import UsageError, check
from rlnotes.commands.train import train
from rlnotes.run.diagnostics import (
    CHECKS,
    History,
    Settings,
    Watcher,
    batch_arithmetic,
    check_clip_fraction,
    check_entropy_collapse,
    check_kl_blowup,
    check_reward_failures,
    check_truncation,
    check_zero_variance,
    describe_batches,
    reward_flat,
)
from tests.conftest import compose

# ---------------------------------------------------------------------------------------------
# batch arithmetic


def arith(cfg, train_rows=None):
    """batch_arithmetic of a composed config, with its algorithm's shape; train_rows defaults to
    data.train_size (the train split of a built-in task)."""
    return batch_arithmetic(cfg.trainer, REGISTRY[cfg.algo.name].shape(cfg), train_rows or cfg.data.train_size)


def test_grpo_default_batches():
    a = arith(compose())
    assert a == {"unit": "prompts", "prompts_per_batch": 8, "completions_per_batch": 32, "micro_batch_size": 32,
                 "micro_batches": 1, "minibatches": 1, "updates_per_batch": 1, "batches": 60, "optimizer_steps": 60,
                 "max_tokens_per_batch": 32 * 16, "prompts_seen": 480, "prompts_seen_max": 480,
                 "epochs": 0.48, "epochs_max": 0.48, "micro_batch_tokens": None, "micro_batch_memory": 1.0}
    # Without trainer.micro_batch_size the passes are cut by a token budget, as each batch's lengths need.
    assert "; micro-batches of at most 1 GiB of activations; " in describe_batches(a)
    tokens = arith(compose("trainer.micro_batch_tokens=1024"))
    assert (tokens["micro_batch_tokens"], tokens["micro_batch_memory"]) == (1024, None)
    assert "; micro-batches of at most 1,024 tokens; " in describe_batches(tokens)
    sized = arith(compose("trainer.micro_batch_size=8", "trainer.micro_batch_tokens=1024"))
    assert (sized["micro_batch_tokens"], sized["micro_batch_memory"], sized["micro_batches"]) == (None, None, 4)


def test_grpo_epochs_and_micro_batches():
    a = arith(compose("algo.epochs=2", "trainer.steps=10", "trainer.micro_batch_size=8",
                                 "rollout.max_new_tokens=8"))
    # 32 completions in passes of 8: 4 passes per optimizer step; 2 steps per batch, so 5 batches.
    assert (a["micro_batches"], a["updates_per_batch"], a["batches"], a["prompts_seen"]) == (4, 2, 5, 40)
    assert a["max_tokens_per_batch"] == 256


def test_ppo_minibatches_and_updates():
    a = arith(compose("algo=ppo", "trainer.steps=10", "trainer.micro_batch_size=4"))
    # 32 completions / minibatch 16 = 2 minibatches; 2 epochs -> 4 updates a batch; 10 steps -> 3 batches.
    assert (a["minibatches"], a["updates_per_batch"], a["batches"]) == (2, 4, 3)
    assert (a["micro_batch_size"], a["micro_batches"], a["prompts_seen"]) == (4, 4, 24)
    assert describe_batches(a).startswith("batch: 8 prompts x 4 = 32 completions; 2 epochs x 2 minibatches of 16 = "
                                          "4 optimizer steps per batch; micro-batches of 4 completions (4 per")


def test_dynamic_sampling_sees_up_to_one_batch_per_round():
    a = arith(compose("algo=dapo", "algo.max_resample_rounds=2", "trainer.steps=10"), train_rows=100)
    assert (a["prompts_seen"], a["prompts_seen_max"]) == (80, 240)
    assert (a["epochs"], a["epochs_max"]) == (0.8, 2.4)
    assert "80 to 240 prompts = 0.8 to 2.4 epochs of the train set" in describe_batches(a)


def test_pairs_and_rows():
    dpo = arith(compose("algo=dpo", "trainer.micro_batch_size=4", "trainer.batch_size=8"))
    assert (dpo["unit"], dpo["completions_per_batch"], dpo["micro_batches"], dpo["max_tokens_per_batch"]) == (
        "pairs", 16, 2, None)
    assert describe_batches(dpo).splitlines() == [
        "batch: 8 pairs (16 sequences); 1 optimizer step per batch; micro-batches of 4 pairs (2 per optimizer step)",
        "run: 60 optimizer steps = 60 batches = 480 pairs = 0.48 epochs of the train set"]
    sft = arith(compose("algo=sft", "trainer.steps=5"), train_rows=20)
    assert (sft["unit"], sft["completions_per_batch"], sft["prompts_seen"], sft["epochs"]) == ("rows", 8, 40, 2.0)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.micro_batch_size=33"], "trainer.micro_batch_size=33 is larger than the 32 completions of a step "
                                      "(trainer.batch_size=8 x algo.group_size=4); lower it to at most 32 or set it "
                                      "to null"),
    (["algo=ppo", "trainer.micro_batch_size=17"], "trainer.micro_batch_size=17 is larger than the 16 completions of "
                                                  "one PPO update (algo.minibatch_size)"),
    (["trainer.micro_batch_size=5"], "trainer.micro_batch_size=5 does not divide the 32 completions of a step "
                                     "(trainer.batch_size=8 x algo.group_size=4) into equal passes; use one of 1, 2, "
                                     "4, 8, 16, 32, or null (one pass)"),
    (["hardware.nproc=2", "trainer.micro_batch_size=32"], "trainer.micro_batch_size=32 is larger than the 32 "
                                                          "completions of a step (trainer.batch_size=8 x "
                                                          "algo.group_size=4), 16 on each of 2 processes"),
    (["hardware.nproc=2", "trainer.micro_batch_size=32"], "lower it to at most 16"),
    (["hardware.nproc=2", "trainer.micro_batch_size=12"], "16 on each of 2 processes into equal passes; use one of 1, "
                                                          "2, 4, 8, 16, or null"),
    (["algo=ppo", "trainer.micro_batch_size=3"], "does not divide the 16 completions of one PPO update"),
    (["algo=dpo", "trainer.micro_batch_size=3"], "trainer.micro_batch_size=3 does not divide the 8 pairs of a step"),
    (["algo=sft", "trainer.micro_batch_size=5"], "trainer.micro_batch_size=5 does not divide the 8 rows of a step"),
    (["algo=dpo", "trainer.micro_batch_size=9"], "trainer.micro_batch_size=9 is larger than the 8 pairs of a step"),
    (["algo=sft", "trainer.micro_batch_size=9"], "trainer.micro_batch_size=9 is larger than the 8 rows of a step"),
    (["algo=dapo", "algo.max_resample_rounds=-1"], "algo.max_resample_rounds=-1 counts extra sampling rounds per "
                                                    "step with algo.dynamic_sampling and must be at least 0"),
    (["algo=ppo", "algo.minibatch_size=12"], "algo.minibatch_size=12 must divide trainer.batch_size * "
                                             "algo.group_size = 32 completions"),
    (["algo.epochs=7"], "trainer.steps=60 counts optimizer steps and must be a multiple of algo.epochs=7"),
    (["logging.samples_every=-1"], "logging.samples_every=-1 must be at least 0"),
    (["logging.samples_shown=0"], "logging.samples_shown=0 must be at least 1"),
    (["logging.print_every=0"], "logging.print_every=0 must be at least 1"),
])
def test_impossible_batches_fail_before_any_model_loads(overrides, message):
    with pytest.raises(UsageError) as err:
        check(overrides, multirun=False, config_dir=None)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_micro_batch_equal_to_the_batch_is_fine():
    check(["trainer.micro_batch_size=32"], multirun=False, config_dir=None)
    check(["algo=ppo", "trainer.micro_batch_size=16"], multirun=False, config_dir=None)


# ---------------------------------------------------------------------------------------------
# the checks on hand-made histories (WINDOW = 5 steps)


def history(**series):
    """A History from equal-length lists of values per metric (None = not logged that step)."""
    n = len(next(iter(series.values())))
    return History.of([{k: v[i] for k, v in series.items() if v[i] is not None} for i in range(n)])


def settings(cfg):
    """The Settings the watcher of a run of the composed config gets."""
    return Settings.of(cfg, REGISTRY[cfg.algo.name])


def zero_variance(history, cfg):
    return check_zero_variance(history, settings(cfg))


def test_zero_variance_needs_a_window_at_the_line_and_group_advantages():
    grpo = compose()
    assert zero_variance(history(**{"reward/zero_std_frac": [0.8] * 4}), grpo) is None  # not 5 steps yet
    assert zero_variance(history(**{"reward/zero_std_frac": [0.6, 0.8, 0.8, 0.8, 0.8]}), grpo) is None  # 0.76
    fired = zero_variance(history(**{"reward/zero_std_frac": [0.0, 0.8, 0.8, 0.8, 0.8, 0.8]}), grpo)
    assert fired.startswith("80% of groups") and "algo.group_size (now 4)" in fired and "denser reward" in fired
    full = history(**{"reward/zero_std_frac": [1.0] * 5})
    assert zero_variance(full, compose("algo=rloo")) is not None
    assert zero_variance(full, compose("algo=ppo")) is None  # a value baseline still learns from it
    assert zero_variance(full, compose("algo=reinforce")) is None  # running-mean baseline


def test_entropy_collapse_below_a_tenth_of_a_nat():
    cfg = compose()
    assert check_entropy_collapse(history(**{"policy/entropy": [0.1] * 5}), settings(cfg)) is None
    fired = check_entropy_collapse(history(**{"policy/entropy": [4.0, 0.05, 0.05, 0.1, 0.1, 0.1]}), settings(cfg))
    assert fired.startswith("entropy collapsed: 0.080 nats") and "rollout.temperature (now 1.0)" in fired


def test_kl_line_is_the_larger_of_one_nat_and_the_starting_entropy():
    cfg = compose()
    peaked = {"policy/entropy": [0.5] * 6}   # line = max(1, 0.5) = 1
    assert check_kl_blowup(history(**peaked, **{"kl/ref": [1.0] * 6}), settings(cfg)) is None
    fired = check_kl_blowup(history(**peaked, **{"kl/ref": [0.0, 1.2, 1.2, 1.2, 1.2, 1.2]}), settings(cfg))
    assert fired.startswith("KL to the reference blew up: 1.20 nats") and "above 1.00" in fired
    assert "optim.lr (now 0.003)" in fired and "algo.beta (now 0.04)" in fired
    flat = {"policy/entropy": [4.0] * 5 + [1.0]}  # a near-uniform start: line = 4.0 from the first 5 steps
    assert check_kl_blowup(history(**flat, **{"kl/ref": [3.9] * 6}), settings(cfg)) is None
    assert check_kl_blowup(history(**flat, **{"kl/ref": [4.1] * 6}), settings(cfg)) is not None
    no_ref = history(**{"policy/entropy": [0.5] * 5, "kl/ref": [float("nan")] * 5})  # beta = 0: no KL measured
    assert check_kl_blowup(no_ref, settings(cfg)) is None


def test_reward_flat_compares_the_first_and_last_windows():
    assert reward_flat(history(**{"reward/mean": [0.0] * 9})) is None  # the windows would overlap
    # Half the mean within-batch std is 0.05: a rise of 0.05 is still flat, 0.06 is not.
    assert reward_flat(history(**{"reward/mean": [0.1] * 5 + [0.15] * 5, "reward/std": [0.1] * 10})) is True
    assert reward_flat(history(**{"reward/mean": [0.1] * 5 + [0.16] * 5, "reward/std": [0.1] * 10})) is False


def test_truncation_warns_only_while_the_reward_is_flat():
    cfg = compose("rollout.max_new_tokens=8")
    flat = {"reward/mean": [0.0] * 10, "reward/std": [0.0] * 10}
    fired = check_truncation(history(**flat, **{"completion/truncated_frac": [0.5] * 10}), settings(cfg))
    assert fired.startswith("50% of completions") and "rollout.max_new_tokens=8" in fired
    assert check_truncation(history(**flat, **{"completion/truncated_frac": [0.4] * 10}), settings(cfg)) is None
    rising = {"reward/mean": [0.0] * 5 + [0.5] * 5, "reward/std": [0.1] * 10}
    assert check_truncation(history(**rising, **{"completion/truncated_frac": [1.0] * 10}), settings(cfg)) is None


def test_reward_failures_share_of_the_window():
    cfg = compose()  # 32 completions a step: 5 steps = 160 completions, 10% = 16
    assert check_reward_failures(history(**{"reward/failures": [3, 3, 3, 3, 3]}), settings(cfg)) is None  # 15
    fired = check_reward_failures(history(**{"reward/failures": [0, 4, 3, 3, 3, 3]}), settings(cfg))  # 16 in the last 5
    assert fired.startswith("the reward failed on 10% of the completions") and "reward.fallback=0.0" in fired


def test_clip_fraction_above_three_tenths():
    cfg = compose("algo=ppo")
    assert check_clip_fraction(history(**{"policy/clip_frac": [0.3] * 5}), settings(cfg)) is None
    fired = check_clip_fraction(history(**{"policy/clip_frac": [0.31] * 5}), settings(cfg))
    assert fired.startswith("31% of tokens") and "algo.epochs (now 2)" in fired


def test_watcher_warns_once_per_kind():
    watcher = Watcher(settings(compose()))
    fired = [w for step in range(1, 12) for w in watcher.observe(step, {"policy/entropy": 0.01, "kl/ref": 0.0})]
    assert [(w.kind, w.step) for w in fired] == [("entropy_collapse", 5)]


# ---------------------------------------------------------------------------------------------
# tiny runs built to trigger each warning, and a healthy one that triggers none


def constant(prompts, completions, **_):
    return [1.0] * len(completions)


def flaky(prompts, completions, **_):
    """Raises for completions that start with a lowercase letter (about a quarter at the start)."""
    if any(c[:1].islower() for c in completions):
        raise ValueError("cannot score that")
    return [0.5] * len(completions)


def warned(tmp_path, *overrides):
    console = Console(file=io.StringIO(), width=200)
    train(compose("logging.progress=false", "logging.samples_every=0", *overrides), tmp_path, console)
    log = tmp_path / "warnings.log"
    kinds = [line.split()[2].rstrip(":") for line in log.read_text().splitlines()] if log.exists() else []
    assert len(kinds) == len(set(kinds))  # once per kind
    for kind in kinds:
        assert f"({kind}):" in console.file.getvalue()
    return kinds


@pytest.mark.parametrize("kind, overrides", [
    ("zero_variance", ["reward=custom", "reward.target=tests.test_diagnostics.constant", "trainer.steps=6"]),
    ("entropy_collapse", ["rollout.temperature=0.01", "trainer.steps=6"]),
    ("kl_blowup", ["model.tiny.init_std=0.5", "optim.lr=0.1", "algo.beta=0.0001", "trainer.steps=8"]),
    ("truncation", ["data=arith", "rollout.max_new_tokens=1", "trainer.steps=12"]),
    ("reward_failures", ["reward=custom", "reward.target=tests.test_diagnostics.flaky", "trainer.steps=6"]),
    ("clip_fraction", ["algo=ppo", "optim.lr=0.02", "algo.epochs=4", "trainer.steps=40"]),
])
def test_a_run_built_to_trigger_a_warning_gets_it(tmp_path, kind, overrides):
    assert kind in warned(tmp_path, *overrides)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_healthy_default_run_gets_no_warning(tmp_path, algo):
    """The default run's first 40 steps: the climb from random text to the letter (reward ~0.02 ->
    ~0.8, entropy 4.3 -> 1.3, KL 0 -> 3 nats, every completion at the length cap) warns of nothing."""
    assert warned(tmp_path, f"algo={algo}", "trainer.steps=40") == []


def test_every_check_is_tested():
    assert set(CHECKS) == {"zero_variance", "entropy_collapse", "kl_blowup", "truncation", "reward_failures",
                           "clip_fraction"}
