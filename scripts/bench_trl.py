"""rlnotes against Hugging Face TRL 1.16, side by side: step time, generation, reference and
training passes, completion tokens per second and peak memory, as ratios TRL / rlnotes.

    make bench-trl                                     # the full benchmark (long: a quiet machine)
    python scripts/bench_trl.py --models tiny --shapes grpo dpo --rounds 1 --steps 3 --threads 1
    python scripts/bench_trl.py --models smollm2-135m --shapes grpo --precisions fp32 bf16

Both sides train the same saved model dir (the tiny model saved once; SmolLM2-135M-Instruct's
float32 conversion in ~/.cache/rlnotes) on the same prompt file, with the same shape: prompts and
completions per step, new tokens, temperature, beta, clip range, learning rate, LoRA (r 16 on
q/k/v/o, alpha 32, no dropout), precision, threads. TRL runs with the notes' GRPO loss (loss_type
grpo: 1/|o_i| token averaging; scale_rewards group), gradient checkpointing off, no evaluation,
no saving, a log row every step. rlnotes runs as `python -m rlnotes train`, TRL's trainers in a
worker process of this script; rounds alternate (rlnotes, TRL, rlnotes, TRL, ...) so a change of
load hits both. Peak RSS is each process's own (wait4), model loading included.

--precisions fp32 bf16 runs every case in both, alternating within each round (rlnotes fp32, TRL
fp32, rlnotes bf16, TRL bf16): rlnotes with hardware.precision=bf16 (frozen weights stored in bf16,
LoRA and the optimizer in float32), TRL with bf16=True (the float32 model under autocast). The
report adds each tool's fp32 / bf16 step ratios and the 1-minute load average at the start and end
of every run (other processes' load moves every figure).

Per step: step = the optimizer step's wall time; generate = sampling; reference = the no-grad
pass of the base model (adapter off); train = step - generate - reference (rewards, advantages,
the policy's forward and backward, the optimizer). The first --warmup steps of every run and
rlnotes' DPO steps that ran an evaluation are left out; figures are medians over what is left,
pooled over rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins
sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_floor  # noqa: E402  (scripts/step_floor.py)


@dataclass(frozen=True)
class Shape:
    algo: str                # grpo or dpo
    prompts: int             # prompts (GRPO) or preference pairs (DPO) per step
    group: int = 1           # GRPO: completions per prompt
    new_tokens: int = 0      # GRPO: completion tokens at most
    prompt_tokens: int = 0   # prompts lengthened with worked examples to at least this many tokens; 0: the question
    max_length: int = 0      # DPO: TRL's max_length (prompt + answer); the pairs here never reach it
    micro_batch: int = 0     # GRPO: completions per forward and backward pass, both tools; 0: all at once


SHAPES = {
    "grpo": Shape("grpo", prompts=8, group=4, new_tokens=32),
    # 64 completions of ~264 tokens at once would keep ~20 GB of activations (estimated) for backward.
    "grpo-long": Shape("grpo", prompts=8, group=8, new_tokens=64, prompt_tokens=200, micro_batch=16),
    "dpo": Shape("dpo", prompts=8, max_length=64),
}
MODELS = ("tiny", "smollm2-135m")
# Steps per run; a tiny step takes a fraction of a second, a SmolLM2 step tens of seconds.
DEFAULT_STEPS = {"tiny": 12, "smollm2-135m": 4}
# What both sides are given. The learning rate only has to be equal: it changes no timing.
LR, GRPO_BETA, CLIP_EPS, DPO_BETA, TEMPERATURE = 1e-5, 0.04, 0.2, 0.1, 1.0
SEED = 0  # both tools' seed unless --seed says another
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
TOOLS = ("rlnotes", "trl")
PRECISIONS = ("fp32", "bf16")
COLUMNS = ("step_s", "generate_s", "reference_s", "train_s", "completion_tokens", "tokens_per_s")


def default_threads(model: str) -> List[str]:
    """The tiny model with each tool's own default thread count and with one thread for both;
    SmolLM2 with every core for both."""
    return ["default", "1"] if model == "tiny" else [str(os.cpu_count() or 1)]


def threads_arg(value: str) -> str:
    if value != "default" and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError(f"{value!r}: a thread count (1, 2, ...) or 'default' (each tool's own)")
    return value


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tool per case, alternating (default 3)")
    parser.add_argument("--steps", type=int, default=0,
                        help="optimizer steps per run (default: 12 tiny, 4 SmolLM2)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out (default 1)")
    parser.add_argument("--threads", nargs="+", type=threads_arg, default=None,
                        help="thread counts to run every model at, or 'default' (each tool's own); "
                             "default: tiny at 'default' and 1, SmolLM2 at every core")
    parser.add_argument("--precisions", nargs="+", default=["fp32"], choices=PRECISIONS,
                        help="precisions to run every case in, alternating within each round (default fp32); "
                             "bf16: rlnotes hardware.precision=bf16, TRL bf16=True")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="completions per forward/backward pass in every GRPO shape, 0 for all at once "
                             "(default: all, and 16 at grpo-long)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where runs, bench_trl.json and bench_trl.md go (default outputs/bench_trl/TIME)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default 3600)")
    parser.add_argument("--seed", type=int, default=SEED,
                        help="both tools' seed: their random numbers and rlnotes' prompt order (default 0)")
    parser.add_argument("--worker", choices=["prepare", "trl", "rate"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 0 or args.warmup < 0:
        parser.error("--rounds must be >= 1, --steps and --warmup >= 0")
    args.shape_table = {name: SHAPES[name] if SHAPES[name].algo != "grpo" or args.micro_batch is None
                        else replace(SHAPES[name], micro_batch=args.micro_batch) for name in args.shapes}
    for name, shape in args.shape_table.items():
        n = shape.prompts * shape.group
        if shape.micro_batch < 0 or (shape.micro_batch and n % shape.micro_batch):
            parser.error(f"--micro-batch {shape.micro_batch} must divide the {n} completions of shape {name}")
    for model in args.models:
        if args.warmup >= (args.steps or DEFAULT_STEPS[model]):
            parser.error(f"--warmup {args.warmup} leaves no step of {args.steps or DEFAULT_STEPS[model]} to measure "
                         f"({model}); raise --steps or lower --warmup")
    return args


# ---------------------------------------------------------------------------------- the work


def question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a}+{b}? Answer with just the number.", a + b


def long_question(rng: random.Random, fits) -> tuple[str, int]:
    """A question after worked examples, enough of them that `fits(text)` (the prompt's token count
    reached the target) holds."""
    text, answer = question(rng)
    examples: List[str] = []
    while not fits(" ".join(["Worked examples:"] + examples + [text])):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        examples.append(f"{a}+{b}={a + b}.")
    return " ".join(["Worked examples:"] + examples + [text]), answer


def make_rows(shape: Shape, n: int, chat: bool, count_tokens) -> List[dict]:
    """`n` rows of two-digit additions: prompt and answer (GRPO), or prompt, chosen and rejected
    (DPO, the rejected answer 1-3 off); conversational for a chat model, plain text otherwise.
    `count_tokens(prompt)` is the prompt's length as both tools encode it."""
    rng = random.Random(1234)
    as_prompt = (lambda text: [{"role": "user", "content": text}]) if chat else (lambda text: text)
    as_answer = (lambda text: [{"role": "assistant", "content": text}]) if chat else (lambda text: text)
    rows = []
    for _ in range(n):
        if shape.prompt_tokens:
            text, answer = long_question(rng, lambda t: count_tokens(as_prompt(t)) >= shape.prompt_tokens)
        else:
            text, answer = question(rng)
        if shape.algo == "dpo":
            wrong = answer + rng.choice([-3, -2, -1, 1, 2, 3])
            rows.append({"prompt": as_prompt(text), "chosen": as_answer(str(answer)),
                         "rejected": as_answer(str(wrong))})
        else:
            rows.append({"prompt": as_prompt(text), "answer": str(answer)})
    return rows


