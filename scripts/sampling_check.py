"""Does rlnotes sample the completions TRL 1.16 would? The prompts and stop ids each feeds the model,
rlnotes' draw against torch.multinomial, and completion lengths against transformers' generate.

    python scripts/sampling_check.py                                  # SmolLM2-135M-Instruct: minutes
    python scripts/sampling_check.py --model tiny --samples 1024      # the tiny model: seconds

The prompts are scripts/bench_trl.py's GRPO prompt file (8 prompts x --steps), rendered as each tool
renders them; the settings are the bench's (G=4 per step, 32 new tokens, temperature 1.0, no top-p
or top-k). Printed:
1. Prompts: rlnotes' prompt ids against TRL's (GRPOTrainer._tokenize_prompts where TRL is installed,
   else the apply_chat_template call it makes), token for token; the stop ids, rlnotes' against
   TRL's (the tokenizer's EOS and the generation config's).
2. The draw: at the model's next-token logits after each prompt and along a completion, --draws
   tokens by rlnotes' sampler (generate.sample_inverse_cdf on generate.sampling_probs, the generator's
   uniform numbers) and by torch.multinomial, each tested against the exact softmax: a chi-square
   over the likely tokens one by one and the rest pooled in bins, and the count of rare tokens.
3. Lengths: --samples completions by rlnotes' generate, as a training step samples (adapter merged,
   weights packed, own decoding step), and as many by transformers' generate with the settings
   TRL gives it, in alternating rounds (with --trl, as many by TRL's own GRPOTrainer._generate
   too): a chi-square on the length bins (the truncated bin included), a Kolmogorov-Smirnov test
   and a test of the means. Every length and per-prompt means go to --out (JSON) if given.
A p-value below 0.001 is a difference; the script exits 1 if any test finds one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins

import torch  # noqa: E402

ALPHA = 1e-3  # a p-value below this is a difference
RARE = 1e-5   # the rare tokens: probability below this under the exact softmax


# ------------------------------------------------------------------------------- the statistics


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with df degrees of freedom: Q(df/2, stat/2), the regularized
    upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def kolmogorov_sf(lam: float) -> float:
    """P(K >= lam) for Kolmogorov's distribution: 2 sum_k (-1)^(k-1) exp(-2 k^2 lam^2)."""
    if lam < 0.2:
        return 1.0
    return min(1.0, max(0.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))))


