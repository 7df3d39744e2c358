"""Multi-turn episodes (rlnotes.engine.sampling.episodes): the KV cache carried across turns gives the
same tokens and log-probs as forwarding the whole compacted episode, the environment's tokens
carry no loss, and every bound (turns, tokens, the episode budget) holds."""

import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.core.schema import TinyModelConfig
from rlnotes.engine.model.loading import tiny_model, tiny_tokenizer
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.episodes import generate_episodes
from rlnotes.engine.sampling.generate import completion_seeds
from rlnotes.engine.sampling.settings import EpisodeLimits, SamplingSettings

PROMPTS = ["Write the letter a:", "What is 2+3?", "Hi"]


def setup():
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    with torch.no_grad():  # EOS as likely as a common token, thrice over: turns end at different times
        model.lm_head.weight[tok.eos_token_id] = 3 * model.lm_head.weight[75]
    return model, tok, encode_prompts(tok, PROMPTS, chat_template=False)


class Scripted:
    """An environment that answers every turn with observations of uneven length, ends some
    episodes early, and records what it was told."""

    def __init__(self, tok, stop_row=None):
        self.tok, self.stop_row, self.calls = tok, stop_row, []

    def __call__(self, rows, turns, last):
        self.calls.append((list(rows), [list(t) for t in turns], list(last)))
        out = []
        for r, turn in zip(rows, turns):
            text = f"\nuser: ok {'x' * (r % 5)} {len(turn)}\nassistant:"
            out.append(None if r == self.stop_row else self.tok(text, add_special_tokens=False)["input_ids"])
        return out


def run(model, tok, prompts, respond, seed=0, group_size=2, max_turns=3, max_episode_tokens=None, seeds=None,
        **kw):
    settings = SamplingSettings(**(dict(max_new_tokens=10, temperature=1.0) | kw))
    return generate_episodes(model, tok, prompts, group_size, respond, settings,
                             EpisodeLimits(max_turns, max_episode_tokens), torch.Generator().manual_seed(seed),
                             seeds=seeds)


def test_sampled_logprobs_equal_a_forward_pass_of_the_whole_episode():
    model, tok, prompts = setup()
    r = run(model, tok, prompts, Scripted(tok), temperature=0.8)
    assert (r.completion_attn.sum(-1) > r.completion_mask.sum(-1)).any()   # some rows have observations
    for share in (True, False):
        again = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1], 0.8,
                                  share_prompts=share)
        torch.testing.assert_close(again * r.completion_mask, r.logprobs, atol=2e-5, rtol=0)


def naive_greedy(model, tok, prompt, respond_one, max_new_tokens, max_turns):
    """The slow reference: every token from a forward pass over the whole sequence so far."""
    seq, turns = list(prompt), 0
    while True:
        turns += 1
        turn = []
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            t = int(logits.argmax())
            seq.append(t)
            turn.append(t)
            if t == tok.eos_token_id:
                break
        if turn[-1] != tok.eos_token_id or turns == max_turns:
            return seq[len(prompt):]
        obs = respond_one(turn)
        if obs is None:
            return seq[len(prompt):]
        seq += obs


@pytest.mark.parametrize("system", ["", "You are a careful assistant; answer in one word. "])
def test_greedy_episodes_equal_a_slow_reference_without_cache(system, monkeypatch):
    """With a system prompt every prompt shares, forwarded once (its cache's padding in the middle)."""
    import rlnotes.engine.policy.passes

    monkeypatch.setattr(rlnotes.engine.policy.passes, "MIN_PREFIX_SAVING", 1)
    model, tok, _ = setup()
    prompts = encode_prompts(tok, [system + p for p in PROMPTS], chat_template=False)
    env = Scripted(tok)
    r = run(model, tok, prompts, env, group_size=1, greedy=True, max_new_tokens=6, max_turns=3)
    for i, prompt in enumerate(prompts):
        want = naive_greedy(model, tok, prompt, lambda turn: env([i], [turn], [False])[0], 6, 3)
        got = r.completion_ids[i][r.completion_attn[i].bool()].tolist()
        assert got == want


