"""The public names and signatures are an API: users write `from rlnotes.notes import gae`."""

import inspect

import rlnotes.notes as notes

SIGNATURES = {
    "returns_to_go": "(rewards, mask, gamma=1.0)",
    "truncated_is_weights": "(logprobs, sampler_logprobs, cap)",
    "policy_gradient_loss": "(logprobs, advantages, mask, aggregation='token-mean')",
    "kl_penalty": "(logprobs, ref_logprobs, estimator='k3')",
    "gae": "(rewards, values, mask, gamma=1.0, lam=0.95)",
    "ppo_clip_loss": "(logprobs, old_logprobs, advantages, clip_eps=0.2, clip_eps_high=None)",
    "ppo_clip_fraction": "(logprobs, old_logprobs, advantages, mask, clip_eps=0.2, clip_eps_high=None)",
    "value_loss": "(values, old_values, returns, clip_eps=None)",
    "ppo_loss": "(logprobs, old_logprobs, advantages, values, old_values, returns, mask, clip_eps=0.2, "
    "value_clip_eps=None, vf_coef=0.5, entropy=None, entropy_coef=0.0, aggregation='token-mean', max_len=None)",
    "group_advantages": "(rewards, group_size, scale_by_std=True, eps=0.0001)",
    "informative_groups": "(rewards, group_size)",
    "aggregate": "(values, mask, mode='token-mean', max_len=None)",
    "aggregation_divisor": "(mode, tokens, rows, length)",
    "masked_mean": "(values, mask, dim=None)",
    "masked_sum": "(values, mask, dim=None)",
    "masked_whiten": "(values, mask, shift_mean=True)",
    "grpo_loss": "(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps=0.2, beta=0.04, "
    "clip_eps_high=None, kl_estimator='k3', aggregation='seq-mean-token-mean', max_len=None)",
    "dpo_loss": "(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, "
    "beta=0.1, loss_type='sigmoid', label_smoothing=0.0)",
    "dpo_implicit_rewards": "(policy_logps, ref_logps, beta)",
    "bradley_terry_loss": "(chosen_rewards, rejected_rewards)",
}
TABLES = {
    "AGGREGATIONS": {
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    },
    "KL_ESTIMATORS": {"k1", "k2", "k3"},
    "DPO_LOSS_TYPES": {"sigmoid", "ipo"},
}


def plain_signature(fn) -> str:
    params = inspect.signature(fn).parameters.values()
    return str(inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params]))


def test_exported_names():
    assert set(notes.__all__) == set(SIGNATURES) | set(TABLES)
    for name in notes.__all__:
        assert getattr(notes, name) is not None


def test_signatures_and_docstrings():
    for name, expected in SIGNATURES.items():
        fn = getattr(notes, name)
        assert plain_signature(fn) == expected, name
        assert fn.__doc__ and len(fn.__doc__.splitlines()[0]) > 20, name  # the equation line


def test_choice_tables():
    for name, keys in TABLES.items():
        assert set(getattr(notes, name)) == keys