def prepare(model: str, out: Path, shapes: Dict[str, Shape], steps: int, seed: int = SEED) -> dict:
    """The model dir both tools load and two prompt files per shape, one fresh batch for every step:
    rlnotes' file, and TRL's with the same rows in the order rlnotes draws them (rlnotes' data
    sampler with `seed`), which TRL reads unshuffled, so both tools sample the same prompts at
    every step. {"model_dir", "chat", "seed", "data": {shape: path}, "trl_data": {shape: path},
    "batches": {shape: each step's prompts (prompt_key)}, "prompt_tokens": {shape: mean prompt tokens},
    "answer_tokens": {DPO shape: mean tokens of a pair's two answers}, "dims": the model's (step_floor)}."""
    from transformers import AutoTokenizer

    from rlnotes.core.schema import TinyModelConfig
    from rlnotes.data.sampler import PromptSampler
    from rlnotes.engine.model.loading import smollm2_dir, tiny_model, tiny_tokenizer
    from rlnotes.engine.prompts import encode_prompts

    if model == "tiny":
        model_dir = out / "models" / "tiny"
        if not (model_dir / "config.json").exists():
            tokenizer = tiny_tokenizer()
            tiny_model(TinyModelConfig(), len(tokenizer)).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
    else:
        model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    chat = bool(tokenizer.chat_template)
    data, trl_data, batches, lengths, answers = {}, {}, {}, {}, {}
    for name, shape in shapes.items():
        rows = make_rows(shape, shape.prompts * steps, chat, lambda p: len(encode_prompts(tokenizer, [p], chat)[0]))
        sampler = PromptSampler(rows, shape.prompts, seed)
        drawn = [sampler.next_batch() for _ in range(steps)]
        batches[name] = [[prompt_key(r["prompt"]) for r in batch] for batch in drawn]
        for paths, suffix, written in ((data, "", rows), (trl_data, "-trl", [r for b in drawn for r in b])):
            path = out / "data" / f"{model}-{name}{suffix}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in written))
            paths[name] = str(path)
        lengths[name] = statistics.mean(len(ids) for ids in encode_prompts(tokenizer, [r["prompt"] for r in rows],
                                                                            chat))
        if shape.algo == "dpo":  # the chosen and rejected answers' tokens, each with its end token
            answers[name] = statistics.mean(sum(len(tokenizer(answer_text(r[k]), add_special_tokens=False)["input_ids"])
                                                + 1 for k in ("chosen", "rejected")) for r in rows)
    return {"model_dir": str(model_dir), "chat": chat, "seed": seed, "data": data, "trl_data": trl_data,
            "batches": batches, "prompt_tokens": lengths, "answer_tokens": answers,
            "dims": step_floor.model_dims(str(model_dir))}