def test_observation_tokens_carry_no_loss_and_no_logprob():
    model, tok, prompts = setup()
    env = Scripted(tok)
    r = run(model, tok, prompts, env)
    real, model_tokens = r.completion_attn.bool(), r.completion_mask.bool()
    observed = real & ~model_tokens
    assert observed.any() and (r.logprobs[observed] == 0).all() and (r.logprobs[model_tokens] < 0).all()
    # every observation the environment gave sits in the episode between the model's turns, in order
    for i in range(len(r)):
        ids = r.completion_ids[i][real[i]].tolist()
        mask = model_tokens[i][real[i]].tolist()
        runs, k = [], 0
        while k < len(ids):
            j = k
            while j < len(ids) and mask[j] == mask[k]:
                j += 1
            runs.append((mask[k], ids[k:j]))
            k = j
        told = [turns[rows.index(i)] for rows, turns, _ in env.calls if i in rows]
        assert [ids for m, ids in runs if m] == told[:len([m for m, _ in runs if m])]
    # a loss through the model's tokens alone has no gradient at the environment's positions
    logp = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1]).detach()
    logp.requires_grad_(True)
    (-(logp * r.completion_mask).sum() / r.completion_mask.sum()).backward()
    assert (logp.grad[observed] == 0).all() and (logp.grad[model_tokens] != 0).all()


def test_turns_budget_and_early_stop_bound_every_episode():
    model, tok, prompts = setup()
    env = Scripted(tok, stop_row=1)
    r = run(model, tok, prompts, env, max_turns=2, max_new_tokens=8)
    for rows, turns, last in env.calls:
        assert all(len(t) <= 8 for t in turns)
    turns_of = {i: sum(i in rows for rows, _, _ in env.calls) for i in range(len(r))}
    assert max(turns_of.values()) <= 2 and turns_of[1] == 1     # row 1's environment ended it after turn 1
    # the final call of every row that reached its second turn says it is the last
    assert all(last[rows.index(i)] for rows, _, last in env.calls[1:] for i in rows)
    capped = run(model, tok, prompts, Scripted(tok), max_turns=5, max_new_tokens=8, max_episode_tokens=20)
    assert int(capped.completion_attn.sum(-1).max()) <= 20
    long = capped.completion_attn.sum(-1) >= 12
    assert capped.truncated[long].all() or not long.any()


def test_seeded_episodes_do_not_depend_on_the_rest_of_the_batch():
    model, tok, prompts = setup()
    seeds = completion_seeds(3, (0, 0), torch.arange(3), 2)
    together = run(model, tok, prompts, Scripted(tok), seeds=seeds)
    for i, prompt in enumerate(prompts):
        def shifted(rows, turns, last, i=i):  # the environment sees the rows' numbers in the whole batch
            return Scripted(tok)([r + 2 * i for r in rows], turns, last)
        alone = run(model, tok, [prompt], shifted, seeds=seeds[2 * i:2 * i + 2])
        for j in range(2):
            a = together.completion_ids[2 * i + j][together.completion_attn[2 * i + j].bool()]
            b = alone.completion_ids[j][alone.completion_attn[j].bool()]
            assert a.tolist() == b.tolist()


def test_an_observation_past_the_models_context_ends_the_episode_truncated():
    """An observation that would take the episode past the model's positions (512 for the tiny
    model) is not prefilled: the episode ends, truncated, as at rollout.max_episode_tokens. A
    long enough one used to ask a real model's attention for terabytes."""
    model, tok, prompts = setup()
    long = tok(" and" * 600, add_special_tokens=False)["input_ids"]
    short = tok("\nuser: ok\nassistant:", add_special_tokens=False)["input_ids"]

    def respond(rows, turns, last):
        return [long if r % 2 else short for r in rows]

    r = run(model, tok, prompts, respond, max_turns=3, max_new_tokens=8)
    lengths = r.prompt_mask.sum(-1) + r.completion_attn.sum(-1)
    assert int(lengths.max()) <= 512
    odd = torch.arange(len(r)) % 2 == 1
    assert r.truncated[odd].all() and (r.completion_attn[odd].sum(-1) <= 8).all()   # one turn, then no room
    assert (r.completion_attn[~odd].sum(-1) > r.completion_mask[~odd].sum(-1)).any()  # the others go on
