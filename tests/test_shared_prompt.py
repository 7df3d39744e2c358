"""Rows that share a prompt forward it once (passes.completion_states), and log-probs come from the
hidden states chunk by chunk (head.head_logprobs): both give the log-probs, entropies, values and
gradients of one plain forward pass with full logits, on the tiny model and on a SmolLM2-shaped one
(GQA, tied embeddings), with LoRA, left padding, uneven completions, partial groups and shuffled rows."""

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from rlnotes.core.schema import ModelConfig
from rlnotes.engine.model.loading import smollm2_shaped
from rlnotes.engine.policy.critic import logprobs_and_values, values
from rlnotes.engine.policy.head import head_logprobs
from rlnotes.engine.policy.llama import LlamaLayers
from rlnotes.engine.policy.passes import position_ids, prompt_groups, sequence_logprobs, shared_prefix
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.rollout import left_pad
from tests.conftest import record_forwards


@pytest.fixture(autouse=True)
def skip_any_padding(monkeypatch):
    """Every pass here skips padding in its position-wise layers (rlnotes.engine.policy.padding), however
    little that saves on these small models, so the equivalences below cover it too."""
    import rlnotes.engine.policy.padding

    monkeypatch.setattr(rlnotes.engine.policy.padding, "MIN_SAVING", 0)


def tiny_policy(lora=True):
    cfg = OmegaConf.structured(ModelConfig(name_or_path="tiny"))
    if not lora:
        cfg.lora = None
    policy = Policy.from_config(cfg, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)  # the same adapter whatever ran before in this process
    with torch.no_grad():  # a trained-looking adapter (B = 0 would zero the gradients of A)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=g)
    return policy.model


def lora_smollm2_shaped(layers=2):
    """SmolLM2-135M's configuration (GQA 9 / 3 heads, d=576, tied embeddings, its vocabulary) with
    a few layers and random weights, LoRA r16 on q/k/v/o."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(smollm2_shaped(layers), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def group_batch(vocab, prompt_lengths=(5, 11, 2), group=3, max_completion=7, seed=0, prefix=0):
    """Prompts of different lengths (left-padded), each repeated `group` times, with completions of
    uneven lengths (right-padded): (input_ids, attention_mask, completion_mask). `prefix`: the
    length of a run of tokens every prompt starts with (a system prompt)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lengths]
    p_ids, p_mask = left_pad([p for p in prompts for _ in range(group)], pad_id=0)
    rows = len(prompts) * group
    lengths = torch.randint(1, max_completion + 1, (rows,), generator=g)
    lengths[0] = max_completion
    c_ids = torch.randint(3, vocab, (rows, max_completion), generator=g)
    c_mask = (torch.arange(max_completion)[None] < lengths[:, None]).float()
    c_ids = c_ids.masked_fill(c_mask == 0, 0)
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask.long()], 1), c_mask


def plain_logprobs(model, ids, attn, n, temperature=1.0):
    """The textbook pass: every row whole, full logits, log_softmax; log-prob and entropy of each real
    completion token, 0 on padding (which no loss reads, and the fast pass leaves out)."""
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False).logits
    log_pi = F.log_softmax(logits[:, -n - 1:-1].float() / temperature, -1)
    real = attn[:, -n:]
    return log_pi.gather(-1, ids[:, -n:, None]).squeeze(-1) * real, -(log_pi.exp() * log_pi).sum(-1) * real


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def assert_grads_close(got, expected, rtol=1e-4):
    """Each parameter's gradient within rtol of its own norm, or of a millionth of the largest one's
    (a gradient that small is rounding noise of float32 sums, whichever way the pass was cut)."""
    scale = max(float(b.norm()) for b in expected)
    assert scale > 0
    for a, b in zip(got, expected):
        assert float((a - b).norm()) < rtol * max(float(b.norm()), 1e-6 * scale)


def check_equivalent(model, ids, attn, mask, temperature=1.0):
    n = mask.shape[1]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    expected, _ = plain_logprobs(model, ids, attn, n, temperature)
    expected_grads = grads(model, (expected * weights).sum())
    for share in (True, False):
        logp = sequence_logprobs(model, ids, attn, n, temperature, share_prompts=share)
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
        assert_grads_close(grads(model, (logp * weights).sum()), expected_grads)


