"""rlnotes samples what TRL 1.16 would: its draw against torch.multinomial and the exact softmax at
a 49,152-token vocabulary, completion lengths against transformers' generate, the stop ids and the
prompt ids against TRL's; and the statistics of scripts/sampling_check.py, which runs the same
checks on SmolLM2-135M-Instruct (its run here is slow-marked)."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.core.schema import TinyModelConfig
from rlnotes.engine.model.loading import tiny_model, tiny_tokenizer
from rlnotes.engine.policy.policy import Policy
from rlnotes.engine.prompts import encode_prompts
from rlnotes.engine.sampling.generate import (
    completion_seeds,
    draw_tokens,
    generate,
    sample_inverse_cdf,
    sampling_probs,
    stop_ids,
    uniforms,
)
from rlnotes.engine.sampling.settings import SamplingSettings
from tests.test_documented_commands import _script

check = _script("sampling_check")
V = 49152  # SmolLM2's vocabulary
ALPHA = check.ALPHA


# ------------------------------------------------------------------------------- the statistics


def test_chi_square_and_kolmogorov_tails_match_their_closed_forms():
    for x in (0.5, 3.0, 10.0):
        assert check.chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert check.chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
        assert check.chi2_sf(x, 4) == pytest.approx((1 + x / 2) * math.exp(-x / 2), rel=1e-9)
    # Kolmogorov's distribution: the tabled 5% and 1% points
    assert check.kolmogorov_sf(1.3581) == pytest.approx(0.05, abs=2e-4)
    assert check.kolmogorov_sf(1.6276) == pytest.approx(0.01, abs=1e-4)


def test_the_tests_give_hand_computed_statistics():
    # 50 draws of [0.5, 0.25, 0.25, 0]: counts 25, 15, 10 against 25, 12.5, 12.5 expected
    tokens = torch.tensor([0] * 25 + [1] * 15 + [2] * 10)
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    fit = check.goodness_of_fit(tokens, probs, least=5)
    assert fit["chi2"] == pytest.approx(1.0) and fit["df"] == 2 and fit["p"] == pytest.approx(math.exp(-0.5))
    assert check.goodness_of_fit(torch.cat([tokens, torch.tensor([3])]), probs, least=5)["p"] == 0.0  # impossible
    # bins: each token expecting >= least alone, the rest pooled in order of probability
    bins = check.frequency_bins(torch.tensor([0.05, 0.6, 0.0, 0.2, 0.1, 0.05]), 100, 10)
    assert bins.tolist() == [3, 0, -1, 1, 2, 3]
    # a 2 x 2 table 30/20 against 20/30: chi2 = 4 (5^2 / 25) = 4
    hom = check.homogeneity([1] * 30 + [2] * 20, [1] * 20 + [2] * 30)
    assert (hom["chi2"], hom["df"]) == (pytest.approx(4.0), 1) and hom["p"] == pytest.approx(math.erfc(math.sqrt(2)))
    assert check.ks_two_sample([1, 2, 3, 4], [3, 4, 5, 6])["D"] == pytest.approx(0.5)
    # the rare class: 3 of 1000 draws where 0.1% of the mass is rare
    rare = check.rare_rate(torch.tensor([0] * 997 + [1] * 3), torch.tensor([0.999, 0.001]), below=0.01)
    assert rare["observed"] == 3 and rare["expected"] == pytest.approx(1.0)
    assert rare["p"] == pytest.approx(math.erfc(2 / math.sqrt(0.999) / math.sqrt(2)))


# ------------------------------------------------------------------------------- the draw


def lm_like(seed: int) -> torch.Tensor:
    """Next-token logits shaped like SmolLM2's (scripts/sampling_check.py prints them): a N(0, 3^2)
    bulk and a few dozen tokens 12-19 above it; the top token has about 0.8 of the mass, tokens
    below 1e-5 about 0.7% and below 3e-8 about 2e-4."""
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(V, generator=g)
    head = torch.randperm(V, generator=g)[:40]
    z[head] = 19.0 - 2.2 * torch.arange(40, dtype=torch.float32) ** 0.6 + 0.3 * torch.randn(40, generator=g)
    return z


def peaked(seed: int) -> torch.Tensor:
    z = lm_like(seed)
    z[z.argmax()] += 4.0  # the top token near 0.996
    return z


def flat(seed: int) -> torch.Tensor:
    return 0.3 * torch.randn(V, generator=torch.Generator().manual_seed(seed))


# (logits, temperature, top_p, draws): 200,000 draws per sampler
CASES = [(lm_like, 1.0, 1.0, 100_000), (lm_like, 0.7, 0.95, 30_000), (peaked, 1.0, 1.0, 30_000),
         (flat, 1.0, 1.0, 40_000)]


def rlnotes_draws(z, temperature, top_p, n, seeds=None, generator=None):
    """n tokens from logits z [V] as generate draws them: sampling_probs, then sample_inverse_cdf on
    the uniform numbers of the generator's stream or of per-completion seeds (draw_tokens scales by
    each row's total instead of normalising first: the same tokens, test below)."""
    probs = sampling_probs(z[None], temperature, top_p)
    return sample_inverse_cdf(probs, uniforms(n, seeds, 3, generator, "cpu")[None])[0]


