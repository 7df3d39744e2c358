"""Benchmark GRPO steps: seconds per step and where they go, generation tokens/s, peak memory,
and the step's FLOPs (scripts/step_floor.py) against the rate this machine multiplies the model's
weight matrices at, measured in the same run.

    python scripts/bench.py                       # tiny and SmolLM2-135M, 8 prompts x G=4 x 32 tokens
    python scripts/bench.py --models tiny --steps 10
    python scripts/bench.py --shared-prompt       # the policy pass with and without prompt sharing
    python scripts/bench.py --precision           # bf16 log-probs against fp32's (SmolLM2's own weights)
    python scripts/bench.py --choice own-pass     # a GRPO step's phases with the choice on and off

Each model runs in its own process (so peak RSS is that model's). Figures are medians over the
steps after the first (warm-up). Run on a quiet machine; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_floor  # noqa: E402  (scripts/step_floor.py: a step's FLOPs and the matmul rate)

SHAPE = ["trainer.batch_size=8", "algo.group_size=4", "rollout.max_new_tokens=32", "logging.progress=false"]
MODELS = {
    "tiny": ["model=tiny", "data=letters", "reward=letters", "hardware.threads=1"],
    "smollm2-135m": ["model=smollm2-135m", "data=arith", "reward=arith", "optim.lr=1e-4"],
}


def run_one(name: str, steps: int) -> dict:
    import torch
    from hydra.types import RunMode
    from omegaconf import open_dict
    from rich.console import Console

    from rlnotes.commands.check import check, loader
    from rlnotes.commands.train import train
    from rlnotes.engine.prompts import encode_prompts
    from rlnotes.algos.registry import algorithm
    from rlnotes.training.setup import setup

    overrides = MODELS[name] + SHAPE + [f"trainer.steps={steps}"]
    check(overrides, False, None)
    cfg = loader(None).load_configuration("config", overrides, RunMode.RUN)
    with open_dict(cfg):
        del cfg["hydra"]
    threads = cfg.hardware.threads if isinstance(cfg.hardware.threads, int) else torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp), Console(quiet=True))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        ctx = setup(cfg, algorithm(cfg.algo.name), Path(tmp) / "probe", Console(quiet=True))  # for the model's shape and prompt lengths
        ctx.out.logger.close()
    prompts = [r["prompt"] for r in ctx.data.sampler.next_batch()]
    policy = ctx.model.policy
    prompt_tokens = statistics.mean(len(p) for p in encode_prompts(policy.tokenizer, prompts,
                                                                    cfg.model.chat_template, cfg.model.system_prompt))
    base = policy.model.get_base_model() if policy.uses_lora else policy.model
    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm if r.get(k) is not None)
           for k in ("time/step_s", "time/generate_s", "time/reference_s", "time/policy_s", "perf/gen_tokens_per_s",
                     "completion/len_mean")}
    dims = step_floor.dims_of(base)
    gflops = step_floor.matmul_rate(dims, threads)[0] / 1e9
    flops = step_floor.step_flops(dims, "grpo", cfg.trainer.batch_size, prompt_tokens, cfg.algo.group_size,
                                  med["completion/len_mean"], reference=cfg.algo.beta > 0,
                                  shared_prompt=cfg.trainer.shared_prompt)
    return {"model": name, "threads": threads, "matmul_gflops": gflops, "step_flops": flops, **med,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


# (name, prompts, prompt tokens, G, new tokens, tokens of a system prompt every prompt starts with) of
# --shared-prompt: the bench shape (SmolLM2's template puts 27 shared tokens first), a long-prompt one
# (fewer prompts than a real step, to keep the run short: the ratio is per group) and a long system prompt.
SHARING_SHAPES = [("bench", 8, 45, 4, 32, 27), ("long-prompt", 2, 200, 8, 64, 27),
                  ("system-prompt", 4, 220, 4, 32, 200)]


def sharing_batch(vocab: int, prompts: int, prompt_len: int, group: int, new_tokens: int, prefix: int = 0,
                  seed: int = 0):
    """Random [left-padded prompt | right-padded completion] rows: prompt lengths within 10% of
    prompt_len, the first `prefix` tokens the same in all, completion lengths from half to all of
    new_tokens (one row at the full length)."""
    import torch

    from rlnotes.engine.rollout import left_pad

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(prompt_len * 0.9), int(prompt_len * 1.1) + 1, (prompts,), generator=g)
    system = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    texts = [system + torch.randint(3, vocab, (int(n) - prefix,), generator=g).tolist() for n in lengths]
    p_ids, p_mask = left_pad([t for t in texts for _ in range(group)], 2)
    n = prompts * group
    c_len = torch.randint(new_tokens // 2, new_tokens + 1, (n,), generator=g)
    c_len[0] = new_tokens
    c_mask = (torch.arange(new_tokens)[None] < c_len[:, None]).float()
    c_ids = torch.randint(3, vocab, (n, new_tokens), generator=g).masked_fill(c_mask == 0, 2)
    return torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask.long()], 1), c_mask


# --shared-prompt's ways to run the pass: every row whole; each prompt once per group
# (trainer.shared_prompt) but the common prefix with each prompt; and the prefix once too (the default).
SHARING_MODES = {"plain": (False, float("inf")), "groups": (True, float("inf")), "prefix": (True, None)}


def shared_prompt_ratio(threads: int, rounds: int, layers: int) -> None:
    """Time the policy's training pass (log-probs forward and backward, LoRA r16 on q/k/v/o) of a
    SmolLM2-shaped random model in each of SHARING_MODES, alternating; print the tokens forwarded,
    median seconds and the ratios per shape."""
    import torch
    from peft import LoraConfig, get_peft_model

    import rlnotes.engine.policy.passes as policy
    from rlnotes.engine.model.loading import smollm2_shaped

    torch.set_num_threads(threads)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(smollm2_shaped(layers), lora).train()
    default_saving = policy.MIN_PREFIX_SAVING
    print(f"policy pass (forward + backward), SmolLM2-shaped random model, {layers} layers, {threads} threads; "
          f"median of {rounds} alternating rounds; prefix: once when it saves >= {default_saving} tokens")
    print("shape | prompts x G x new tokens | tokens plain / groups / prefix | s plain / groups / prefix | "
          "groups vs plain | prefix vs groups")
    for name, prompts, prompt_len, group, new_tokens, prefix in SHARING_SHAPES:
        ids, attn, mask = sharing_batch(model.config.vocab_size, prompts, prompt_len, group, new_tokens, prefix)
        times, tokens = {mode: [] for mode in SHARING_MODES}, {}
        for _ in range(rounds):
            for mode, (share, saving) in SHARING_MODES.items():
                policy.MIN_PREFIX_SAVING = default_saving if saving is None else saving
                fed = []  # the tokens the passes really forward
                hook = model.get_input_embeddings().register_forward_hook(
                    lambda m, args, out: fed.append(args[0].numel()))
                start = time.perf_counter()
                logp = policy.sequence_logprobs(model, ids, attn, mask.shape[1], share_prompts=share)
                (logp * mask).sum().backward()
                times[mode].append(time.perf_counter() - start)
                hook.remove()
                tokens[mode] = sum(fed)
                model.zero_grad(set_to_none=True)
        policy.MIN_PREFIX_SAVING = default_saving
        s = {mode: statistics.median(times[mode]) for mode in SHARING_MODES}
        print(f"{name} | {prompts} x {group} x {new_tokens} (prompts ~{prompt_len}, {prefix} shared) | "
              f"{' / '.join(str(tokens[m]) for m in SHARING_MODES)} | {' / '.join(f'{s[m]:.2f}' for m in s)} | "
              f"{s['plain'] / s['groups']:.2f}x | {s['groups'] / s['prefix']:.2f}x", flush=True)


def token_stats(diff, mask) -> str:
    """max, mean and 99th percentile of |diff| over the real tokens, and the largest |sum| of a row."""
    real = diff[mask.bool()].abs()
    return (f"max {real.max():.4f}, mean {real.mean():.4f}, p99 {real.quantile(0.99):.4f}; per completion (sum) "
            f"at most {(diff * mask).sum(1).abs().max():.3f}")


def precision_check(name: str, threads: int, new_tokens: int) -> None:
    """hardware.precision=bf16 against fp32 on one batch of 8 arithmetic prompts x G=4 sampled in
    fp32 from `name`'s own weights (adapter at its zero start): the log-prob of each sampled token in
    bf16 (frozen weights stored in bf16, autocast) against fp32's, and in each precision the sampler's
    log-probs (which PPO and algo.epochs > 1 take as pi_old) against the training pass's."""
    import copy

    import torch
    from omegaconf import OmegaConf

    from rlnotes.core.schema import ModelConfig
    from rlnotes.engine.hardware.devices import bf16_units, mixed_precision
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.engine.prompts import encode_prompts
    from rlnotes.engine.sampling.generate import generate
    from rlnotes.engine.sampling.settings import SamplingSettings

    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    exact = Policy.from_config(OmegaConf.structured(ModelConfig(name_or_path=name)), cpu)
    low = copy.deepcopy(exact)
    low.store_frozen_in_bf16()
    exact.eval(), low.eval()
    chat = bool(exact.tokenizer.chat_template)
    questions = [f"What is {a}+{b}? Answer with just the number."
                 for a, b in [(12, 35), (7, 8), (41, 9), (23, 45), (3, 4), (66, 27), (19, 81), (50, 50)]]
    ids = encode_prompts(exact.tokenizer, [[{"role": "user", "content": q}] if chat else q for q in questions], chat)

    def sample(policy, precision):
        with mixed_precision(precision, cpu), policy.sampling() as model:
            return generate(model, policy.tokenizer, ids, 4, SamplingSettings(new_tokens),
                            torch.Generator().manual_seed(0))

    @torch.no_grad()
    def logprobs(policy, precision, rollout):
        with mixed_precision(precision, cpu):
            n = rollout.completion_ids.shape[1]
            return policy.logprobs(rollout.input_ids, rollout.attention_mask, n) * rollout.completion_mask

    fp32, bf16 = sample(exact, "fp32"), sample(low, "bf16")
    mask = fp32.completion_mask
    print(f"{name}, {int(mask.sum())} sampled tokens (8 prompts x G=4 x up to {new_tokens}); bf16 units: "
          f"{bf16_units(cpu) or 'none (emulated)'}; |difference| of per-token log-probs:")
    reference = logprobs(exact, "fp32", fp32)
    bf16_pass = logprobs(low, "bf16", fp32)
    print(f"bf16 training pass against fp32's, fp32's samples: {token_stats(bf16_pass - reference, mask)}")
    print(f"fp32 sampler against fp32 training pass: {token_stats(fp32.logprobs - reference, mask)}")
    print(f"bf16 sampler against bf16 training pass: "
          f"{token_stats(bf16.logprobs - logprobs(low, 'bf16', bf16), bf16.completion_mask)}")