def test_prompt_groups_find_rows_that_share_a_prompt_in_any_order():
    ids = torch.tensor([[0, 5, 6], [7, 5, 6], [0, 5, 6], [0, 0, 9], [0, 0, 9]])
    mask = (ids != 0).long()
    first, number = prompt_groups(ids, mask)
    assert first.tolist() == [0, 1, 3] and number.tolist() == [0, 1, 0, 2, 2]
    # the same ids with different padding are different prompts (pad ids may be real tokens)
    assert prompt_groups(torch.tensor([[4, 5], [4, 5]]), torch.tensor([[0, 1], [1, 1]])) is None


def test_shared_prefix_is_the_common_start_of_the_real_tokens():
    ids = torch.tensor([[0, 0, 7, 8, 9, 4], [7, 8, 9, 5, 6, 2], [0, 7, 8, 9, 5, 3]])
    assert shared_prefix(ids, (ids != 0).long()) == 3
    assert shared_prefix(ids[1:], (ids[1:] != 0).long()) == 4
    same = torch.tensor([[7, 8, 9], [7, 8, 9]])  # equal prompts keep one token of their own
    assert shared_prefix(same, torch.ones_like(same)) == 2
    assert shared_prefix(ids[:1], (ids[:1] != 0).long()) == 0
    assert shared_prefix(torch.tensor([[0, 7], [8, 7]]), torch.tensor([[0, 1], [1, 1]])) == 0


@pytest.fixture
def any_prefix(monkeypatch):
    """Share a common prefix however few tokens it saves."""
    import rlnotes.engine.policy.passes

    monkeypatch.setattr(rlnotes.engine.policy.passes, "MIN_PREFIX_SAVING", 1)


def equivalent_passes(model, ids, attn, mask, monkeypatch) -> list:
    """check_equivalent, then the [rows, tokens] of each forward pass the shared path makes."""
    check_equivalent(model, ids, attn, mask)
    seen = record_forwards(monkeypatch)
    sequence_logprobs(model, ids, attn, mask.shape[1])
    return seen


def test_a_prefix_all_prompts_share_is_forwarded_once(any_prefix, monkeypatch):
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size, prefix=40)
    n = mask.shape[1]
    # the prefix once, each prompt's own tokens, the completions
    assert equivalent_passes(model, ids, attn, mask, monkeypatch) == [(1, 40), (3, 11), (9, n - 1)]


@pytest.mark.parametrize("own", [True, False], ids=["own pass", "through a cache"])
@pytest.mark.parametrize("case", ["lora", "temperature", "full", "partial", "shuffled", "one token", "shortest"])
def test_a_shared_prefix_gives_the_plain_pass(any_prefix, case, own, monkeypatch):
    """The levels (prefix, prompts, completions) in one pass of rlnotes' own (LlamaLayers.tree) or,
    for a model it does not compute, a pass per level through a KV cache (passes.chain)."""
    if not own:
        monkeypatch.setattr(LlamaLayers, "of", classmethod(lambda cls, model: None))
    model = tiny_policy(lora=case != "full")
    model.train()
    lengths = (1, 6, 3) if case == "shortest" else (5, 11, 2)  # "shortest": a prompt one token past the prefix
    ids, attn, mask = group_batch(model.config.vocab_size, lengths, group=4, prefix=9,
                                  max_completion=1 if case == "one token" else 7)
    shuffled = torch.randperm(12, generator=torch.Generator().manual_seed(3))[:7]
    rows = {"partial": torch.arange(2, 9), "shuffled": shuffled}
    if case in rows:
        ids, attn, mask = ids[rows[case]], attn[rows[case]], mask[rows[case]]
    check_equivalent(model, ids, attn, mask, 0.7 if case == "temperature" else 1.0)


