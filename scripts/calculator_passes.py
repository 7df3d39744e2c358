"""Time the training passes of experiment=smollm2_calculator's steps on SmolLM2-135M: a GRPO step's
policy pass (4 questions x 4 episodes) and a warm-up step's (8 demonstrations), each cut into
micro-batches by the recipe's budget (trainer.micro_batch_memory=1 GiB, 776 tokens) three ways:

    whole rows     every row forwards its prompt (trainer.shared_prompt=false)
    per group      a group's episodes share its prompt's pass, but the ~318 tokens of system prompt and
                   tools block every prompt starts with are forwarded and counted again for each
                   question, so a pass holds one group (before this script's commit)
    prefix once    that prefix once per pass too, and the cut counts it once (the default now)

    python scripts/calculator_passes.py [--rounds 3] [--threads 2] [OVERRIDES...]

The episodes are the calculator demonstrations of the recipe's training problems, rendered as the
episodes render them (a call, the tool's result, the answer: what a trained model samples). Forward
and backward of the loss, medians over alternating rounds after one of warm-up. Figures move with
the box's load: the load average is printed before and after; compare the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from types import SimpleNamespace

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins

MODES = ("whole rows", "per group", "prefix once")


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def recipe(overrides):
    """The recipe's config (with `overrides`), model (as its runs build it), batching and demonstrations."""
    import torch
    from omegaconf import open_dict

    from rlnotes.agents.multi_turn import MultiTurn
    from rlnotes.commands.check import check
    from rlnotes.data.datasets import load_task
    from rlnotes.data.settings import prompt_format
    from rlnotes.engine.policy.policy import Policy
    from rlnotes.training.context import Batching

    cfg = check(["experiment=smollm2_calculator", *overrides], multirun=False, config_dir=None)[0]
    with open_dict(cfg):
        cfg.data.train_size = 64
    policy = Policy.from_config(cfg.model, torch.device("cpu"))
    model = SimpleNamespace(policy=policy, batching=Batching.of(cfg.trainer), prompt_format=prompt_format(cfg),
                            device=torch.device("cpu"))
    return cfg, model, load_task(cfg.data)[0], MultiTurn.of(cfg.rollout)


def episodes(model, rows, multi_turn, group: int):
    """A Rollout of `group` episodes per row: the demonstrations' tokens in the episodes' layout."""
    import torch

    from rlnotes.agents.rendering import Renderer, conversation_tokens
    from rlnotes.engine.rollout import Rollout
    from rlnotes.engine.sequences import pack

    tok, fmt = model.policy.tokenizer, model.prompt_format
    renderer = Renderer.of(tok, fmt.chat_template, multi_turn.schemas())
    parts = [conversation_tokens(renderer, r["messages"], fmt.system_prompt) for r in rows for _ in range(group)]
    seqs = pack([p for p, _, _ in parts], [ids for _, ids, _ in parts], tok.pad_token_id, torch.device("cpu"),
                [m for _, _, m in parts])
    n = seqs.n_completion
    return Rollout(seqs.input_ids[:, :-n], seqs.attention_mask[:, :-n], seqs.input_ids[:, -n:], seqs.completion_mask,
                   torch.zeros_like(seqs.completion_mask), [""] * len(parts), torch.zeros(len(parts), dtype=torch.bool),
                   completion_attn=seqs.real.float())


def grpo_pass(model, rollout) -> tuple[float, list]:
    """Forward and backward of a policy-gradient loss over the rollout's micro-batches (as grpo's step)."""
    import torch

    from rlnotes.training.batching import rollout_micro_batches

    chunks = rollout_micro_batches(model, rollout)
    start = time.perf_counter()
    for idx in chunks:
        b = rollout.select(idx)
        logp = model.policy.logprobs(b.input_ids, b.attention_mask, b.completion_ids.shape[1])
        (logp * b.completion_mask * torch.linspace(-1, 1, len(idx))[:, None]).sum().backward()
    return time.perf_counter() - start, [len(c) for c in chunks]


def warmup_pass(model, rows, multi_turn) -> tuple[float, list]:
    """Forward and backward of the warm-up's NLL over its micro-batches (as training.warmup's step)."""
    from rlnotes.notes import aggregate
    from rlnotes.training.offline import encode_demonstrations, sequence_micro_batches

    seqs = encode_demonstrations(model, rows, ("messages",), multi_turn)
    chunks = sequence_micro_batches(model, seqs)
    start = time.perf_counter()
    for idx in chunks:
        chunk = seqs.select(idx)
        logp = model.policy.logprobs(chunk.input_ids, chunk.attention_mask, chunk.n_completion)
        aggregate(-logp, chunk.completion_mask, "token-mean").backward()
    return time.perf_counter() - start, [len(c) for c in chunks]


def set_mode(model, mode: str, saving: int) -> None:
    """Run the passes as `mode` says; `saving`: passes.MIN_PREFIX_SAVING as the package sets it."""
    from rlnotes.engine.policy import passes

    model.policy.share_prompts = mode != "whole rows"
    passes.MIN_PREFIX_SAVING = 10**9 if mode == "per group" else saving


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds measured, after one of warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="settings over the recipe's, e.g. trainer.micro_batch_memory=1")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {args.threads} threads; load average {load()} (1, 5, 15 min) at the start")
    cfg, model, rows, multi_turn = recipe(args.overrides)
    model.policy.train()
    rollout = episodes(model, rows[:cfg.trainer.batch_size], multi_turn, cfg.algo.group_size)
    demos = rows[:cfg.sft_warmup.batch_size]
    print(f"GRPO batch: {len(rollout)} episodes, prompts {int(rollout.prompt_mask.sum(-1).max())} tokens, episodes "
          f"{int(rollout.real.sum(-1).max())} tokens after them; warm-up batch: {len(demos)} demonstrations")
    times = {(kind, mode): [] for kind in ("grpo", "warm-up") for mode in MODES}
    cuts = {}
    from rlnotes.engine.policy import passes

    saving = passes.MIN_PREFIX_SAVING
    try:
        for round_ in range(args.rounds + 1):
            for mode in MODES:
                set_mode(model, mode, saving)
                for kind, run in (("grpo", lambda: grpo_pass(model, rollout)),
                                  ("warm-up", lambda: warmup_pass(model, demos, multi_turn))):
                    model.policy.model.zero_grad(set_to_none=True)
                    seconds, cuts[kind, mode] = run()
                    if round_:
                        times[kind, mode].append(seconds)
    finally:
        passes.MIN_PREFIX_SAVING = saving
    print("\n| pass | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES))
    for kind in ("grpo", "warm-up"):
        cells = [f"{statistics.median(times[kind, m]):.2f} s ({len(cuts[kind, m])} passes)" for m in MODES]
        print(f"| {kind} | " + " | ".join(cells) + " |")
    for kind in ("grpo", "warm-up"):
        base = statistics.median(times[kind, "per group"])
        print(f"{kind}: prefix once {base / statistics.median(times[kind, 'prefix once']):.2f}x faster than per group, "
              f"{statistics.median(times[kind, 'whole rows']) / statistics.median(times[kind, 'prefix once']):.2f}x "
              "than whole rows")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"budget: trainer.micro_batch_memory={cfg.trainer.micro_batch_memory} GiB; peak RSS {peak:.1f} GiB; "
          f"load average {load()} at the end")


if __name__ == "__main__":
    main()
