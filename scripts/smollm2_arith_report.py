"""The figures and numbers of docs/results.md for `rlnotes train experiment=smollm2_arith`, from its run dirs.

    rlnotes train experiment=smollm2_arith seed=0 hydra.run.dir=runs/arith-0     # and seed=1 ...
    rlnotes eval eval.policy=runs/arith-0/final 'eval.data={digits: 1, max_digits: null}' \
        eval.out=runs/arith-0-1digit                                             # one-digit, after (each seed)
    rlnotes eval model=smollm2-135m data=arith eval.out=runs/base-1digit         # one-digit, before
    python scripts/smollm2_arith_report.py runs/arith-0 runs/arith-1 --base runs/base-1digit \
        --one-digit runs/arith-0-1digit runs/arith-1-1digit

Writes docs/smollm2_arith.png (the warm-up's loss, GRPO's reward and held-out two-digit accuracy
against steps, one line per seed) and prints, per run: two-digit accuracy at each evaluation,
one-digit accuracy after, wall time, where the steps' time went, and problems fixed by training.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from omegaconf import OmegaConf

from rlnotes.commands.plot import plot_metrics


def rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_eval(path: Path) -> float | None:
    return rows(path)[0]["eval/accuracy"] if path.is_file() else None


def report(run: Path, one_digit_dir: Path | None) -> None:
    metrics = rows(run / "metrics.jsonl")
    evals = [r for r in metrics if "eval/accuracy" in r]
    steps = [r for r in metrics if "time/step_s" in r]
    seed = OmegaConf.load(run / "config.yaml").seed
    one_digit = first_eval(one_digit_dir / "eval.jsonl") if one_digit_dir else None
    warm = [r for r in steps if "sft_warmup/loss" in r]
    rl = [r for r in steps if "sft_warmup/loss" not in r]
    median = lambda key, of=rl: statistics.median(r.get(key, 0.0) for r in of) if of else 0.0  # noqa: E731
    print(f"## {run} (seed {seed})")
    best = max(r["eval/accuracy"] for r in evals)
    print(f"two-digit held-out greedy accuracy: {evals[0]['eval/accuracy']:.3f} (step 0) -> "
          f"{evals[-1]['eval/accuracy']:.3f} (step {evals[-1]['step']}), best {best:.3f}; at each evaluation: "
          + ", ".join(f"{r['step']}: {r['eval/accuracy']:.3f}" for r in evals))
    print(f"one-digit accuracy after: {one_digit:.3f}" if one_digit is not None else
          "one-digit accuracy after: run "
          "`rlnotes eval eval.policy=RUN/final 'eval.data={digits: 1, max_digits: null}' eval.out=DIR` and give "
          "--one-digit DIR")
    print(f"wall time {metrics[-1]['time/elapsed_s'] / 60:.1f} min for {steps[-1]['step']} steps "
          f"(evaluations {sum(r.get('time/eval_s', 0) for r in evals):.0f} s of it; "
          "model loading before it not counted)")
    if warm:
        print(f"SFT warm-up: {len(warm)} steps, median {median('time/step_s', warm):.1f} s, "
              f"{sum(r['time/step_s'] for r in warm):.0f} s in all")
    print(f"{len(rl)} {OmegaConf.load(run / 'config.yaml').algo.name} steps: median {median('time/step_s'):.1f} s: "
          f"generate {median('time/generate_s'):.1f} s, reference {median('time/reference_s'):.1f} s, policy "
          f"{median('time/policy_s'):.1f} s; generation {median('perf/gen_tokens_per_s'):.0f} tokens/s")
    before = rows(run / "eval" / f"step_{evals[0]['step']:06d}.jsonl")
    after = rows(run / "eval" / f"step_{evals[-1]['step']:06d}.jsonl")
    fixed = [(b, a) for b, a in zip(before, after) if not b["correct"] and a["correct"]]
    broken = sum(b["correct"] and not a["correct"] for b, a in zip(before, after))
    print(f"{len(fixed)} held-out problems fixed, {broken} broken; for example:")
    for b, a in fixed[:6]:
        print(f"  {b['prompt'].split('?')[0]}?  {b['completion']!r} -> {a['completion']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--base", type=Path, help="the eval.out dir of `rlnotes eval` on the base model, one digit")
    parser.add_argument("--one-digit", nargs="+", type=Path, default=[],
                        help="the eval.out dir of `rlnotes eval` on each run's final policy, one digit, in the runs' order")
    parser.add_argument("--out", type=Path, default=Path("docs/smollm2_arith.png"))
    args = parser.parse_args()
    if args.one_digit and len(args.one_digit) != len(args.runs):
        parser.error(f"--one-digit takes one dir per run: {len(args.runs)} runs, {len(args.one_digit)} dirs")
    names = [f"seed {OmegaConf.load(run / 'config.yaml').seed}" for run in args.runs]
    plot_metrics(args.runs, ["sft_warmup/loss", "reward/mean", "eval/accuracy"], args.out, names=names,
                 title="SmolLM2-135M-Instruct, SFT warm-up then GRPO, LoRA, 2 CPU cores: warm-up loss, "
                       "GRPO reward, held-out two-digit accuracy")
    print(f"figure: {args.out}")
    if args.base:
        print(f"base model, one-digit accuracy: {first_eval(args.base / 'eval.jsonl'):.3f}")
    for i, run in enumerate(args.runs):
        report(run, args.one_digit[i] if args.one_digit else None)


if __name__ == "__main__":
    main()
