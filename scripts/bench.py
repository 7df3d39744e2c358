"""Benchmark GRPO steps: seconds per step and where they go, generation tokens/s, peak memory,
and the step's FLOPs against this machine's measured matmul rate.

    python scripts/bench.py                       # tiny and SmolLM2-135M, 8 prompts x G=4 x 32 tokens
    python scripts/bench.py --models tiny --steps 10

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


def step_flops(model, rows: list[dict], prompt_tokens: float, group: int, prompts: int, with_ref: bool) -> float:
    """Matmul FLOPs of one GRPO step: 2 per weight per token forward, twice that backward
    (activation gradients only: the base weights are frozen; LoRA's own are negligible)."""
    embed = model.get_input_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embed
    if not model.config.tie_word_embeddings:
        body -= model.get_output_embeddings().weight.numel()
    head = embed  # the LM head has the embedding's shape
    comp = statistics.median(r["completion/len_mean"] for r in rows) * group * prompts
    full = prompt_tokens * group * prompts + comp
    generate = 2 * body * (prompt_tokens * prompts + comp) + 2 * head * comp
    forward = 2 * body * full + 2 * head * comp
    return generate + forward * (1 if with_ref else 0) + 2 * forward  # + policy fwd and bwd


def run_one(name: str, steps: int) -> dict:
    import torch

    from rlnotes.cli import _loader, check
    from rlnotes.rollout import encode_prompts
    from rlnotes.runners.common import setup, train
    from hydra.types import RunMode
    from omegaconf import open_dict
    from rich.console import Console

    overrides = MODELS[name] + SHAPE + [f"trainer.steps={steps}"]
    check(overrides, False, None)
    cfg = _loader(None).load_configuration("config", overrides, RunMode.RUN)
    with open_dict(cfg):
        del cfg["hydra"]
    threads = cfg.hardware.threads or torch.get_num_threads()
    gflops = matmul_gflops(threads)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, Path(tmp), Console(quiet=True))
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        ctx = setup(cfg, Path(tmp) / "probe", Console(quiet=True))  # for the model's shape and prompt lengths
        ctx.logger.close()
    prompts = [r["prompt"] for r in ctx.sampler.next_batch()]
    prompt_tokens = statistics.mean(len(p) for p in encode_prompts(ctx.policy.tokenizer, prompts,
                                                                    cfg.model.chat_template, cfg.model.system_prompt))
    base = ctx.policy.model.get_base_model() if ctx.policy.uses_lora else ctx.policy.model
    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm if r.get(k) is not None)
           for k in ("time/step_s", "time/generate_s", "time/reference_s", "time/policy_s", "perf/gen_tokens_per_s",
                     "completion/len_mean")}
    flops = step_flops(base, warm, prompt_tokens, cfg.algo.group_size, cfg.trainer.batch_size, cfg.algo.beta > 0)
    return {"model": name, "threads": threads, "matmul_gflops": gflops, "step_flops": flops, **med,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=0, help="steps per model (default: 12 tiny, 4 SmolLM2)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
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