def both_tests(tokens, exact, below=check.RARE):
    return check.goodness_of_fit(tokens, exact)["p"], check.rare_rate(tokens, exact, below)["p"]


@pytest.mark.parametrize("logits,temperature,top_p,draws", CASES)
def test_the_draw_is_the_softmax_at_a_49k_vocabulary(logits, temperature, top_p, draws):
    """rlnotes' draw from the generator's stream and from hashed per-completion seeds, and
    torch.multinomial, each against the exact float64 softmax: a chi-square over the likely tokens
    and pooled bins of the rest, and the rate of the tokens below 1e-5."""
    z = logits(0)
    exact = check.exact_probs(z, temperature, top_p)
    g = torch.Generator().manual_seed(1)
    seeds = completion_seeds(7, (2, 0), torch.arange(draws // 4), 4)  # draws // 4 prompts x G=4
    samplers = {"generator": rlnotes_draws(z, temperature, top_p, draws, generator=g),
                "seeded": rlnotes_draws(z, temperature, top_p, draws, seeds=seeds),
                "multinomial": torch.multinomial(exact, draws, replacement=True, generator=g)}
    for name, tokens in samplers.items():
        fit, rare = both_tests(tokens, exact)
        assert fit >= ALPHA and rare >= ALPHA, (name, fit, rare)


def test_a_biased_draw_fails_the_same_tests():
    """The tests catch a temperature 5% off and probabilities rounded to float16 (whose tokens
    below 3e-8 round to 0: the rate of that class, 18 expected in 100,000 draws)."""
    z, g = lm_like(0), torch.Generator().manual_seed(1)
    exact = check.exact_probs(z, 1.0, 1.0)
    fit, rare = both_tests(rlnotes_draws(z, 1.05, 1.0, 100_000, generator=g), exact)
    assert fit < 1e-20 and rare < 1e-20, (fit, rare)
    half = sampling_probs(z[None], 1.0, 1.0).half().float()
    tokens = sample_inverse_cdf(half, uniforms(100_000, None, 0, g, "cpu")[None])[0]
    assert check.rare_rate(tokens, exact, below=3e-8)["p"] < ALPHA
    fair = rlnotes_draws(z, 1.0, 1.0, 100_000, generator=g)
    assert check.rare_rate(fair, exact, below=3e-8)["p"] >= ALPHA


def whole_row_cdf_draws(probs, u):
    """The inverse CDF as one float64 cumulative sum over each whole row: (the first token whose
    cumulative probability reaches u times the row's total, u [N, k]; whether that target lies
    further than float64 rounding from every token's bound, where two ways of summing must agree)."""
    cdf = probs.double().cumsum(-1)
    target = u * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target).clamp(max=probs.shape[1] - 1)
    bounds = torch.stack([cdf.gather(1, tokens), cdf.gather(1, (tokens - 1).clamp(min=0))])
    clear = ((bounds - target).abs() > 1e-12 * cdf[:, -1:]).all(0)
    return tokens, clear


def test_the_blockwise_cdf_draws_the_whole_rows_tokens():
    """sample_inverse_cdf's two levels (block sums, then one block's entries) give the token of one
    float64 cumulative sum over the whole row, for one draw per row and for k draws per row; at
    vocabularies that do and do not fill the last block, with peaked rows, rows whose nucleus left
    whole blocks and block ends at 0, and uniform numbers at the edges of (0, 1) (wherever the target is
    further than float64 rounding from a token's bound); never a token of probability 0. A vocabulary
    of at most one block (256, 100, 3) takes the one level of its row's own sum."""
    g = torch.Generator().manual_seed(5)
    for vocab in (V, 1000, 257, 256, 100, 3):
        z = torch.randn(64, vocab, generator=g) * torch.linspace(0.5, 8, 64)[:, None]
        probs = sampling_probs(z, 1.0, 1.0)
        probs[::3, : vocab // 2] = 0.0          # whole leading blocks without mass
        probs[1::3, 255::256] = 0.0             # every block's last entry without mass
        probs[2, :] = 0.0
        probs[2, vocab // 2] = 1.0              # all the mass on one token
        edges = torch.tensor([1e-300, 1e-12, 0.5, 1 - 1e-12, 1 - 2**-53], dtype=torch.float64)
        u = torch.cat([torch.rand(64, 200, generator=g, dtype=torch.float64), edges.expand(64, -1)], dim=1)
        expected, clear = whole_row_cdf_draws(probs, u)
        drawn = sample_inverse_cdf(probs, u)
        assert torch.equal(drawn[clear], expected[clear]) and clear.float().mean() > 0.95
        assert torch.equal(sample_inverse_cdf(probs, u[:, 0]), drawn[:, 0])
        assert bool((probs.gather(1, drawn) > 0).all())


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.95)])
def test_draw_tokens_draws_what_the_tested_draw_draws(temperature, top_p):
    """draw_tokens samples from exp(z / T - max) left unnormalised (at top_p = 1) where the draw
    tested above samples from sampling_probs: on the same uniform numbers (per-row seeds), the same
    token in every row but at most one (a target within float32 rounding of a token's bound)."""
    rows = torch.stack([lm_like(s) for s in range(8)] + [peaked(8), flat(9)]).repeat(10, 1)   # [100, V]
    seeds = torch.arange(len(rows)) * 7919
    settings = SamplingSettings(32, temperature=temperature, top_p=top_p)
    drawn, _ = draw_tokens(rows, settings, seeds, 5, None)
    tested = sample_inverse_cdf(sampling_probs(rows, temperature, top_p), uniforms(len(rows), seeds, 5, None, "cpu"))
    assert int((drawn != tested).sum()) <= 1 and len(set(drawn.tolist())) > 5