def answer_text(answer) -> str:
    """A DPO answer's text: plain, or the content of its assistant message."""
    return answer if isinstance(answer, str) else answer[-1]["content"]


def prompt_key(prompt) -> str:
    """A prompt (text or messages) as one string, to compare the prompts of a step."""
    return json.dumps(prompt, sort_keys=True)


def rlnotes_command(prep: dict, model: str, shape: Shape, data: str, threads: str, steps: int,
                    run_dir: Path, precision: str = "fp32") -> List[str]:
    """`rlnotes train` with the shared settings; the prompt file is also the eval file, so no row
    is held out of training."""
    cmd = [sys.executable, "-m", "rlnotes", "train", f"algo={shape.algo}", f"model={model}",
           f"model.name_or_path={prep['model_dir']}", f"model.lora.r={LORA['r']}",
           f"model.lora.alpha={LORA['alpha']}", f"model.lora.dropout={LORA['dropout']}",
           f"model.lora.target_modules=[{','.join(LORA['target_modules'])}]",
           "data=file", f"data.path={data}", f"data.eval_path={data}",
           f"trainer.steps={steps}", f"trainer.batch_size={shape.prompts}", "trainer.log_every=1",
           "trainer.save_every=0", f"optim.lr={LR}", "optim.schedule=constant", f"seed={prep['seed']}",
           "logging.progress=false", f"hardware.precision={precision}", f"hydra.run.dir={run_dir}"]
    if prep["chat"]:
        cmd += ["model.chat_template=true", "model.system_prompt=null"]  # the template's own system prompt
    else:
        cmd += ["model.chat_template=false"]
    if shape.algo == "grpo":
        if shape.micro_batch:
            cmd.append(f"trainer.micro_batch_size={shape.micro_batch}")
        cmd += ["reward=arith", f"algo.group_size={shape.group}", f"algo.beta={GRPO_BETA}",
                f"algo.clip_eps={CLIP_EPS}", f"rollout.max_new_tokens={shape.new_tokens}",
                f"rollout.temperature={TEMPERATURE}", "rollout.top_p=1.0", "logging.samples_every=0"]
    else:
        cmd += [f"algo.beta={DPO_BETA}", "algo.loss_type=sigmoid", f"eval.size={shape.prompts}"]
    if threads != "default":
        cmd.append(f"hardware.threads={threads}")
    return cmd


def rlnotes_steps(metrics: Path, shape: Shape) -> List[dict]:
    """Per-step rows of an rlnotes run's metrics.jsonl, in this script's terms; a step that also ran
    an evaluation (rlnotes' DPO evaluates inside its first and last step) is marked `evaluated`."""
    rows = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "time/step_s" not in r:
            continue
        tokens = r["completion/len_mean"] * shape.prompts * shape.group if "completion/len_mean" in r else None
        # The reference pass in a process of its own beside the policy's: the step spent on it what it waited.
        reference = r.get("time/reference_wait_s", r.get("time/reference_s", 0.0))
        rows.append(step_row(r["step"], r["time/step_s"], r.get("time/generate_s", 0.0), reference, tokens,
                             evaluated=any(k.startswith("eval/") for k in r), policy_s=r.get("time/policy_s")))
    return rows


