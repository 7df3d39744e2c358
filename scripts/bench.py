"""Benchmark GRPO steps: seconds per step and where they go, generation tokens/s, peak memory,
and the step's FLOPs against this machine's measured matmul rate.

    python scripts/bench.py                       # tiny and SmolLM2-135M, 8 prompts x G=4 x 32 tokens
    python scripts/bench.py --models tiny --steps 10
    python scripts/bench.py --shared-prompt       # the policy pass with and without prompt sharing

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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SHAPE = ["trainer.batch_size=8", "algo.group_size=4", "rollout.max_new_tokens=32", "logging.progress=false"]
MODELS = {
    "tiny": ["model=tiny", "data=letters", "reward=letters", "hardware.threads=1"],
    "smollm2-135m": ["model=smollm2-135m", "data=arith", "reward=arith", "optim.lr=1e-4"],
}


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 10) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def step_flops(model, rows: list[dict], prompt_tokens: float, group: int, prompts: int, with_ref: bool,
               shared_prompt: bool = True) -> float:
    """Matmul FLOPs of one GRPO step: 2 per weight per token forward, twice that backward
    (activation gradients only: the base weights are frozen; LoRA's own are negligible). With
    trainer.shared_prompt the training passes forward each prompt once: P + G R tokens a group."""
    embed = model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embed
    if not model.config.tie_word_embeddings:
        body -= model.get_output_embeddings().weight.numel()
    head = embed  # the LM head has the embedding's shape
    comp = statistics.median(r["completion/len_mean"] for r in rows) * group * prompts
    full = prompt_tokens * (1 if shared_prompt else group) * prompts + comp
    generate = 2 * body * (prompt_tokens * prompts + comp) + 2 * head * comp
    forward = 2 * body * full + 2 * head * comp
    return generate + forward * (1 if with_ref else 0) + 2 * forward  # + policy fwd and bwd


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
    gflops = matmul_gflops(threads)
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
    flops = step_flops(base, warm, prompt_tokens, cfg.algo.group_size, cfg.trainer.batch_size, cfg.algo.beta > 0,
                       cfg.trainer.shared_prompt)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=0, help="steps per model (default: 12 tiny, 4 SmolLM2)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--shared-prompt", action="store_true",
                        help="instead: time the policy pass with and without prompt sharing "
                             "(a random SmolLM2-shaped model)")
    parser.add_argument("--threads", type=int, default=2, help="--shared-prompt: torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="--shared-prompt: alternating rounds")
    parser.add_argument("--layers", type=int, default=30, help="--shared-prompt: layers of the model (SmolLM2: 30)")
    args = parser.parse_args()
    if args.shared_prompt:
        shared_prompt_ratio(args.threads, args.rounds, args.layers)
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