def test_draw_tokens_samples_each_row_and_gives_its_log_prob():
    """draw_tokens as generate calls it, row by row at the real vocabulary (the temperature
    applied inside): the draws fit the exact softmax, each log-prob is log softmax(z / T) of its
    token, and greedy takes the most likely token."""
    z, temperature = lm_like(3), 0.8
    settings, g = SamplingSettings(32, temperature=temperature), torch.Generator().manual_seed(2)
    tokens, logps = zip(*[draw_tokens(z.expand(200, V), settings, None, 0, g) for _ in range(4)])
    tokens, logps = torch.cat(tokens), torch.cat(logps)
    exact = check.exact_probs(z, temperature, 1.0)
    assert check.goodness_of_fit(tokens, exact)["p"] >= ALPHA
    torch.testing.assert_close(logps.double(), exact.log()[tokens], atol=2e-5, rtol=0)
    greedy, _ = draw_tokens(z[None], SamplingSettings(32, temperature=temperature, greedy=True), None, 0, None)
    assert int(greedy) == int(z.argmax())


# ------------------------------------------------------------------------------- the lengths


def tiny_policy(eos_weight: float = 3.0) -> Policy:
    """The tiny model with a LoRA adapter, as a run trains it, EOS made about as likely as a common
    character times `eos_weight` so that completions end at many lengths."""
    from peft import LoraConfig, get_peft_model

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = eos_weight * model.lm_head.weight[75]
    return Policy(get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), tok)


# Prompts of 17-34 tokens that share a prefix: left padding, and the prefix forwarded once.
QUESTIONS = ["Write the letter a:", "What is 2+3?", "Hi", "Name a colour.", "Count to three:", "Say yes or no.",
             "Spell cat.", "Add 1 and 1:"]


def test_completion_lengths_match_transformers_generate():
    """1,024 completions by rlnotes' generate as a training step samples (adapter merged, weights
    packed, own decoding step, shared prefix) against 1,024 by transformers' generate with TRL's
    settings: no length test finds a difference. Sampled at temperature 0.7 instead, rlnotes'
    lengths (12% shorter) fail the same tests."""
    policy = tiny_policy(4.0)
    prompts = encode_prompts(policy.tokenizer, [f"You are terse. {q}" for q in QUESTIONS], chat_template=False)
    result = check.compare_lengths(policy, prompts, 32, 4, SamplingSettings(32), seed=0)
    assert len(result["lengths"]["rlnotes"]) == len(result["lengths"]["generate"]) == 1024
    assert check.agree(result["tests"]), result["tests"]
    with torch.no_grad(), policy.sampling() as model:
        cooler = generate(model, policy.tokenizer, prompts * 4, 32, SamplingSettings(32, temperature=0.7),
                          torch.Generator().manual_seed(1))
    tests = check.length_tests(cooler.completion_mask.sum(-1).long().tolist(), result["lengths"]["generate"])
    assert not check.agree(tests), tests