def step_row(step: int, step_s: float, generate_s: float, reference_s: float, tokens: Optional[float],
             **extra) -> dict:
    """One step in both tools' terms: train_s is what is neither sampling nor the reference pass."""
    return {"step": step, "step_s": step_s, "generate_s": generate_s, "reference_s": reference_s,
            "train_s": step_s - generate_s - reference_s, "completion_tokens": tokens,
            "tokens_per_s": tokens / step_s if tokens is not None else None, **extra}


def trl_spec(prep: dict, shape: Shape, data: str, threads: str, steps: int, out: Path,
             precision: str = "fp32") -> dict:
    return {"model_dir": prep["model_dir"], "seed": prep["seed"], "data": data, "shape": asdict(shape),
            "threads": threads, "steps": steps, "out": str(out), "precision": precision}


def wait_rusage(proc: subprocess.Popen, timeout: Optional[float]) -> tuple[int, float]:
    """(exit code, peak RSS in GiB) of `proc` (killed past `timeout` seconds)."""
    start = time.monotonic()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss / 2**20  # Linux reports KiB
        if timeout is not None and time.monotonic() - start > timeout:
            proc.kill()
            timeout = None
        time.sleep(0.1)


def thread_env(threads: str, **extra: str) -> Dict[str, str]:
    """This process's environment for a child that runs with `threads` threads (OMP_NUM_THREADS;
    'default' leaves torch's own), OpenMP's waiting as rlnotes sets it (openmp.wait_briefly; this process
    set it already unless the user did), and `extra`: the same for both tools."""
    env = dict(os.environ, **extra)
    if threads == "default":
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = threads
    return env


def run_one(tool: str, prep: dict, model: str, shape_name: str, shape: Shape, threads: str, steps: int,
            run_dir: Path, timeout: Optional[float] = None, precision: str = "fp32") -> dict:
    """One run of one tool in its own process: its per-step rows, peak RSS, wall time, exit code and
    the 1-minute load average before and after it."""
    data = prep["data" if tool == "rlnotes" else "trl_data"][shape_name]
    run_dir.mkdir(parents=True, exist_ok=True)
    env = thread_env(threads, TOKENIZERS_PARALLELISM="false")
    if tool == "rlnotes":
        cmd = rlnotes_command(prep, model, shape, data, threads, steps, run_dir, precision)
    else:
        spec = run_dir / "spec.json"
        spec.write_text(json.dumps(trl_spec(prep, shape, data, threads, steps, run_dir / "steps.jsonl", precision)))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trl", "--spec", str(spec)]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with open(run_dir / "output.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        code, rss = wait_rusage(proc, timeout)
    record = {"tool": tool, "model": model, "shape": shape_name, "threads": threads, "precision": precision,
              "returncode": code, "peak_rss_gib": rss, "wall_s": time.perf_counter() - start,
              "load_before": load_before, "load_after": os.getloadavg()[0], "run_dir": str(run_dir),
              "command": shlex.join(cmd), "steps": []}
    try:
        record["steps"] = (rlnotes_steps(run_dir / "metrics.jsonl", shape) if tool == "rlnotes" else
                           [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()])
    except FileNotFoundError:
        pass
    if code != 0:
        record["error"] = (run_dir / "output.log").read_text()[-3000:]
    return record


# ---------------------------------------------------------------------------------- the TRL side


def timed_context(factory, timers: Dict[str, float], key: str):
    """`factory`'s context manager that also adds the time spent inside it to timers[key]."""
    @contextlib.contextmanager
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        with factory(*args, **kwargs) as value:
            yield value
        timers[key] += time.perf_counter() - start
    return wrapper


