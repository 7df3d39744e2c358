"""Policy/reference pair: the adapter off is the base model, a fresh adapter changes nothing,
and log-probs do not depend on padding or batching."""

import torch
from omegaconf import OmegaConf

from rlnotes.core.schema import ModelConfig
from rlnotes.engine.model.loading import load_base
from rlnotes.engine.policy.head import head_logprobs
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.rollout import left_pad


def make_policy(lora=True):
    cfg = OmegaConf.structured(ModelConfig(name_or_path="tiny"))
    cfg.lora.target_modules = ["all-linear"]
    if not lora:
        cfg.lora = None
    return Policy.from_config(cfg, torch.device("cpu"))


def batch(tokenizer, prompts, completions):
    """[left-padded prompt | right-padded completion] rows and their completion mask."""
    p_ids, p_mask = left_pad([tokenizer(p)["input_ids"] for p in prompts], tokenizer.pad_token_id)
    comp = [tokenizer(c)["input_ids"] for c in completions]
    width = max(map(len, comp))
    c_ids = torch.full((len(comp), width), tokenizer.pad_token_id)
    c_mask = torch.zeros(len(comp), width)
    for i, c in enumerate(comp):
        c_ids[i, :len(c)] = torch.tensor(c)
        c_mask[i, :len(c)] = 1
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask.long()], 1), c_mask


def perturb_adapter(policy):
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)


def test_head_logprobs_matches_log_softmax():
    head = torch.nn.Linear(4, 11)  # trainable: the autograd path (test_shared_prompt tests the frozen one)
    hidden, tokens = torch.randn(3, 5, 4), torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(head_logprobs(hidden, head, tokens, 0.7)[0], expected)


def test_fresh_adapter_is_the_reference_and_disabling_it_gives_the_base():
    policy = make_policy()
    ids, attn, _ = batch(policy.tokenizer, ["Write the letter a:", "Hi"], ["aaa", "b"])
    base, _ = load_base(OmegaConf.structured(ModelConfig(name_or_path="tiny")))
    expected = sequence_logprobs(base, ids, attn, 3)
    # LoRA's B starts at zero: the policy equals the reference, so the first ratio is exactly 1.
    torch.testing.assert_close(policy.logprobs(ids, attn, 3), expected)
    perturb_adapter(policy)
    assert (policy.logprobs(ids, attn, 3) - expected).abs().max() > 1e-3
    torch.testing.assert_close(policy.ref_logprobs(ids, attn, 3), expected)


def test_the_reference_context_gives_the_adapter_back_trainable():
    policy = make_policy()
    perturb_adapter(policy)
    ids, attn, _ = batch(policy.tokenizer, ["Write the letter a:"], ["aaa"])
    before, trainable = policy.logprobs(ids, attn, 3).detach(), policy.trainable_parameters()
    with policy.reference():
        assert not policy.trainable_parameters()
    torch.testing.assert_close(policy.logprobs(ids, attn, 3), before)
    assert policy.trainable_parameters() == trainable


def test_train_and_eval_set_every_modules_flag_as_the_models_own_do():
    policy = make_policy()
    policy.eval()
    assert not any(m.training for m in policy.model.modules())
    policy.train()
    assert all(m.training for m in policy.model.modules())


def test_full_finetuning_keeps_a_frozen_reference():
    policy = make_policy(lora=False)
    assert not policy.uses_lora
    ids, attn, _ = batch(policy.tokenizer, ["abc"], ["de"])
    before = policy.ref_logprobs(ids, attn, 2)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.1)
    torch.testing.assert_close(policy.ref_logprobs(ids, attn, 2), before)
    assert (policy.logprobs(ids, attn, 2) - before).abs().max() > 1e-3
    assert all(not p.requires_grad for p in policy._reference.parameters())


def test_logprobs_do_not_depend_on_padding_or_batch_company():
    policy = make_policy()
    perturb_adapter(policy)
    prompts, completions = ["Write the letter a:", "Hi", "What is 2+3?"], ["aaaa", "b", "5"]
    ids, attn, mask = batch(policy.tokenizer, prompts, completions)
    together = policy.logprobs(ids, attn, mask.shape[1])
    for i in range(3):
        one_ids, one_attn, one_mask = batch(policy.tokenizer, prompts[i:i + 1], completions[i:i + 1])
        alone = policy.logprobs(one_ids, one_attn, one_mask.shape[1])
        n = int(one_mask.sum())
        torch.testing.assert_close(together[i, :n], alone[0, :n], atol=1e-5, rtol=1e-5)


def test_saved_adapter_reloads_with_peft(tmp_path):
    from peft import PeftModel

    policy = make_policy()
    perturb_adapter(policy)
    policy.save(tmp_path / "final")
    base, _ = load_base(OmegaConf.structured(ModelConfig(name_or_path="tiny")))
    reloaded = PeftModel.from_pretrained(base, tmp_path / "final")
    ids, attn, _ = batch(policy.tokenizer, ["abc"], ["de"])
    torch.testing.assert_close(sequence_logprobs(reloaded, ids, attn, 2), policy.logprobs(ids, attn, 2))


def test_the_reference_is_evaluated_while_the_policy_trains():
    """DPO computes a micro-batch's reference after the previous one's training pass: with the model in
    training mode, dropout (here the attention's, through the model's own forward) must not reach it."""
    policy = make_policy()
    for layer in policy.model.get_base_model().model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids = torch.randint(3, 50, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    policy.eval()
    evaluated = policy.ref_logprobs(ids, mask, 4)
    policy.train()
    assert torch.equal(policy.ref_logprobs(ids, mask, 4), evaluated)
    assert policy.model.training and all(m.training for m in policy.model.modules())  # training goes on
    assert not torch.equal(policy.logprobs(ids, mask, 4), policy.logprobs(ids, mask, 4))  # dropout is on
