"""A training step's floor: the seconds its matrix products would take at the rate this machine
multiplies the model's own weight matrices, measured in the same run as the step (used by
scripts/bench_trl.py, which prints each step beside its floor). Run alone, it prints the rate of each
of torch's products at each linear shape of SmolLM2-135M:

    python scripts/step_floor.py --threads 2 --rows 32 512 1024

Per step of B prompts (pairs): N the weights of the model's linear layers below its LM head, H
the LM head's (embeddings are looked up, not multiplied), d the model width, L its layers:

    GRPO  T = B (P + G R), C = B G R   sampling 1 + reference 1 (beta > 0) + training 2 passes
    DPO   T = B (P + Y),   C = B Y     reference 1 + training 2 passes
    FLOPs = passes x (2 N T + 2 H C + attention),  attention of S tokens = 2 d L S (S + 1)

P: prompt tokens, forwarded once per group (the math needs its keys and values once); R: the
completion tokens sampled (measured); Y: the chosen and rejected answers' tokens; C: the tokens
whose log-probabilities the step needs, the only ones the LM head must score. Training counts
as two forward passes: the forward and the backward's gradients of the activations (the frozen
weights get none; LoRA's own products, a few percent of the model's, are left out). Attention is causal: the
completions of a group attend to their prompt, which is counted once.

The rate: x (M tokens) @ W^T for every linear layer of the model, at M = 512 tokens (a training
pass's size), best of several repeats, in the step's precision and thread count, through the faster
of torch's default product (MKL) and oneDNN's with the weight packed once (on a Zen 5 EPYC oneDNN's
float32 product ran about 2x MKL's at these shapes: docs/benchmarks.md). Decoding runs at
far fewer rows per product and reaches a lower rate, so the floor is one no step can beat.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Dict, Tuple

# Rows per timed product: the tokens of a training micro-batch.
RATE_ROWS = 512


def model_dims(model_dir: str) -> dict:
    """dims_of the model a dir's config describes, read without loading its weights (the model
    built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        return dims_of(AutoModelForCausalLM.from_config(config))


def dims_of(model) -> dict:
    """{"linears": [[in, out, count], ...], "body", "head", "d", "layers"} of a causal LM: its linear
    layers' shapes, the weights of those below the LM head (body) and of the LM head (head)."""
    import torch

    shapes: Counter = Counter((m.in_features, m.out_features) for m in model.modules()
                              if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    return {"linears": [[i, o, c] for (i, o), c in sorted(shapes.items())],
            "body": sum(i * o * c for (i, o), c in shapes.items()) - head, "head": head,
            "d": model.config.hidden_size, "layers": model.config.num_hidden_layers}


def step_flops(dims: dict, algo: str, prompts: int, prompt_tokens: float, group: int = 1,
               completion_tokens: float = 0.0, answer_tokens: float = 0.0, reference: bool = True,
               shared_prompt: bool = True) -> float:
    """The FLOPs of one step as the module's docstring counts them; `completion_tokens` is the mean
    completion length (GRPO), `answer_tokens` the chosen and rejected answers' tokens per pair (DPO).
    Without `shared_prompt` the reference and training passes forward each completion's prompt
    with it (GRPO with trainer.shared_prompt=false)."""
    body, head, d, layers = dims["body"], dims["head"], dims["d"], dims["layers"]
    p = prompt_tokens

    def causal(s: float) -> float:  # the query at position i (from 1) takes i keys and i values: 4 d i per layer
        return 2 * d * layers * s * (s + 1)

    def forward(prompt_copies: int, answers: int, length: float) -> float:
        """One pass over every prompt, forwarded `prompt_copies` times, and its `answers` answers of
        `length` tokens after it; the LM head on the answers' tokens alone."""
        tokens = prompts * (prompt_copies * p + answers * length)
        attention = prompts * (prompt_copies * causal(p) + answers * (causal(p + length) - causal(p)))
        return 2 * body * tokens + 2 * head * prompts * answers * length + attention

    if algo == "grpo":
        scored = forward(1 if shared_prompt else group, group, completion_tokens)
        return forward(1, group, completion_tokens) + scored * ((1 if reference else 0) + 2)
    if algo == "dpo":
        return forward(1, 2, answer_tokens / 2) * ((1 if reference else 0) + 2)
    raise ValueError(f"no floor for algo {algo!r}")


def products(x, w) -> list:
    """The ways this torch multiplies x @ W^T: its default (MKL on a CPU) and, where the build has it
    for this dtype, oneDNN's product with W reordered once (what rlnotes runs its frozen weights
    through: rlnotes.engine.policy.packed). The faster of them sets the rate, so the floor is one that
    no tool's kernel beats."""
    import torch

    from rlnotes.engine.policy import packed

    ways = [lambda: torch.nn.functional.linear(x, w)]
    if packed.available() and (w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and packed.available_bf16())):
        copy = packed.reordered(w)
        ways.append(lambda: packed.packed_product(x, copy))
    return ways


def best_time(product, repeats: int) -> float:
    """The best of `repeats` timings of ~20 ms of calls to `product`, in seconds per call."""
    start = time.perf_counter()
    product()  # warms the kernels and the allocator, and says how many calls fill 20 ms
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            product()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def matmul_rate(dims: dict, threads: int, precision: str = "fp32", repeats: int = 5) -> Tuple[float, Dict]:
    """FLOP/s of x @ W^T over the model's linear layers (each shape weighted by its count), each shape
    at the faster of torch's products (`products`), the best of `repeats` timings of ~20 ms, with
    `threads` threads, in float32 or bfloat16; and the rate of each shape."""
    import torch

    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    flops = seconds = 0.0
    per_shape = {}
    for fan_in, fan_out, count in dims["linears"]:
        x = torch.randn(RATE_ROWS, fan_in, generator=g).to(dtype)
        w = torch.randn(fan_out, fan_in, generator=g).to(dtype)
        best = min(best_time(product, repeats) for product in products(x, w))
        work = 2.0 * RATE_ROWS * fan_in * fan_out
        per_shape[f"{fan_in}x{fan_out}"] = work / best
        flops += count * work
        seconds += count * best
    return flops / seconds, per_shape


def main() -> None:
    import argparse
    import os

    parser = argparse.ArgumentParser(description="GFLOP/s of torch's products at each linear shape of SmolLM2-135M")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, RATE_ROWS, 1024], help="rows of x (tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timings of ~20 ms per product, the best kept")
    args = parser.parse_args()
    from rlnotes.engine.hardware.openmp import wait_briefly  # before torch loads, as under `rlnotes`

    wait_briefly(os.environ)
    import torch

    from rlnotes.engine.model.loading import smollm2_shaped

    torch.set_num_threads(args.threads)
    with torch.device("meta"):
        dims = dims_of(smollm2_shaped())
    g = torch.Generator().manual_seed(0)
    print(f"{args.threads} threads, float32; GFLOP/s of torch's default product (MKL) and oneDNN's with W packed once")
    print("rows | W^T in x out | default | oneDNN | oneDNN / default")
    for rows in args.rows:
        for fan_in, fan_out, _ in dims["linears"]:
            x, w = torch.randn(rows, fan_in, generator=g), torch.randn(fan_out, fan_in, generator=g)
            rates = [2.0 * rows * fan_in * fan_out / best_time(p, args.repeats) / 1e9 for p in products(x, w)]
            cells = [f"{r:.0f}" for r in rates] + (["-", "-"] if len(rates) == 1 else [f"{rates[1] / rates[0]:.2f}x"])
            print(f"{rows} | {fan_in} x {fan_out} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