@pytest.mark.long
def test_a_shared_prefix_on_a_smollm2_shaped_model_gives_the_plain_pass_and_values(any_prefix):
    model = lora_smollm2_shaped()
    model.train()
    ids, attn, mask = group_batch(model.config.vocab_size, prompt_lengths=(9, 23, 4), group=3, max_completion=6,
                                  prefix=12)
    check_equivalent(model, ids, attn, mask)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    n = mask.shape[1]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False,
                    output_hidden_states=True)
        expected = head(out.hidden_states[-1][:, -n - 1:-1]).squeeze(-1)
        # at real positions: padding's hidden states are left unspecified (rlnotes.engine.policy.padding)
        torch.testing.assert_close(values(Policy(model, None), head, ids, attn, n) * mask, expected * mask,
                                   atol=1e-5, rtol=1e-5)


def test_shared_prompt_forward_runs_each_prompt_once(monkeypatch):
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size)
    seen = record_forwards(monkeypatch)
    sequence_logprobs(model, ids, attn, mask.shape[1])
    shared = list(seen)
    seen.clear()
    sequence_logprobs(model, ids, attn, mask.shape[1], share_prompts=False)
    width, n = ids.shape[1] - mask.shape[1], mask.shape[1]
    assert shared == [(3, width), (9, n - 1)]  # P + G(R - 1) per group; the last token is only a target
    assert seen == [(9, width + n)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tiny_lora_log_probs_and_gradients_equal_the_plain_pass(temperature):
    model = tiny_policy()
    model.train()
    check_equivalent(model, *group_batch(model.config.vocab_size), temperature)


def test_full_finetuning_gradients_equal_the_plain_pass():
    model = tiny_policy(lora=False)
    check_equivalent(model, *group_batch(model.config.vocab_size))


def test_partial_groups_and_shuffled_rows_equal_the_plain_pass():
    """Micro-batches that cut groups, and PPO's shuffled minibatches."""
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size, group=4)
    for rows in (torch.arange(2, 7), torch.randperm(12, generator=torch.Generator().manual_seed(3))[:7]):
        check_equivalent(model, ids[rows], attn[rows], mask[rows])


def test_one_token_completions_need_no_completion_pass():
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size, max_completion=1)
    check_equivalent(model, ids, attn, mask)


def test_smollm2_shaped_model_with_lora_equals_the_plain_pass():
    model = lora_smollm2_shaped()
    model.train()
    ids, attn, mask = group_batch(model.config.vocab_size, prompt_lengths=(9, 23, 4), group=3, max_completion=6)
    check_equivalent(model, ids, attn, mask)


