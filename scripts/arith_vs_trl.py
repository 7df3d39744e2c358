"""Time to accuracy against Hugging Face TRL 1.16 on the SmolLM2 arithmetic recipe
(`rlnotes train experiment=smollm2_arith`): wall time to 50% and 67% held-out two-digit accuracy,
and the final accuracy, of each tool on the same problems, one after the other on this machine.

    python scripts/arith_vs_trl.py --seed 0                        # runs rlnotes, then TRL
    python scripts/arith_vs_trl.py --seed 0 --rlnotes-run runs/arith-0   # an rlnotes run already made

Both sides take the same model (SmolLM2-135M-Instruct's float32 conversion in ~/.cache/rlnotes),
the same training problems and held-out test problems (the experiment's, from rlnotes' own data
code), the same chat prompt (the experiment's system prompt), LoRA (r16 on q/k/v/o, alpha 32), the
recipe's SFT warm-up (TRL: its SFTTrainer on the same demonstrations, prompt-completion, loss on the
completion only, then its GRPOTrainer on the same adapter), group size, prompts per step,
temperature, completion length, learning rates and their schedule (each stage its own, as rlnotes'
optim.schedule shapes the warm-up and the steps after it apart), beta, clip range, the notes' GRPO loss (TRL: loss_type
grpo, scale_rewards group), AdamW, precision (the experiment's hardware.precision as rlnotes resolves
it on this machine: bf16 is TRL's bf16=True), threads. What differs: the order the training rows come
in (each tool shuffles its own way) and TRL's own evaluation (greedy, HF generate, batches of 100).

The clock counts training only: from the first step to the last, less the time spent evaluating
(rlnotes logs time/eval_s; here TRL's evaluations are timed and taken off), model loading before it
excluded on both sides. Evaluations happen every trainer.eval_every steps of the run, counted from its
first step, warm-up steps included, on the experiment's 200 held-out test problems.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins

LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
BARS = (0.5, 0.67)
SMOLLM2_PARAMETERS = 134_515_008  # what hardware.threads=auto and precision=auto read of the model


def recipe(seed: int, overrides: List[str], experiment: str = "smollm2_arith"):
    """The experiment's config (rlnotes' own composition) and its train and test rows."""
    from rlnotes.commands.check import check
    from rlnotes.data.datasets import load_task
    from rlnotes.training.evaluation import eval_data

    cfg = check([f"experiment={experiment}", f"seed={seed}", *overrides], False, None)[0]
    train, _ = load_task(cfg.data)
    _, test = load_task(eval_data(cfg))
    return cfg, train, test


def rlnotes_command(seed: int, overrides: List[str], run_dir: Path, experiment: str = "smollm2_arith") -> List[str]:
    return [sys.executable, "-m", "rlnotes", "train", f"experiment={experiment}", f"seed={seed}",
            f"hydra.run.dir={run_dir}", "logging.progress=false", *overrides]


def run_rlnotes(seed: int, overrides: List[str], run_dir: Path) -> None:
    cmd = rlnotes_command(seed, overrides, run_dir)
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def rlnotes_curve(run_dir: Path) -> List[Dict[str, float]]:
    """(step, training seconds, accuracy) at each evaluation of an rlnotes run."""
    curve, eval_s = [], 0.0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        eval_s += row.get("time/eval_s", 0.0)
        if "eval/accuracy" in row:
            curve.append({"step": row["step"], "train_s": row["time/elapsed_s"] - eval_s,
                          "accuracy": row["eval/accuracy"]})
    return curve


def trl_worker(spec: dict) -> None:
    """SFTTrainer for the warm-up steps, then GRPOTrainer, evaluating every eval_every steps."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    from rlnotes.rewards import number_match

    model, tokenizer = load_model(spec)
    system = [{"role": "system", "content": spec["system_prompt"]}]
    as_prompt = lambda text: system + [{"role": "user", "content": text}]  # noqa: E731
    column = spec["warmup_column"]  # the warm-up's demonstrations: the bare number, or the sum worked out
    train = [{"prompt": as_prompt(r["prompt"]), "answer": r["answer"], "shown": r[column]} for r in spec["train"]]
    test = [{"prompt": as_prompt(r["prompt"]), "answer": r["answer"]} for r in spec["test"]]
    lora = lora_config()
    curve: List[Dict[str, float]] = []
    clock = {"train_s": 0.0, "since": None}

    @torch.no_grad()
    def accuracy(policy) -> float:
        policy.eval()
        right = []
        for i in range(0, len(test), 100):
            rows = test[i:i + 100]
            texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                     for r in rows]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = policy.generate(**batch, max_new_tokens=spec["max_new_tokens"], do_sample=False,
                                  pad_token_id=tokenizer.pad_token_id)
            replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            right += number_match(None, replies, [r["answer"] for r in rows])
        policy.train()
        return sum(right) / len(right)

    def evaluate(policy, step: int) -> None:
        if clock["since"] is not None:
            clock["train_s"] += time.perf_counter() - clock["since"]
        curve.append({"step": step, "train_s": clock["train_s"], "accuracy": accuracy(policy)})
        print(json.dumps(curve[-1]), flush=True)
        clock["since"] = time.perf_counter()

    class Evaluations(TrainerCallback):
        def __init__(self, offset: int):
            self.offset = offset

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = self.offset + state.global_step
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                evaluate(model, step)

    common = training_args(spec)
    warm = spec["warmup_steps"]
    with tempfile.TemporaryDirectory() as tmp:
        evaluate(model, 0)
        policy, peft_config = model, lora
        if warm:
            demos = Dataset.from_list([{"prompt": r["prompt"], "completion": [{"role": "assistant",
                                                                               "content": r["shown"]}]}
                                       for r in train])
            sft = SFTTrainer(model=model, args=SFTConfig(output_dir=tmp, max_steps=warm, learning_rate=spec["warmup_lr"],
                                                         per_device_train_batch_size=spec["warmup_batch"],
                                                         completion_only_loss=True, **common),
                             train_dataset=demos, processing_class=tokenizer, peft_config=lora)
            sft.add_callback(Evaluations(0))
            clock["since"] = time.perf_counter()
            sft.train()
            clock["train_s"] += time.perf_counter() - clock["since"]  # the steps after the last evaluation
            policy, peft_config = sft.model, None  # GRPO trains the same adapter on
        n = spec["prompts"] * spec["group"]
        config = GRPOConfig(output_dir=tmp, max_steps=spec["steps"] - warm, learning_rate=spec["lr"],
                            per_device_train_batch_size=n, gradient_accumulation_steps=1,
                            num_generations=spec["group"], max_completion_length=spec["max_new_tokens"],
                            temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec["beta"],
                            epsilon=spec["clip_eps"], loss_type="grpo", scale_rewards="group", num_iterations=1,
                            log_completions=False, mask_truncated_completions=False, **common)
        grpo = GRPOTrainer(model=policy, reward_funcs=number_match, args=config,
                           train_dataset=Dataset.from_list(train), processing_class=tokenizer,
                           peft_config=peft_config)
        grpo.add_callback(Evaluations(warm))
        clock["since"] = time.perf_counter()
        grpo.train()
    Path(spec["out"]).write_text(json.dumps(curve))