def test_with_a_second_eos_id_lengths_still_match_generate_and_the_stops_are_trls():
    """A model whose generation config lists a second EOS id (as chat models list <|im_end|> and
    <|endoftext|>): rlnotes stops at the ids TRL stops at, and its lengths match generate's (which
    stops at the config's ids); tests/test_rollout.py checks where the completions end."""
    policy = tiny_policy(0.0)
    tok, model = policy.tokenizer, policy.model
    other = tok.convert_tokens_to_ids("!")
    with torch.no_grad():
        model.get_base_model().lm_head.weight[other] = 4.0 * model.get_base_model().lm_head.weight[75]
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    assert stop_ids(model, tok) == [tok.eos_token_id, other] == check.trl_stop_ids(model, tok)
    model.generation_config.eos_token_id = [other]
    assert set(stop_ids(model, tok)) == set(check.trl_stop_ids(model, tok)) == {tok.eos_token_id, other}
    prompts = encode_prompts(tok, [f"You are terse. {q}" for q in QUESTIONS], chat_template=False)
    result = check.compare_lengths(policy, prompts, 32, 4, SamplingSettings(32), seed=0)
    assert check.agree(result["tests"]), result["tests"]


# ------------------------------------------------------------------------------- the prompts


SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's chat template: a default system turn when there is none
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_ids_are_those_trl_feeds_the_model(chat):
    """The bench's rows, conversational through a chat template and plain text, encoded as a
    training run encodes them (the run's PromptFormat): token for token what TRL 1.16's
    GRPOTrainer feeds the model (its own code where TRL is installed)."""
    from rlnotes.engine.prompts import PromptFormat

    policy = tiny_policy()
    if chat:
        policy.tokenizer.chat_template = SMOLLM2_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": q}] if chat else q} for q in QUESTIONS]
    fmt = PromptFormat(chat_template=chat, system_prompt=None)
    ours = fmt.encode(policy.tokenizer, [r["prompt"] for r in rows])
    theirs, _ = check.trl_prompt_ids(policy.tokenizer, [r["prompt"] for r in rows])
    assert ours == theirs
    assert check.check_prompts(policy, fmt, rows)
    assert not check.check_prompts(policy, PromptFormat(chat_template=chat, system_prompt="Be brief."), rows)


def test_the_script_on_the_tiny_model_with_trls_own_generation(tmp_path, capsys):
    """The script end to end on the tiny model, TRL's own GRPOTrainer._generate as a third side
    (where TRL is installed): no difference, every length written out."""
    import json

    pytest.importorskip("trl")
    out = tmp_path / "lengths.json"
    code = check.main(["--model", "tiny", "--samples", "256", "--draws", "20000", "--threads", "1", "--trl",
                       "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "rlnotes against trl:" in printed and "no difference found" in printed
    assert {side: len(x) for side, x in json.loads(out.read_text())["lengths"].items()} == {
        "rlnotes": 256, "generate": 256, "trl": 256}


def test_trl_asked_for_without_trl_is_one_line(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    assert check.main(["--model", "tiny", "--trl"]) == 2
    assert capsys.readouterr().err.strip() == ('sampling_check: error: --trl needs TRL; install the bench extra: '
                                               'pip install -e ".[bench]"')


@pytest.mark.slow
def test_smollm2_samples_what_transformers_generate_samples(tmp_path, capsys):
    """scripts/sampling_check.py on SmolLM2-135M-Instruct at the bench's shape (half an hour on 2
    busy cores): identical prompts and stop ids, the draw at its logits, 1,024 completions a side
    (TRL's own generation too where TRL is installed)."""
    import importlib.util
    import json

    argv = ["--out", str(tmp_path / "lengths.json")] + (["--trl"] if importlib.util.find_spec("trl") else [])
    assert check.main(argv) == 0, capsys.readouterr().out
    assert all(len(x) >= 1000 for x in json.loads((tmp_path / "lengths.json").read_text())["lengths"].values())