def ks_two_sample(a: Sequence[float], b: Sequence[float]) -> Dict[str, float]:
    """Two-sample Kolmogorov-Smirnov: D = max |F_a - F_b| and its asymptotic p-value (Stephens'
    correction); conservative for discrete values such as lengths."""
    xs = sorted(set(a) | set(b))
    ta, tb = torch.tensor(sorted(a), dtype=torch.float64), torch.tensor(sorted(b), dtype=torch.float64)
    grid = torch.tensor(xs, dtype=torch.float64)
    fa = torch.searchsorted(ta, grid, right=True) / len(a)
    fb = torch.searchsorted(tb, grid, right=True) / len(b)
    d = float((fa - fb).abs().max())
    ne = len(a) * len(b) / (len(a) + len(b))
    return {"D": d, "p": kolmogorov_sf((math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d)}


def mean_difference(a: Sequence[float], b: Sequence[float]) -> Dict[str, float]:
    """Welch's test of equal means for large samples: z = (mean_a - mean_b) / sqrt(var_a/n_a +
    var_b/n_b) and its two-sided normal p-value."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    z = (statistics.mean(a) - statistics.mean(b)) / se if se > 0 else 0.0
    return {"z": z, "p": math.erfc(abs(z) / math.sqrt(2))}


def frequency_bins(probs: torch.Tensor, n: int, least: float) -> torch.Tensor:
    """Each token's bin [V] for a chi-square over n draws: in order of probability, tokens join a bin
    until it expects `least` counts, so each likely token has a bin of its own and the unlikely ones
    share bins; a remainder expecting less joins the last bin; -1 for tokens of probability 0."""
    p, order = probs.double().sort(descending=True)
    order = order[p > 0]
    ids, current, acc = [], 0, 0.0
    for e in (n * p[p > 0]).tolist():
        ids.append(current)
        acc += e
        if acc >= least:
            current, acc = current + 1, 0.0
    bins = torch.tensor(ids, dtype=torch.long)
    if acc > 0 and current > 0:  # the remainder expects less than `least`
        bins[bins == current] = current - 1
    return torch.full((len(probs),), -1, dtype=torch.long).scatter(0, order, bins)


def goodness_of_fit(tokens: torch.Tensor, probs: torch.Tensor, least: float = 20.0) -> Dict[str, float]:
    """Pearson's chi-square of drawn `tokens` (any shape) against the distribution `probs` [V] over
    frequency_bins, and the draws of tokens whose probability is 0 (`impossible`: any is a
    failure, p = 0)."""
    tokens = tokens.flatten()
    n = tokens.numel()
    p = probs.double() / probs.double().sum()
    bin_of = frequency_bins(p, n, least)
    impossible = int((bin_of[tokens] < 0).sum())
    k = int(bin_of.max()) + 1
    observed = torch.bincount(bin_of[tokens][bin_of[tokens] >= 0], minlength=k).double()
    expected = n * torch.zeros(k, dtype=torch.float64).index_add(0, bin_of[p > 0], p[p > 0])
    stat = float(((observed - expected) ** 2 / expected).sum())
    p_value = 0.0 if impossible else chi2_sf(stat, k - 1) if k > 1 else 1.0  # one bin: nothing to test
    return {"chi2": stat, "df": k - 1, "impossible": impossible, "p": p_value}


def rare_rate(tokens: torch.Tensor, probs: torch.Tensor, below: float = RARE) -> Dict[str, float]:
    """How often tokens of probability below `below` came up against how often they should: the
    observed count, the expected one and a two-sided binomial p-value (normal approximation)."""
    p = probs.double() / probs.double().sum()
    mass = float(p[(p < below) & (p > 0)].sum())
    n = tokens.numel()
    observed = int(((p[tokens.flatten()] < below)).sum())
    sd = math.sqrt(n * mass * (1 - mass))
    return {"observed": observed, "expected": n * mass,
            "p": math.erfc(abs(observed - n * mass) / sd / math.sqrt(2)) if sd > 0 else float(observed == 0)}


def homogeneity(a: Sequence[int], b: Sequence[int], least: float = 5.0) -> Dict[str, float]:
    """Chi-square test that two samples of integers (lengths) come from one distribution: a 2 x K
    table over the values, neighbouring values merged until every cell expects `least` counts."""
    values = sorted(set(a) | set(b))
    ca = torch.tensor([sum(1 for x in a if x == v) for v in values], dtype=torch.float64)
    cb = torch.tensor([sum(1 for x in b if x == v) for v in values], dtype=torch.float64)
    share = len(a) / (len(a) + len(b))
    groups, acc = [], []
    for i in range(len(values)):
        acc.append(i)
        total = float((ca[acc] + cb[acc]).sum())
        if min(share, 1 - share) * total >= least:
            groups.append(acc)
            acc = []
    if acc:
        if groups:
            groups[-1] = groups[-1] + acc
        else:
            groups.append(acc)
    oa = torch.stack([ca[g].sum() for g in groups])
    ob = torch.stack([cb[g].sum() for g in groups])
    ea, eb = share * (oa + ob), (1 - share) * (oa + ob)
    stat = float(((oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb).sum())
    df = len(groups) - 1
    return {"chi2": stat, "df": df, "p": chi2_sf(stat, df) if df > 0 else 1.0}


def exact_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(z / T) in float64, cut to the smallest set of tokens whose mass reaches top_p (in
    order of probability) and renormalised: the distribution a sampler should draw from. [V] -> [V]."""
    p = (logits.double() / temperature).softmax(-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(descending=True)
    kept = order[sorted_p.cumsum(0) - sorted_p < top_p]
    cut = torch.zeros_like(p).index_copy(0, kept, p[kept])
    return cut / cut.sum()


# ------------------------------------------------------------------------------- the prompts and stops


def bench_module():
    """scripts/bench_trl.py, beside this script, as a module."""
    if "bench_trl" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_trl", Path(__file__).with_name("bench_trl.py"))
        sys.modules["bench_trl"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(sys.modules["bench_trl"])
    return sys.modules["bench_trl"]


def bench_setup(model: str, steps: int, out: Path):
    """The bench's GRPO work for `model` (scripts/bench_trl.py): its prompt rows (8 per step) and
    the config rlnotes trains with on them, composed as `rlnotes train` composes it."""
    from rlnotes.commands.check import check

    bench_trl = bench_module()
    from rlnotes.engine.model.loading import smollm2_dir

    shape = bench_trl.SHAPES["grpo"]
    chat = model != "tiny"
    rows = bench_trl.make_rows(shape, shape.prompts * steps, chat, lambda prompt: 0)
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prep = {"model_dir": str(smollm2_dir()) if chat else "tiny", "chat": chat, "seed": bench_trl.SEED}
    cmd = bench_trl.rlnotes_command(prep, model, shape, str(data), "1", steps, out)
    overrides = [c for c in cmd[cmd.index("train") + 1:] if not c.startswith("hydra.")]
    if not chat:  # the tiny model built in code, not the bench's saved copy of it
        overrides = [o for o in overrides if not o.startswith("model.name_or_path=")]
    return rows, check(overrides, multirun=False, config_dir=None)[0]


def trl_prompt_ids(tokenizer, prompts: list) -> tuple[List[List[int]], str]:
    """The prompt ids TRL 1.16's GRPOTrainer feeds the model: its own _tokenize_prompts where TRL is
    installed, else the calls it makes (apply_chat_template with the generation prompt for
    conversations, the tokenizer's own call for text); and which of the two gave them."""
    try:
        from trl import GRPOTrainer
    except ImportError:
        if isinstance(prompts[0], str):
            return [list(x) for x in tokenizer(text=prompts)["input_ids"]], "the tokenizer's call as TRL 1.16 makes it"
        out = tokenizer.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
        return [list(x) for x in out["input_ids"]], "apply_chat_template as TRL 1.16 calls it"
    from types import SimpleNamespace

    trainer = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs={})
    ids, _, _ = GRPOTrainer._tokenize_prompts(trainer, prompts)
    return [list(x) for x in ids], "TRL's GRPOTrainer._tokenize_prompts"


def listed(ids) -> List[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def trl_stop_ids(model, tokenizer) -> List[int]:
    """The ids TRL 1.16's GRPOTrainer stops at (its __init__): the generation config's EOS ids, the
    tokenizer's EOS put first when they lack it."""
    ids = listed(model.generation_config.eos_token_id)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def check_prompts(policy, fmt, rows: list) -> bool:
    """Print how rlnotes' prompt ids and stop ids compare with TRL's; True where they are the same."""
    from rlnotes.engine.sampling.generate import stop_ids

    tokenizer = policy.tokenizer
    prompts = [r["prompt"] for r in rows]
    ours = fmt.encode(tokenizer, prompts)
    theirs, how = trl_prompt_ids(tokenizer, prompts)
    same = [a == b for a, b in zip(ours, theirs)]
    print(f"prompts: {sum(same)} of {len(same)} identical to {how}; lengths {min(map(len, ours))}-"
          f"{max(map(len, ours))} tokens")
    for a, b in [(a, b) for a, b, s in zip(ours, theirs, same) if not s][:2]:
        print(f"  rlnotes: {tokenizer.decode(a)!r}\n  TRL:     {tokenizer.decode(b)!r}")
    print(f"prompt 1 as the model sees it: {tokenizer.decode(ours[0])!r}")
    stops, trl_stops = stop_ids(policy.model, tokenizer), trl_stop_ids(policy.model, tokenizer)
    print(f"stop ids: rlnotes {stops} {tokenizer.convert_ids_to_tokens(stops)}, TRL {trl_stops}, transformers' "
          f"generate alone {listed(policy.model.generation_config.eos_token_id)}")
    return all(same) and set(stops) == set(trl_stops)


# ------------------------------------------------------------------------------- the draw


def next_token_logits(policy, prompt_ids: List[List[int]], rows: int, seed: int) -> torch.Tensor:
    """The model's next-token logits [rows, V] at `rows` places spread over entropy: after a prompt
    and at each token of a completion sampled from it (prompts taken in turn until there are enough)."""
    from rlnotes.engine.policy.passes import forward
    from rlnotes.engine.sampling.generate import generate
    from rlnotes.engine.sampling.settings import SamplingSettings

    found = []
    for ids in prompt_ids[:4]:
        r = generate(policy.model, policy.tokenizer, [ids], 1, SamplingSettings(32), torch.Generator().manual_seed(seed))
        n = int(r.completion_mask.sum())
        width = r.prompt_ids.shape[1] + n  # the distributions its n tokens were drawn from
        found.append(forward(policy.model, r.input_ids[:, :width], r.attention_mask[:, :width],
                             n + 1).logits[0, :-1].float())
    logits = torch.cat(found)
    entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
    picks = entropy.argsort()[torch.linspace(0, len(logits) - 1, min(rows, len(logits))).long()]
    return logits[picks]


def check_draws(logits: torch.Tensor, draws: int, temperature: float, top_p: float, seed: int) -> bool:
    """Print, row by row, the chi-square and rare-token tests of rlnotes' draw and of
    torch.multinomial against the exact distribution; True where no test finds a difference."""
    from rlnotes.engine.sampling.generate import sample_inverse_cdf, sampling_probs, uniforms

    generator = torch.Generator().manual_seed(seed)
    per_row, ok = draws // len(logits), True
    print(f"the draw: {per_row} tokens per row, {len(logits)} rows of {logits.shape[1]} logits, temperature "
          f"{temperature}, top_p {top_p}")
    for i, z in enumerate(logits):
        exact = exact_probs(z, temperature, top_p)
        ours = sample_inverse_cdf(sampling_probs(z[None], temperature, top_p),
                                  uniforms(per_row, None, 0, generator, "cpu")[None])
        theirs = torch.multinomial(exact, per_row, replacement=True, generator=generator)
        line = []
        for name, tokens in (("rlnotes", ours), ("multinomial", theirs)):
            fit, rare = goodness_of_fit(tokens, exact), rare_rate(tokens, exact)
            ok &= fit["p"] >= ALPHA and rare["p"] >= ALPHA
            line.append(f"{name} chi2 {fit['chi2']:.0f}/{fit['df']} df p={fit['p']:.3f}, rare "
                        f"{rare['observed']}/{rare['expected']:.1f} p={rare['p']:.3f}")
        print(f"  row {i + 1} (top token {float(exact.max()):.3f}): " + "; ".join(line))
    return ok


# ------------------------------------------------------------------------------- the lengths


def generate_lengths(model, tokenizer, prompt_ids: List[List[int]], group_size: int, sampling,
                     stops: List[int]) -> List[int]:
    """Completion lengths (to the first stop id, which counts; else max_new_tokens), group_size per
    prompt, prompt by prompt, by transformers' generate with the settings TRL 1.16 gives it: the
    sampling temperature and top-p, no top-k, no repetition penalty, the stop ids."""
    from transformers import GenerationConfig

    from rlnotes.engine.rollout import left_pad

    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=True,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=stops, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                              repetition_penalty=1.0)
    ids, mask = left_pad([p for p in prompt_ids for _ in range(group_size)], tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    ended = torch.isin(out[:, ids.shape[1]:], torch.tensor(stops))
    first = ended.int().argmax(-1) + 1
    return torch.where(ended.any(-1), first, torch.full_like(first, sampling.max_new_tokens)).tolist()


def compare_lengths(policy, prompt_ids: List[List[int]], group_size: int, rounds: int, sampling,
                    seed: int, theirs=None) -> Dict[str, object]:
    """`rounds` alternating rounds of group_size completions of every prompt by rlnotes' generate
    (through policy.sampling(), as a training step) and by transformers' generate
    (generate_lengths, on the policy's model; with the settings `theirs`, by default `sampling`):
    each side's lengths, prompt by prompt within a round, the tests (length_tests) and the seconds
    each side took."""
    from rlnotes.engine.sampling.generate import generate, stop_ids

    stops = stop_ids(policy.model, policy.tokenizer)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1)  # transformers' sampling draws from torch's global stream
    lengths: Dict[str, List[int]] = {"rlnotes": [], "generate": []}
    seconds = {"rlnotes": 0.0, "generate": 0.0}
    policy.eval()
    for _ in range(rounds):
        start = time.perf_counter()
        with torch.no_grad(), policy.sampling() as model:
            r = generate(model, policy.tokenizer, prompt_ids, group_size, sampling, generator)
        lengths["rlnotes"] += r.completion_mask.sum(-1).long().tolist()
        seconds["rlnotes"] += time.perf_counter() - start
        start = time.perf_counter()
        lengths["generate"] += generate_lengths(policy.model, policy.tokenizer, prompt_ids, group_size,
                                                  theirs or sampling, stops)
        seconds["generate"] += time.perf_counter() - start
    a, b = lengths["rlnotes"], lengths["generate"]
    return {"lengths": lengths, "seconds": seconds, "tests": length_tests(a, b)}


def length_tests(a: Sequence[int], b: Sequence[int]) -> Dict[str, Dict[str, float]]:
    """Whether two samples of lengths differ: a chi-square on the length bins (homogeneity), a
    Kolmogorov-Smirnov test and a test of the means."""
    return {"chi2": homogeneity(a, b), "ks": ks_two_sample(a, b), "mean": mean_difference(a, b)}


def agree(tests: Dict[str, Dict[str, float]]) -> bool:
    """True where no length test finds a difference (every p-value at least ALPHA)."""
    return all(t["p"] >= ALPHA for t in tests.values())


def trl_lengths(cfg, rows: list, group_size: int, rounds: int, seed: int) -> List[int]:
    """Completion lengths (EOS included) from TRL 1.16's own generation: a GRPOTrainer built as
    scripts/bench_trl.py builds it, on a fresh copy of the model, its _generate called on
    group_size copies of every row per round, the model in training mode as during training."""
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig

    from rlnotes.engine.model.loading import load_base

    bench_trl = bench_module()
    torch.manual_seed(seed)  # the tiny model's weights, as the policy's
    model, tokenizer = load_base(cfg.model)
    lora = LoraConfig(r=bench_trl.LORA["r"], lora_alpha=bench_trl.LORA["alpha"], lora_dropout=bench_trl.LORA["dropout"],
                      target_modules=bench_trl.LORA["target_modules"], task_type="CAUSAL_LM")
    timers = {"generate_s": 0.0, "reference_s": 0.0, "completion_tokens": 0.0, "prompt_tokens": 0.0, "prompts": []}
    lengths: List[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        common = dict(output_dir=tmp, max_steps=1, use_cpu=True, report_to="none", seed=seed, bf16=False,
                      gradient_checkpointing=False, save_strategy="no", disable_tqdm=True)
        trainer = bench_trl.grpo_trainer(bench_trl.SHAPES["grpo"], common, model, tokenizer, Dataset.from_list(rows),
                                         lora, timers)
        trainer.model.train()
        torch.manual_seed(seed + 2)
        for _ in range(rounds):
            lengths += [len(ids) for ids in trainer._generate([r["prompt"] for r in rows for _ in range(group_size)])[1]]
    return lengths


def per_prompt_means(lengths: List[int], prompts: int, group_size: int) -> List[float]:
    """Mean length of each prompt's completions over rounds of `group_size` per prompt."""
    rows = torch.tensor(lengths, dtype=torch.float64).view(-1, prompts, group_size)
    return rows.mean(dim=(0, 2)).tolist()


def report_lengths(result: Dict[str, object], max_new_tokens: int) -> bool:
    """Print each side's mean length and truncated share, and the tests of rlnotes' lengths against
    each other side's; True where no test finds a difference."""
    for side, x in result["lengths"].items():
        print(f"  {side}: {len(x)} completions, mean length {statistics.mean(x):.2f} tokens (sd "
              f"{statistics.stdev(x):.2f}), truncated at {max_new_tokens}: "
              f"{sum(v == max_new_tokens for v in x) / len(x):.1%}, {result['seconds'][side]:.0f} s")
    ok = True
    for other in [side for side in ("generate", "trl") if side in result["lengths"]]:
        tests = length_tests(result["lengths"]["rlnotes"], result["lengths"][other])
        chi2, ks, mean = tests["chi2"], tests["ks"], tests["mean"]
        print(f"  rlnotes against {other}: chi-square on length bins {chi2['chi2']:.1f} on {chi2['df']} df, "
              f"p={chi2['p']:.3f}; Kolmogorov-Smirnov D={ks['D']:.3f}, p={ks['p']:.3f}; means z={mean['z']:.2f}, "
              f"p={mean['p']:.3f}")
        ok &= agree(tests)
    return ok


# ------------------------------------------------------------------------------- the script


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2-135m", "tiny"], default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="the bench's steps: 8 prompts each (default 4)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt per round (default 8)")
    parser.add_argument("--samples", type=int, default=1024, help="completions per side, at least (default 1024)")
    parser.add_argument("--draws", type=int, default=100_000, help="tokens per sampler in the draw test (default 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for every length and per-prompt means")
    parser.add_argument("--trl", action="store_true",
                        help="also as many completions by TRL's own GRPOTrainer._generate (needs trl: pip extra bench)")
    args = parser.parse_args(argv)
    if min(args.steps, args.group, args.samples, args.draws, args.threads) < 1:
        parser.error("--steps, --group, --samples, --draws and --threads must be positive")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    import tempfile

    from rlnotes.data.settings import prompt_format
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.engine.sampling.settings import SamplingSettings

    args = parse_args(argv)
    if args.trl and importlib.util.find_spec("trl") is None:
        print('sampling_check: error: --trl needs TRL; install the bench extra: pip install -e ".[bench]"',
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{args.model}; {os.cpu_count()} CPUs ({cpu}), {args.threads} threads; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        rows, cfg = bench_setup(args.model, args.steps, Path(tmp))
    torch.manual_seed(args.seed)  # the tiny model's weights
    policy = Policy.from_config(cfg.model, torch.device("cpu"))
    fmt, sampling = prompt_format(cfg), SamplingSettings.of(cfg.rollout)
    prompt_ids = fmt.encode(policy.tokenizer, [r["prompt"] for r in rows])
    ok = check_prompts(policy, fmt, rows)
    with torch.no_grad():
        logits = next_token_logits(policy, prompt_ids, 8, args.seed)
    ok &= check_draws(logits, args.draws, sampling.temperature, sampling.top_p, args.seed)
    rounds = math.ceil(args.samples / (len(prompt_ids) * args.group))
    print(f"lengths: {len(prompt_ids)} prompts x {args.group} completions x {rounds} rounds per side, at most "
          f"{sampling.max_new_tokens} new tokens, temperature {sampling.temperature}, top_p {sampling.top_p}")
    result = compare_lengths(policy, prompt_ids, args.group, rounds, sampling, args.seed)
    if args.trl:
        start = time.perf_counter()
        result["lengths"]["trl"] = trl_lengths(cfg, rows, args.group, rounds, args.seed)
        result["seconds"]["trl"] = time.perf_counter() - start
    ok &= report_lengths(result, sampling.max_new_tokens)
    if args.out:
        means = {side: per_prompt_means(x, len(prompt_ids), args.group) for side, x in result["lengths"].items()}
        args.out.write_text(json.dumps({"prompts": [r["prompt"] for r in rows], "group": args.group,
                                        "lengths": result["lengths"], "per_prompt_means": means}))
    print("no difference found" if ok else f"a difference (p < {ALPHA}) or a mismatch: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