def load_model(spec: dict):
    """(float32 model, tokenizer padding on the left) from spec["model_dir"], on spec["threads"] threads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec["threads"]:  # 0: torch's default, as rlnotes' hardware.threads=auto takes for this model
        torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, local_files_only=True)
    return model, tokenizer


def lora_config():
    """rlnotes' LoRA (model.lora of the experiments) as peft's LoraConfig."""
    from peft import LoraConfig

    return LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")


def training_args(spec: dict) -> dict:
    """The TrainingArguments both TRL trainers share: rlnotes' AdamW, clipping and schedule, its
    precision on the CPU, no gradient checkpointing, evaluation or saving, a log row every step."""
    return dict(optim="adamw_torch", lr_scheduler_type=spec["schedule"], warmup_steps=0, weight_decay=0.0,
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                gradient_checkpointing=False, bf16=spec["precision"] == "bf16", fp16=False, use_cpu=True, logging_steps=1,
                save_strategy="no", eval_strategy="no", report_to="none", seed=spec["seed"], disable_tqdm=True,
                dataloader_num_workers=0)


def recipe_spec(cfg, seed: int, train: List[dict], test: List[dict]) -> dict:
    """What TRL's side takes from an experiment's config: the model dir, prompt, threads, shapes,
    sampling, loss and learning-rate settings, the warm-up's, and the rows."""
    import torch

    from rlnotes.data.settings import system_prompt
    from rlnotes.engine.hardware.devices import choose_precision
    from rlnotes.engine.hardware.threads import auto_threads
    from rlnotes.engine.model.loading import smollm2_dir

    a, threads = cfg.algo, cfg.hardware.threads
    threads = auto_threads(SMOLLM2_PARAMETERS) if threads == "auto" else threads or 0
    return {"model_dir": str(smollm2_dir()), "system_prompt": system_prompt(cfg), "seed": seed,
            "train": train, "test": test, "threads": threads,
            "steps": cfg.trainer.steps, "eval_every": cfg.trainer.eval_every, "prompts": cfg.trainer.batch_size,
            "group": a.group_size, "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature, "beta": a.beta, "clip_eps": a.clip_eps, "lr": cfg.optim.lr,
            "schedule": cfg.optim.schedule,
            "warmup_steps": cfg.sft_warmup.steps, "warmup_lr": cfg.sft_warmup.lr,
            "warmup_batch": cfg.sft_warmup.batch_size, "warmup_column": cfg.sft_warmup.column,
            "precision": choose_precision(cfg.hardware.precision, torch.device("cpu"), SMOLLM2_PARAMETERS)[0]}