def test_reference_pass_with_the_adapter_off_is_shared_too():
    model = lora_smollm2_shaped()
    ids, attn, mask = group_batch(model.config.vocab_size, prompt_lengths=(9, 23), group=2, max_completion=5)
    with model.disable_adapter(), torch.no_grad():
        expected, _ = plain_logprobs(model, ids, attn, mask.shape[1])
        got = sequence_logprobs(model, ids, attn, mask.shape[1])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_values_and_entropy_equal_the_plain_pass():
    """PPO's actor-critic pass: V(s_t) from the completion pass's hidden states, the exact entropy
    and both their gradients."""
    model = tiny_policy()
    head = torch.nn.Linear(model.config.hidden_size, 1)
    ids, attn, mask = group_batch(model.config.vocab_size)
    n = mask.shape[1]
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False,
                output_hidden_states=True)
    expected_v = head(out.hidden_states[-1][:, -n - 1:-1]).squeeze(-1)
    expected_logp, expected_ent = plain_logprobs(model, ids, attn, n, 0.8)
    params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    loss = lambda logp, v, ent: ((logp - 0.3 * v ** 2 + 0.1 * ent) * mask).sum()  # noqa: E731
    expected_grads = torch.autograd.grad(loss(expected_logp, expected_v, expected_ent), params)
    logp, v, ent = logprobs_and_values(Policy(model, None), head, ids, attn, n, 0.8, entropy=True)
    torch.testing.assert_close(logp, expected_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v * mask, expected_v * mask, atol=1e-5, rtol=1e-5)  # padding's is unspecified
    torch.testing.assert_close(ent, expected_ent, atol=1e-5, rtol=1e-5)
    assert_grads_close(torch.autograd.grad(loss(logp, v, ent), params), expected_grads)
    with torch.no_grad():
        torch.testing.assert_close(values(Policy(model, None), head, ids, attn, n) * mask, expected_v * mask,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packs", [True, False], ids=["packed blocks", "plain blocks"])
@pytest.mark.parametrize("chunk,rows,scale", [(22, 1024, 1.0), (6, 2, 1.0), (8, 4, 30.0), (10**6, 3, 30.0)])
def test_head_logprobs_chunks_and_matches_log_softmax(monkeypatch, chunk, rows, scale, packs):
    # Blocks of positions (rows) and of vocabulary columns (chunk // rows: 1, 3, 2 or all 11, so the
    # last block is short), each raising or keeping the running maximum; large logits (scale) too;
    # the frozen head's blocks through oneDNN with kept packed copies, or through torch's product.
    import rlnotes.engine.policy.head

    monkeypatch.setattr(rlnotes.engine.policy.head, "LOGIT_CHUNK", chunk)
    monkeypatch.setattr(rlnotes.engine.policy.head, "LOGIT_ROWS", rows)
    if not packs:
        monkeypatch.setattr(rlnotes.engine.policy.head, "packed_frozen", lambda weight: False)
    head = torch.nn.Linear(4, 11).requires_grad_(False)
    hidden = (torch.randn(3, 5, 4) * scale).requires_grad_(True)
    tokens = torch.randint(0, 11, (3, 5))
    log_pi = torch.log_softmax(head(hidden).double() / 0.7, -1)
    expected, expected_ent = log_pi.gather(-1, tokens[..., None]).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)
    logp, ent = head_logprobs(hidden, head, tokens, 0.7, entropy=True)
    torch.testing.assert_close(logp, expected.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, expected_ent.float(), atol=1e-5, rtol=1e-5)
    g = torch.randn(3, 5)
    torch.testing.assert_close(torch.autograd.grad((logp * g + ent).sum(), hidden)[0],
                               torch.autograd.grad((expected * g + expected_ent).sum(), hidden)[0].float(),
                               atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the reference pass's path: no gradients, no entropy
        torch.testing.assert_close(head_logprobs(hidden, head, tokens, 0.7)[0], logp)


@pytest.mark.parametrize("trainable", [False, True])
def test_head_logprobs_skip_padding(trainable):
    # Only the real positions go through the head: their log-probs, entropies and gradients are the
    # full computation's, padding gets 0 (and no gradient), a head with LoRA-style trainable weights too.
    head = torch.nn.Linear(4, 11).requires_grad_(trainable)
    hidden = torch.randn(3, 5, 4, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5))
    real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).bool()
    full, full_ent = head_logprobs(hidden, head, tokens, 0.7, entropy=True)
    logp, ent = head_logprobs(hidden, head, tokens, 0.7, entropy=True, real=real)
    torch.testing.assert_close(logp, full * real)
    torch.testing.assert_close(ent, full_ent * real)
    g = torch.randn(3, 5)
    got = torch.autograd.grad((logp * g + ent).sum(), hidden)[0]
    expected = torch.autograd.grad(((full * g + full_ent) * real).sum(), hidden)[0]
    torch.testing.assert_close(got, expected)
    assert (got[~real] == 0).all()