def trl_worker(spec: dict) -> None:
    """Train with TRL's GRPOTrainer or DPOTrainer as the spec says; one JSON row per step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    if spec["threads"] != "default":
        torch.set_num_threads(int(spec["threads"]))
    shape = Shape(**spec["shape"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True)
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    timers: Dict[str, Any] = {"generate_s": 0.0, "reference_s": 0.0, "completion_tokens": 0.0,
                              "prompt_tokens": 0.0, "prompts": []}
    with tempfile.TemporaryDirectory() as tmp:
        # Same optimizer (torch.optim.AdamW fused, TRL's default and rlnotes') and schedule as rlnotes'
        # defaults; float32 unless the spec says bf16 (TRL defaults to bf16), no gradient checkpointing
        # (TRL's default; rlnotes has none), nothing saved or evaluated.
        common = dict(output_dir=tmp, max_steps=spec["steps"], optim="adamw_torch_fused", learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
                      adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, gradient_checkpointing=False,
                      bf16=spec["precision"] == "bf16", fp16=False, use_cpu=True, logging_steps=1,
                      save_strategy="no", eval_strategy="no", report_to="none", seed=spec["seed"], disable_tqdm=True,
                      dataloader_num_workers=0)
        if shape.algo == "grpo":
            trainer = grpo_trainer(shape, common, model, tokenizer, Dataset.from_list(rows), lora, timers)
        else:
            trainer = dpo_trainer(shape, common, model, tokenizer, Dataset.from_list(rows), lora, timers)

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timers.update(generate_s=0.0, reference_s=0.0, completion_tokens=0.0, prompt_tokens=0.0, prompts=[])
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                step_s = time.perf_counter() - self.start
                tokens = timers["completion_tokens"] if shape.algo == "grpo" else None
                row = step_row(state.global_step, step_s, timers["generate_s"], timers["reference_s"], tokens)
                if shape.algo == "grpo":
                    row["prompt_tokens"] = timers["prompt_tokens"] / (shape.prompts * shape.group)
                    row["prompts"] = timers["prompts"]
                out.write(json.dumps(row) + "\n")
                out.flush()

        with open(spec["out"], "w") as out:
            trainer.add_callback(StepTimes())
            trainer.train()


def grpo_trainer(shape: Shape, common: dict, model, tokenizer, dataset, lora, timers):
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer as module

    from rlnotes.rewards import (
        number_match,  # the reward rlnotes' reward=arith computes
    )

    module.use_adapter = timed_context(module.use_adapter, timers, "reference_s")  # only the reference pass uses it
    # The notes' GRPO: 1/|o_i| token averaging (loss_type grpo), group std scaling, k3 KL with beta > 0.
    # TRL's batch counts completions: prompts x G of them generated for one optimizer step, trained
    # in micro-batches by gradient accumulation (one generation batch per step, so no old-policy pass).
    n = shape.prompts * shape.group
    micro = shape.micro_batch or n
    config = GRPOConfig(**common, per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                        num_generations=shape.group, max_completion_length=shape.new_tokens,
                        temperature=TEMPERATURE, top_p=1.0, top_k=0, shuffle_dataset=False,  # rlnotes' order
                        beta=GRPO_BETA, epsilon=CLIP_EPS, loss_type="grpo", scale_rewards="group",
                        num_iterations=1, log_completions=False, mask_truncated_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=number_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        result = generate(prompts)
        timers["generate_s"] += time.perf_counter() - start
        timers["prompt_tokens"] += sum(len(ids) for ids in result[0])
        timers["completion_tokens"] += sum(len(ids) for ids in result[1])
        timers["prompts"] += [prompt_key(p) for p in prompts[::shape.group]]  # each prompt comes G times
        return result

    trainer._generate = timed_generate
    return trainer


def dpo_trainer(shape: Shape, common: dict, model, tokenizer, dataset, lora, timers):
    from trl import DPOConfig, DPOTrainer
    from trl.trainer import dpo_trainer as module

    module.use_adapter = timed_context(module.use_adapter, timers, "reference_s")  # the reference pass, adapter off
    config = DPOConfig(**common, per_device_train_batch_size=shape.prompts, gradient_accumulation_steps=1,
                       beta=DPO_BETA, loss_type=["sigmoid"], max_length=shape.max_length,
                       precompute_ref_log_probs=False)
    return DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)


# ---------------------------------------------------------------------------------- the tables


def median_or_none(values: List[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: List[dict], warmup: int) -> Dict[tuple, Dict[str, dict]]:
    """{(model, shape, threads, precision): {tool: medians}} over the measured steps of every successful
    run (steps after `warmup`, not evaluating), pooled over rounds; peak RSS is the median over runs."""
    pooled: Dict[tuple, Dict[str, dict]] = {}
    for run in runs:
        if run["returncode"] != 0:
            continue
        case = pooled.setdefault((run["model"], run["shape"], run["threads"], run["precision"]), {})
        entry = case.setdefault(run["tool"], {"steps": [], "rss": []})
        entry["steps"] += [s for s in run["steps"] if s["step"] > warmup and not s.get("evaluated")]
        entry["rss"].append(run["peak_rss_gib"])
    return {case: {tool: {**{k: median_or_none([s[k] for s in e["steps"]]) for k in COLUMNS},
                          "peak_rss_gib": statistics.median(e["rss"]), "n_steps": len(e["steps"])}
                   for tool, e in tools.items()}
            for case, tools in pooled.items()}


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def ratios(rl: dict, trl: dict) -> Dict[str, Optional[float]]:
    """TRL's cost over rlnotes' (above 1: rlnotes is faster or smaller); seconds per completion
    token is the inverse ratio of tokens per second."""
    return {**{k: ratio(trl[k], rl[k]) for k in ("step_s", "generate_s", "reference_s", "train_s")},
            "s_per_token": ratio(rl["tokens_per_s"], trl["tokens_per_s"]),
            "peak_rss_gib": ratio(trl["peak_rss_gib"], rl["peak_rss_gib"])}


def fmt(value: Optional[float], spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


RATIO_KEYS = ("step_s", "generate_s", "reference_s", "train_s", "s_per_token", "peak_rss_gib")


def ratio_cells(r: Dict[str, Optional[float]]) -> str:
    return " | ".join(fmt(r[k], ".2f") + ("x" if r[k] is not None else "") for k in RATIO_KEYS)


def tables(summary: Dict[tuple, Dict[str, dict]]) -> str:
    """Markdown: the medians of each tool, the ratios TRL / rlnotes and, for cases run in both
    precisions, each tool's fp32 / bf16 ratios."""
    lines = ["| model | shape | threads | precision | tool | steps | step s | generate s | reference s | train s | "
             "completion tokens | completion tok/s | peak RSS GiB |", "|" + "---|" * 13]
    for (model, shape, threads, precision), tools in summary.items():
        for tool in TOOLS:
            if tool in tools:
                m = tools[tool]
                lines.append(f"| {model} | {shape} | {threads} | {precision} | {tool} | {m['n_steps']} | "
                             + " | ".join(fmt(m[k]) for k in COLUMNS[:4])
                             + f" | {fmt(m['completion_tokens'], '.0f')} | {fmt(m['tokens_per_s'], '.1f')} | "
                             f"{m['peak_rss_gib']:.2f} |")
    head = "| step | generate | reference | train | s per completion token | peak RSS |"
    lines += ["", "Ratios TRL / rlnotes (above 1: rlnotes takes less):", "",
              "| model | shape | threads | precision " + head, "|" + "---|" * 10]
    for (model, shape, threads, precision), tools in summary.items():
        cells = ratio_cells(ratios(tools["rlnotes"], tools["trl"])) if set(TOOLS) <= set(tools) else \
            " | ".join(["failed"] * 6)
        lines.append(f"| {model} | {shape} | {threads} | {precision} | {cells} |")
    pairs = [(case, tool) for case in summary if case[3] == "fp32" for tool in TOOLS
             if tool in summary[case] and tool in summary.get((*case[:3], "bf16"), {})]
    if pairs:
        lines += ["", "Ratios fp32 / bf16 of each tool (above 1: bf16 takes less):", "",
                  "| model | shape | threads | tool " + head, "|" + "---|" * 10]
        for case, tool in pairs:
            r = ratios(summary[(*case[:3], "bf16")][tool], summary[case][tool])
            lines.append(f"| {' | '.join(case[:3])} | {tool} | {ratio_cells(r)} |")
    return "\n".join(lines)