def time_to(curve: List[Dict[str, float]], bar: float) -> Optional[float]:
    return next((p["train_s"] for p in curve if p["accuracy"] >= bar), None)


def table(curves: Dict[str, List[Dict[str, float]]]) -> str:
    fmt = lambda s: "not reached" if s is None else f"{s / 60:.1f} min"  # noqa: E731
    lines = ["| | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves)]
    for bar in BARS:
        lines.append(f"| training time to {bar:.0%} | " + " | ".join(fmt(time_to(c, bar)) for c in curves.values())
                     + " |")
    lines.append("| final accuracy | " + " | ".join(f"{c[-1]['accuracy']:.1%}" for c in curves.values()) + " |")
    lines.append("| training time in all | " + " | ".join(fmt(c[-1]["train_s"]) for c in curves.values()) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rlnotes-run", type=Path, help="an rlnotes run of the experiment already made (its metrics)")
    p.add_argument("--out", type=Path, default=Path("runs/arith-vs-trl"))
    p.add_argument("overrides", nargs="*", help="overrides of the experiment, given to both sides")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return trl_worker(json.loads(Path(args.worker).read_text()))
    if importlib.util.find_spec("trl") is None:  # before the rlnotes run, which takes an hour
        raise SystemExit('arith_vs_trl.py needs TRL 1.16 (pip extra bench): pip install -e ".[bench]"')
    cfg, train, test = recipe(args.seed, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.rlnotes_run or args.out / f"rlnotes-{args.seed}"
    if args.rlnotes_run is None:
        run_rlnotes(args.seed, args.overrides, run_dir)
    spec = {**recipe_spec(cfg, args.seed, train, test), "out": str(args.out / f"trl-{args.seed}.json")}
    spec_path = args.out / f"trl-{args.seed}.spec.json"
    spec_path.write_text(json.dumps(spec))
    print("$ TRL: SFTTrainer then GRPOTrainer (worker)", flush=True)
    subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], check=True)
    curves = {"rlnotes": rlnotes_curve(run_dir), "TRL 1.16": json.loads(Path(spec["out"]).read_text())}
    (args.out / f"curves-{args.seed}.json").write_text(json.dumps(curves, indent=1))
    print(table(curves))


if __name__ == "__main__":
    main()