def test_autocast_runs_the_shared_pass():
    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = sequence_logprobs(model, ids, attn, mask.shape[1])
        plain = sequence_logprobs(model, ids, attn, mask.shape[1], share_prompts=False)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, plain, atol=0.1, rtol=0.05)
    logp.sum().backward()


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trainer_shared_prompt_switch_changes_no_metric(tmp_path, monkeypatch, algo):
    """trainer.shared_prompt=false forwards every row whole; the metrics of a run stay the same."""
    import json

    from rich.console import Console

    import rlnotes.engine.policy.passes
    from rlnotes.commands.train import train
    from tests.conftest import compose

    calls = []
    real = rlnotes.engine.policy.passes.prompt_groups
    monkeypatch.setattr(rlnotes.engine.policy.passes, "prompt_groups", lambda *a: calls.append(1) or real(*a))
    rows = {}
    for share in (True, False):
        calls.clear()
        cfg = compose("logging.progress=false", f"algo={algo}", "trainer.steps=2", "trainer.batch_size=4",
                      "trainer.micro_batch_size=4", f"trainer.shared_prompt={str(share).lower()}")
        train(cfg, tmp_path / str(share), Console(quiet=True))
        rows[share] = [json.loads(line) for line in (tmp_path / str(share) / "metrics.jsonl").read_text().splitlines()]
        assert bool(calls) == share
    for a, b in zip(rows[True], rows[False]):
        assert a["reward/mean"] == b["reward/mean"]
        for key in ("loss", "optim/grad_norm", "kl/ref", "policy/entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("other_rank", ["same", "no shared prompts"])
def test_under_fsdp_every_rank_runs_the_same_passes(monkeypatch, any_prefix, other_rank):
    """FSDP's gathers go in lock step: the ranks agree on sharing (the plain pass when another rank's
    rows share no prompt), and no prefix pass runs (FSDP re-gathers weights for backward only through
    a layer's outputs)."""
    import rlnotes.engine.policy.passes

    model = tiny_policy()
    ids, attn, mask = group_batch(model.config.vocab_size, prefix=40)
    monkeypatch.setattr(rlnotes.engine.policy.passes, "is_sharded", lambda m: True)
    other = lambda plan: plan if other_rank == "same" else (False, plan[1])  # noqa: E731
    monkeypatch.setattr(rlnotes.engine.policy.passes.distributed, "gather", lambda plan: [plan, other(plan)])
    n = mask.shape[1]
    assert equivalent_passes(model, ids, attn, mask, monkeypatch) == \
        ([(3, ids.shape[1] - n), (9, n - 1)] if other_rank == "same" else [tuple(ids.shape)])


def test_episodes_forward_their_groups_prompt_once_with_the_plain_passs_log_probs_and_gradients(monkeypatch):
    """Multi-turn episodes (the letters environment: a turn, the environment's reply, a turn) share
    their group's prompt though the tokens after it differ per episode (model turns and observations
    alike): one pass of the 2 prompts, one of the 8 episodes against their cache, and the log-probs
    and gradients of every row forwarded whole."""
    from rlnotes.agents.multi_turn import MultiTurn
    from rlnotes.core.schema import RolloutConfig
    from rlnotes.engine.prompts import PromptFormat
    from rlnotes.engine.sampling.settings import SamplingSettings

    model = tiny_policy()
    tok = Policy.from_config(OmegaConf.structured(ModelConfig(name_or_path="tiny")), torch.device("cpu")).tokenizer
    with torch.no_grad():  # turns that end (EOS's logit scaled up), so that an observation follows them
        model.base_model.model.lm_head.weight[tok.eos_token_id] *= 20
    multi = MultiTurn.of(OmegaConf.merge(OmegaConf.structured(RolloutConfig), {"env": "letters", "max_turns": 2}))
    rows = [{"prompt": "Write the letter a:", "letter": "a"}, {"prompt": "Write the letter b!", "letter": "b"}]
    with torch.no_grad():
        _, r = multi.run_episodes(model, tok, rows, 4, SamplingSettings(6), PromptFormat(chat_template=False),
                                  torch.Generator().manual_seed(1))
    assert (r.completion_attn.bool() & ~r.completion_mask.bool()).any()  # observations between turns
    model.train()
    n = r.completion_ids.shape[1]
    weights = torch.randn(r.completion_mask.shape, generator=torch.Generator().manual_seed(1)) * r.completion_mask
    expected, _ = plain_logprobs(model, r.input_ids, r.attention_mask, n)
    expected_grads = grads(model, (expected * weights).sum())
    seen = record_forwards(monkeypatch)
    logp = sequence_logprobs(model, r.input_ids, r.attention_mask, n)
    assert seen == [(2, r.prompt_ids.shape[1]), (8, n - 1)]
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    assert_grads_close(grads(model, (logp * weights).sum()), expected_grads)


def test_rows_with_prompts_of_their_own_forward_the_prefix_they_share_once(any_prefix, monkeypatch):
    """An SFT batch (a demonstration per prompt) behind one long system prompt: the prefix once, each
    prompt's own tokens, the completions; the plain pass's log-probs and gradients."""
    model = tiny_policy()
    model.train()
    ids, attn, mask = group_batch(model.config.vocab_size, group=1, prefix=40)
    n = mask.shape[1]
    assert equivalent_passes(model, ids, attn, mask, monkeypatch) == [(1, 40), (3, 11), (3, n - 1)]