def measure_rate(dims: dict, threads: str, precision: str) -> float:
    """The matmul rate (FLOP/s, step_floor.matmul_rate) in a process of its own, with the thread
    count the runs get (OMP_NUM_THREADS; 'default' leaves torch's own)."""
    spec = {"dims": dims, "precision": precision}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "rate", "--spec", "-"],
                          input=json.dumps(spec), capture_output=True, text=True, env=thread_env(threads), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["rate"]


def rate_worker(spec: dict) -> None:
    import torch

    rate, per_shape = step_floor.matmul_rate(spec["dims"], torch.get_num_threads(), spec["precision"])
    print(json.dumps({"rate": rate, "per_shape": per_shape}))


def floor_s(prep: dict, shape_name: str, shape: Shape, medians: dict, rate: float) -> Optional[float]:
    """The floor of a tool's median step (step_floor), from its own completion tokens."""
    if shape.algo == "grpo":
        if medians["completion_tokens"] is None:
            return None
        flops = step_floor.step_flops(prep["dims"], "grpo", shape.prompts, prep["prompt_tokens"][shape_name],
                                      shape.group, medians["completion_tokens"] / (shape.prompts * shape.group),
                                      reference=GRPO_BETA > 0)
    else:
        flops = step_floor.step_flops(prep["dims"], "dpo", shape.prompts, prep["prompt_tokens"][shape_name],
                                      answer_tokens=prep["answer_tokens"][shape_name])
    return flops / rate