def switch(choice: str, on: bool) -> None:
    """Turn one of CHOICES on or off in this process (the choices have no config key: they compute the
    same outputs up to rounding)."""
    from rlnotes.engine.policy import head, llama, packed, passes

    if choice == "own-pass":  # off: the model's forward with padding skipped, for the passes but not the decoder
        passes.LlamaLayers = llama.LlamaLayers if on else type("Off", (), {"of": classmethod(lambda cls, m: None)})
    else:  # "frozen-packs" off: frozen weights through torch's product (sampling's packing stays as set)
        llama.frozen_linear = packed.frozen_linear if on else (lambda module: None)
        head.packed_frozen = packed.packed_frozen if on else (lambda weight: False)


CHOICES = ("own-pass", "frozen-packs")


def choice_ab(name: str, choice: str, rounds: int) -> None:
    """The phases of `name`'s GRPO step (sampling, reference pass, training pass forward and backward)
    with `choice` on and off, alternating in one process: medians of `rounds` each."""
    import torch
    from hydra.types import RunMode
    from omegaconf import open_dict
    from rich.console import Console

    from rlnotes.algos.registry import algorithm
    from rlnotes.commands.check import check, loader
    from rlnotes.training.batching import rollout_micro_batches
    from rlnotes.training.sampling import next_rows, reference_logprobs, sample_and_score
    from rlnotes.training.setup import setup

    overrides = MODELS[name] + SHAPE + ["trainer.steps=1"]
    check(overrides, False, None)
    cfg = loader(None).load_configuration("config", overrides, RunMode.RUN)
    with open_dict(cfg):
        del cfg["hydra"]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = setup(cfg, algorithm(cfg.algo.name), Path(tmp), Console(quiet=True))
        model, policy = ctx.model, ctx.model.policy
        times = {True: [], False: []}
        for i in range(rounds + 1):  # the first round warms both up
            for on in (True, False) if i % 2 else (False, True):
                switch(choice, on)
                start = time.perf_counter()
                rollout, _, _ = sample_and_score(ctx.rollouts, model, ctx.data, ctx.run, next_rows(ctx.data.sampler),
                                                 cfg.algo.group_size)
                sampled = time.perf_counter()
                reference_logprobs(model, ctx.run, rollout, 1.0)
                referenced = time.perf_counter()
                policy.train()
                rows = torch.arange(len(rollout))
                for chunk in rollout_micro_batches(model, rollout, rows):
                    b = rollout.select(rows[chunk])
                    policy.logprobs(b.input_ids, b.attention_mask, b.completion_ids.shape[1]).sum().backward()
                model.policy.model.zero_grad(set_to_none=True)
                if i:
                    times[on].append((sampled - start, referenced - sampled, time.perf_counter() - referenced))
        switch(choice, True)
        ctx.out.logger.close()
    print(f"{name}, {choice}, {torch.get_num_threads()} threads, medians of {rounds} alternating rounds")
    for on in (True, False):
        gen, ref, train = (statistics.median(t[k] for t in times[on]) for k in range(3))
        print(f"{'on' if on else 'off'}: sampling {gen:.4f} s, reference pass {ref:.4f} s, training pass {train:.4f} s, "
              f"reference + training {ref + train:.4f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=0, help="steps per model (default: 12 tiny, 4 SmolLM2)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--shared-prompt", action="store_true",
                        help="instead: time the policy pass with and without prompt sharing "
                             "(a random SmolLM2-shaped model)")
    parser.add_argument("--precision", action="store_true",
                        help="instead: bf16 log-probs against fp32's and the sampler's against the training pass's "
                             "(SmolLM2-135M's own weights)")
    parser.add_argument("--choice", choices=CHOICES,
                        help="instead: the phases of each --models' GRPO step with this choice of rlnotes' passes on "
                             "and off, alternating in one process (--rounds each)")
    parser.add_argument("--threads", type=int, default=2, help="--shared-prompt, --precision: torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="--shared-prompt, --choice: alternating rounds")
    parser.add_argument("--layers", type=int, default=30, help="--shared-prompt: layers of the model (SmolLM2: 30)")
    args = parser.parse_args()
    if args.shared_prompt:
        shared_prompt_ratio(args.threads, args.rounds, args.layers)
        return
    if args.precision:
        precision_check("smollm2-135m", args.threads, 32)
        return
    if args.choice:
        for name in args.models:
            choice_ab(name, args.choice, args.rounds)
        return
    if args.one:
        print(json.dumps(run_one(args.one, args.steps)))
        return
    print(f"GRPO step, {' '.join(SHAPE[:3])}; medians after the first step")
    header = ("model", "threads", "step s", "gen s", "ref s", "policy s", "gen tok/s", "GFLOP/s", "matmul GFLOP/s",
              "of peak", "peak RSS GiB")
    print(" | ".join(header))
    for name in args.models:
        steps = args.steps or (12 if name == "tiny" else 4)
        out = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(steps)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        achieved = r["step_flops"] / r["time/step_s"] / 1e9
        print(" | ".join([r["model"], str(r["threads"]), f"{r['time/step_s']:.3f}", f"{r['time/generate_s']:.3f}",
                          f"{r.get('time/reference_s', 0):.3f}", f"{r['time/policy_s']:.3f}",
                          f"{r['perf/gen_tokens_per_s']:.0f}", f"{achieved:.1f}", f"{r['matmul_gflops']:.0f}",
                          f"{achieved / r['matmul_gflops']:.0%}", f"{r['peak_rss_gib']:.2f}"]))


if __name__ == "__main__":
    main()