def floor_table(summary: Dict[tuple, Dict[str, dict]], preps: Dict[str, dict], shape_table: Dict[str, Shape],
                rates: Dict[tuple, float]) -> str:
    """Markdown: each case's matmul rate, and each tool's median step over its floor (1.00x: every
    second went to the model's matrix products at the rate the machine reached)."""
    lines = ["| model | shape | threads | precision | matmul GFLOP/s | tool | floor s | step s | step / floor |",
             "|" + "---|" * 9]
    for (model, shape, threads, precision), tools in summary.items():
        rate = rates[(model, threads, precision)]
        for tool in TOOLS:
            if tool in tools:
                floor = floor_s(preps[model], shape, shape_table[shape], tools[tool], rate)
                lines.append(f"| {model} | {shape} | {threads} | {precision} | {rate / 1e9:.1f} | {tool} | "
                             f"{fmt(floor)} | {fmt(tools[tool]['step_s'])} | "
                             f"{fmt(ratio(tools[tool]['step_s'], floor), '.2f')}x |")
    return "\n".join(lines)


def load_line(runs: List[dict]) -> str:
    """The 1-minute load average around the runs: other processes on the machine slow every figure."""
    before, after = [r["load_before"] for r in runs], [r["load_after"] for r in runs]
    return (f"1-minute load average: {before[0]:.2f} at the start of the first run, {after[-1]:.2f} at the end of "
            f"the last; {min(before + after):.2f}-{max(before + after):.2f} at the runs' starts and ends")


def prompt_mismatches(preps: Dict[str, dict], runs: List[dict]) -> List[str]:
    """The GRPO cases where TRL did not sample the prompts rlnotes samples: other prompts at a step
    than rlnotes' data sampler draws there, or prompts encoded to another length (every run goes
    through its prompt file once, so the means over the file must agree)."""
    out = []
    for run in runs:
        if run["tool"] != "trl" or run["returncode"] != 0:
            continue
        prep, case = preps[run["model"]], f"{run['model']} {run['shape']}"
        lengths = [s["prompt_tokens"] for s in run["steps"] if s.get("prompt_tokens") is not None]
        ours = prep["prompt_tokens"][run["shape"]]
        if lengths and abs(statistics.mean(lengths) - ours) > 0.01:
            out.append(f"{case}: TRL's prompts have {statistics.mean(lengths):.2f} tokens on average, rlnotes' "
                       f"{ours:.2f}; the two do not run the same work")
        batches = prep["batches"][run["shape"]]
        other = [s["step"] for s in run["steps"] if "prompts" in s and s["prompts"] != batches[s["step"] - 1]]
        if other:
            out.append(f"{case}: at step(s) {', '.join(map(str, other))} TRL sampled other prompts than rlnotes; "
                       "lengths and times of those steps do not compare")
    return out


def environment(argv: List[str], script: str = "scripts/bench_trl.py") -> str:
    """Date, machine, library versions and the command (`script` with `argv`), for the head of a report."""
    cpu, flags = "unknown CPU", set()
    with contextlib.suppress(OSError):
        lines = open("/proc/cpuinfo").read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    cpu += f"; bf16 units: {', '.join(units) if units else 'none'}"
    versions = []
    for name in ("torch", "transformers", "trl", "peft", "accelerate"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    return "\n".join([f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
                      f"machine: {os.cpu_count()} CPUs ({cpu}), python {sys.version.split()[0]}",
                      f"versions: {', '.join(versions)}; rlnotes at {commit}",
                      f"command: {shlex.join(['python', script] + argv)}"])


def case_line(shape_name: str, s: Shape) -> str:
    if s.algo == "dpo":
        return f"{shape_name}: DPO, {s.prompts} pairs per step, beta {DPO_BETA}, max length {s.max_length}"
    prompt = f", prompts of about {s.prompt_tokens} tokens" if s.prompt_tokens else ""
    prompt += f", micro-batches of {s.micro_batch} completions" if s.micro_batch else ""
    return (f"{shape_name}: GRPO, {s.prompts} prompts x G={s.group} x {s.new_tokens} new tokens{prompt}, "
            f"beta {GRPO_BETA}, temperature {TEMPERATURE}")


def run_and_say(args: argparse.Namespace, preps: Dict[str, dict], steps: Dict[str, int], out: Path,
                case: tuple) -> dict:
    """One run of `case` (round, model, shape, threads, precision, tool), and a line saying how it went."""
    r, model, shape, threads, precision, tool = case
    run_dir = out / "runs" / f"{model}-{shape}-t{threads}-{precision}-r{r}-{tool}"
    run = run_one(tool, preps[model], model, shape, args.shape_table[shape], threads, steps[model], run_dir,
                  args.timeout, precision)
    med = median_or_none([s["step_s"] for s in run["steps"] if s["step"] > args.warmup and not s.get("evaluated")])
    print(f"round {r + 1}/{args.rounds} {model} {shape} threads={threads} {precision} {tool}: "
          + (f"step {fmt(med)} s, peak RSS {run['peak_rss_gib']:.2f} GiB, wall {run['wall_s']:.0f} s, load "
             f"{run['load_before']:.2f} -> {run['load_after']:.2f}" if run["returncode"] == 0 else
             f"failed (exit {run['returncode']}), see {run_dir / 'output.log'}"), flush=True)
    return run


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker == "trl":
        trl_worker(json.loads(args.spec.read_text()))
        return
    if args.worker == "rate":
        rate_worker(json.loads(sys.stdin.read()))
        return
    if args.worker == "prepare":
        spec = json.loads(args.spec.read_text())
        shapes = {name: Shape(**shape) for name, shape in spec["shapes"].items()}
        print(json.dumps(prepare(spec["model"], Path(spec["out"]), shapes, spec["steps"], spec["seed"])))
        return
    if importlib.util.find_spec("trl") is None:
        sys.exit('bench_trl: error: TRL is not installed; install the bench extra: pip install -e ".[bench]"')
    out = args.out or Path("outputs/bench_trl") / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    head = environment(argv)
    print(head, flush=True)
    steps = {m: args.steps or DEFAULT_STEPS[m] for m in args.models}
    preps = {}
    for model in args.models:  # in a process of its own: this one stays small while the runs go
        spec = out / f"prepare-{model}.json"
        spec.write_text(json.dumps({"model": model, "out": str(out), "steps": steps[model], "seed": args.seed,
                                    "shapes": {name: asdict(shape) for name, shape in args.shape_table.items()}}))
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "prepare", "--spec", str(spec)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_trl: error: preparing {model} failed:\n{done.stderr[-3000:]}")
        preps[model] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{model}: {preps[model]['model_dir']}; prompt tokens: "
              + ", ".join(f"{k} {v:.0f}" for k, v in preps[model]["prompt_tokens"].items()), flush=True)
    cases = [(m, t, p) for m in args.models for t in args.threads or default_threads(m) for p in args.precisions]
    rates = {case: measure_rate(preps[case[0]]["dims"], *case[1:]) for case in cases}
    print("matmul rates (GFLOP/s): " + ", ".join(f"{m} threads={t} {p} {r / 1e9:.1f}"
                                               for (m, t, p), r in rates.items()), flush=True)
    runs: List[dict] = []
    for r in range(args.rounds):
        for model in args.models:
            for shape in args.shapes:
                for threads in args.threads or default_threads(model):
                    for precision in args.precisions:
                        for tool in TOOLS:
                            case = (r, model, shape, threads, precision, tool)
                            runs.append(run_and_say(args, preps, steps, out, case))
        (out / "bench_trl.json").write_text(json.dumps({"head": head, "warmup": args.warmup, "prepared": preps,
                                                        "runs": runs}, indent=1))
    for line in prompt_mismatches(preps, runs):
        print(f"warning: {line}", flush=True)
    after = {case: measure_rate(preps[case[0]]["dims"], *case[1:]) for case in cases}
    rates_line = ("matmul rate (step_floor) before and after the runs, GFLOP/s: "
                  + ", ".join(f"{m} threads={t} {p} {rates[(m, t, p)] / 1e9:.1f} / {after[(m, t, p)] / 1e9:.1f}"
                              for m, t, p in cases) + "; each floor at the higher")
    rates = {case: max(rates[case], after[case]) for case in cases}
    summary = summarize(runs, args.warmup)
    report = "\n".join([head, "", *[case_line(n, s) for n, s in args.shape_table.items()],
                        f"{args.rounds} round(s) of {', '.join(f'{m} {n}' for m, n in steps.items())} steps per run, "
                        f"the first {args.warmup} of each left out; medians", load_line(runs), rates_line, "",
                        tables(summary), "", "Each step beside its floor (scripts/step_floor.py: its matrix products "
                        "at the matmul rate measured here):", "", floor_table(summary, preps, args.shape_table, rates),
                        ""])
    (out / "bench_trl.md").write_text(report)
    print("\n" + report + f"\nwritten to {out / 'bench_trl.md'} (every step in {out / 'bench_trl.json'})")


if __name__ == "__main__":
    main()
