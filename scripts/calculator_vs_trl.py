"""The calculator agent (`rlnotes train experiment=smollm2_calculator`) against Hugging Face TRL 1.16's
GRPOTrainer with tools=[calculator], side by side on this machine: what TRL makes of SmolLM2 with tools,
then the recipe on both sides (an SFT warm-up, multi-turn GRPO steps), per-step times (the sampling of
the episodes apart), and the held-out accuracy each reaches, evaluated the same way.

    python scripts/calculator_vs_trl.py                                   # the recipe, 1 round, then accuracy
    python scripts/calculator_vs_trl.py --rounds 2 --no-eval trainer.steps=12   # 8 warm-up + 4 GRPO steps, times

TRL refuses SmolLM2 with tools: its chat template renders neither tools nor tool calls (rlnotes writes
the tools block into the system message itself). The first lines of the report quote what TRL says.
The closest configuration it runs, here: SmolLM2's tokenizer with a chat template of ChatML that
renders the tools, tool calls and tool results in exactly the text rlnotes renders (`tools_chat_template`;
the prompt tokens of every TRL episode and every warm-up row are checked to be rlnotes' own, and the
run stops if one differs), the `{% generation %}` marks TRL's assistant-only loss needs, and TRL's own
response parser of the same `<tool_call>` JSON format (its Qwen3 one).

Both sides take the same model (SmolLM2-135M-Instruct's float32 conversion in ~/.cache/rlnotes),
training and held-out problems, system prompt, tool (rlnotes' built-in calculator, the same function),
LoRA, warm-up (TRL: SFTTrainer on the same conversations, assistant_only_loss), group size, problems per
step, temperature, turns (TRL: max_tool_calling_iterations = max_turns - 1), tokens per turn (TRL:
generation_kwargs max_new_tokens) and per episode (TRL: max_completion_length = max_episode_tokens),
learning rates and schedules, beta, clip range, the notes' GRPO loss (loss_type grpo, scale_rewards
group), AdamW, float32 and threads (scripts/arith_vs_trl.py's settings). Both are evaluated by
`rlnotes evaluate`'s greedy episodes on the 200 held-out problems (TRL's adapter saved and given to
`rlnotes eval eval.policy=...`). What differs: the order of the training rows, and how an episode goes
on after a tool result: rlnotes continues each episode from its KV cache (only the result's tokens are
new), TRL calls generate again on the whole conversation so far.

Rounds alternate (rlnotes, TRL, rlnotes, TRL, ...). Per step: step = the optimizer step's wall time,
sampling = rlnotes' time/generate_s, TRL's `_generate` (every turn, the tool calls, parsing); the rest
is rewards, advantages and the training pass. Training time = the steps from first to last, model
loading and evaluation left out on both sides.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from rlnotes.engine.hardware.openmp import wait_briefly  # no torch: it must act before torch loads

wait_briefly(os.environ)  # OpenMP threads spin briefly, then sleep, as under `rlnotes`; a user's setting wins
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of the two scripts below
import arith_vs_trl as vs  # noqa: E402
import bench_trl  # noqa: E402

EXPERIMENT = "smollm2_calculator"
# SmolLM2-135M-Instruct's system message when a conversation has none (its own chat template's).
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def tools_chat_template(default_system: str = SMOLLM2_SYSTEM) -> str:
    """SmolLM2's chat template (ChatML), with what TRL asks of a template for tools: `tools` rendered
    into the system message as rlnotes writes them there (rlnotes.agents.tools.tools_system_prompt,
    after a blank line: rlnotes.agents.rendering.with_tools), an assistant turn's `tool_calls` as the
    calls the model writes (rendering.assistant_text), tool results as `tool` turns, and the
    assistant's turns (their <|im_end|> included) inside {% generation %} marks."""
    from rlnotes.agents.tools import tools_system_prompt

    marker = "TOOL SCHEMAS"
    head, tail = tools_system_prompt([marker]).split(json.dumps(marker))
    q = json.dumps  # a Jinja string literal: Jinja reads JSON's escapes as Python's
    return (
        "{%- set ns = namespace(block='', text='') -%}"
        "{%- if tools -%}{%- set ns.block = " + q(head) + " -%}"
        "{%- for tool in tools -%}{%- set ns.block = ns.block + ('\\n' if not loop.first else '') + (tool | tojson)"
        " -%}{%- endfor -%}{%- set ns.block = ns.block + " + q(tail) + " -%}{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and message['role'] != 'system' -%}"
        "{{- '<|im_start|>system\\n' + (ns.block if tools else " + q(default_system) + ") + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- set ns.text = message['content'] or '' -%}"
        "{%- for call in (message.tool_calls or []) -%}"
        "{%- set f = call.function if call.function is defined else call -%}"
        "{%- set ns.text = ns.text + ('\\n' if ns.text else '') + '<tool_call>\\n'"
        " + ({'name': f.name, 'arguments': f.arguments} | tojson) + '\\n</tool_call>' -%}"
        "{%- endfor -%}"
        "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}{{- ns.text + '<|im_end|>' -}}{%- endgeneration -%}"
        "{{- '\\n' -}}"
        "{%- else -%}"
        "{%- set content = message['content'] -%}"
        "{%- if loop.first and message['role'] == 'system' and tools -%}"
        "{%- set content = content + '\\n\\n' + ns.block -%}{%- endif -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


# ---------------------------------------------------------------------------------------------
# TRL's side (a worker process of this script)


def refusals(spec: dict, tools: list) -> List[str]:
    """What TRL's GRPOTrainer says, with tools, to SmolLM2's own chat template, then to one that renders
    tool calls (tools_chat_template) but with no response parser set: one line each ("" where it ran)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlnotes.rewards import number_match

    lines = []
    for template in (None, tools_chat_template()):
        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
        if template is not None:
            tokenizer.chat_template = template
        config = GRPOConfig(output_dir=spec["tmp"], max_steps=1, per_device_train_batch_size=spec["group"],
                            num_generations=spec["group"], use_cpu=True, report_to="none")
        rows = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}] * 4)
        try:
            GRPOTrainer(model=spec["model_dir"], reward_funcs=number_match, args=config, train_dataset=rows,
                        processing_class=tokenizer, tools=tools)
            lines.append("")
        except Exception as e:  # noqa: BLE001 - what TRL raises is the finding
            lines.append(f"{type(e).__name__}: {e}")
    return lines


class PromptCheck:
    """Each prompt TRL samples from, against rlnotes' token ids of the same question (its Renderer on
    SmolLM2's own template, the tools block in the system message); a mismatch stops the run."""

    def __init__(self, spec: dict, schemas: List[dict]):
        from transformers import AutoTokenizer

        from rlnotes.agents.rendering import Renderer

        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
        self.renderer, self.system, self.seen = Renderer.of(tokenizer, True, schemas), spec["system_prompt"], 0

    def ids(self, question: str) -> List[int]:
        from rlnotes.engine.prompts import as_messages

        return self.renderer.prompt_ids(self.renderer.prompt_messages(as_messages(question, self.system)))

    def check(self, prompts: List[list], prompt_ids: List[List[int]]) -> None:
        for prompt, ids in zip(prompts, prompt_ids):
            if list(ids) != self.ids(prompt[-1]["content"]):
                raise SystemExit(f"calculator_vs_trl: error: TRL's prompt of {prompt[-1]['content']!r} is not "
                                 "rlnotes' token for token; the two would not run the same work")
            self.seen += 1

    def check_demos(self, dataset, conversations: List[list]) -> int:
        """TRL's tokenized warm-up rows (input ids; labels: the id where the loss is, -100 elsewhere)
        against rlnotes' (conversation_tokens; TRL's rows end with the template's newline, no loss)."""
        from rlnotes.agents.rendering import conversation_tokens

        for row, messages in zip(dataset, conversations):
            prompt, ids, mask = conversation_tokens(self.renderer, messages, self.system)
            n = len(prompt) + len(ids)
            labels = [-100] * len(prompt) + [i if m else -100 for i, m in zip(ids, mask)]
            if row["input_ids"][:n] != prompt + ids or row["labels"][:n] != labels or \
                    any(x != -100 for x in row["labels"][n:]):
                raise SystemExit("calculator_vs_trl: error: TRL's warm-up tokens of a demonstration are not "
                                 "rlnotes'; the two would not learn the same thing")
        return len(conversations)


def timed_sampling(trainer, timers: Dict[str, float], check: PromptCheck) -> None:
    """Time TRL's sampling: `_generate` (every turn, the tool calls, parsing) and, inside it, each
    call of the model's generate (`_generate_single_turn`: the rows it continues and the tokens it
    is given, each time the whole conversation so far); count the model's and the tools' tokens."""
    generate, single = trainer._generate, trainer._generate_single_turn

    def timed_generate(prompts):
        start = time.perf_counter()
        result = generate(prompts)
        timers["generate_s"] += time.perf_counter() - start
        check.check(prompts, result[0])
        masks = result[2]
        timers["model_tokens"] += sum(sum(m) for m in masks) / len(masks)
        timers["env_tokens"] += sum(len(m) - sum(m) for m in masks) / len(masks)
        timers["episodes"] += len(masks)
        return result

    def timed_single(prompt_ids, *args, **kwargs):
        start = time.perf_counter()
        result = single(prompt_ids, *args, **kwargs)
        seconds = time.perf_counter() - start
        timers["model_generate_s"] += seconds
        timers["calls"].append({"s": seconds, "rows": len(prompt_ids), "tokens": sum(len(ids) for ids in prompt_ids)})
        timers["generate_calls"] += 1
        timers["turns"] += len(prompt_ids)
        timers["prefilled_tokens"] += sum(len(ids) for ids in prompt_ids)
        return result

    trainer._generate, trainer._generate_single_turn = timed_generate, timed_single


def step_timer(timers: Dict[str, float], rows: List[dict], stage: str):
    """A TrainerCallback that appends each step's wall time and the `timers` gathered in it to `rows`."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timers.clear()
            timers.update(dict.fromkeys(("generate_s", "model_generate_s", "generate_calls", "turns",
                                         "prefilled_tokens", "model_tokens", "env_tokens", "episodes"), 0.0), calls=[])
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            row = {"stage": stage, "step_s": time.perf_counter() - self.start, **timers}
            if row["episodes"]:
                row["turns"] /= row["episodes"]
            rows.append(row)

    return Steps()


def trl_worker(spec: dict) -> None:
    """TRL's refusals, then the recipe in the closest configuration: SFTTrainer for the warm-up steps,
    GRPOTrainer with tools for the rest, on the same adapter; its steps and checks to spec["out"]."""
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trl.chat_template_utils import qwen3_template

    from rlnotes.agents.tools import load_tools, tool_schema
    from rlnotes.engine.prompts import as_messages
    from rlnotes.rewards import number_match

    tools = load_tools(spec["tools"])
    schemas = [tool_schema(fn) for fn in tools]
    with tempfile.TemporaryDirectory() as tmp:
        said = refusals({**spec, "tmp": tmp}, tools)
        model, tokenizer = vs.load_model(spec)
        tokenizer.chat_template = tools_chat_template()
        tokenizer.response_template = qwen3_template  # TRL's parser of <tool_call>{JSON}</tool_call> after ChatML
        check, rows, timers, common, clock = PromptCheck(spec, schemas), [], {}, vs.training_args(spec), 0.0
        system = [{"role": "system", "content": spec["system_prompt"]}]
        policy, peft_config, warm, demos = model, vs.lora_config(), spec["warmup_steps"], 0
        if warm:
            conversations = [r["messages"] for r in spec["train"]]
            dataset = Dataset.from_list([{"messages": as_messages(c, spec["system_prompt"]),
                                          "tools": json.dumps(schemas)} for c in conversations])
            sft = SFTTrainer(model=model, args=SFTConfig(output_dir=tmp, max_steps=warm, learning_rate=spec["warmup_lr"],
                                                         per_device_train_batch_size=spec["warmup_batch"],
                                                         assistant_only_loss=True, **common),
                             train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
            demos = check.check_demos(sft.train_dataset, conversations)
            sft.add_callback(step_timer(timers, rows, "warm-up"))
            start = time.perf_counter()
            sft.train()
            clock += time.perf_counter() - start
            policy, peft_config = sft.model, None  # GRPO trains the same adapter on
        n = spec["prompts"] * spec["group"]
        config = GRPOConfig(output_dir=tmp, max_steps=spec["steps"] - warm, learning_rate=spec["lr"],
                            per_device_train_batch_size=n, gradient_accumulation_steps=1,
                            num_generations=spec["group"], max_completion_length=spec["max_episode_tokens"],
                            generation_kwargs={"max_new_tokens": spec["max_new_tokens"]},
                            max_tool_calling_iterations=spec["max_turns"] - 1,
                            temperature=spec["temperature"], top_p=1.0, top_k=0, beta=spec["beta"],
                            epsilon=spec["clip_eps"], loss_type="grpo", scale_rewards="group", num_iterations=1,
                            log_completions=False, mask_truncated_completions=False, **common)
        train = [{"prompt": system + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                 for r in spec["train"]]
        grpo = GRPOTrainer(model=policy, reward_funcs=number_match, args=config, train_dataset=Dataset.from_list(train),
                           processing_class=tokenizer, peft_config=peft_config, tools=tools)
        timed_sampling(grpo, timers, check)
        grpo.add_callback(step_timer(timers, rows, "GRPO"))
        start = time.perf_counter()
        grpo.train()
        clock += time.perf_counter() - start
        if spec.get("adapter"):
            grpo.model.save_pretrained(spec["adapter"])
    Path(spec["out"]).write_text(json.dumps({"refusals": said, "steps": rows, "train_s": clock,
                                             "prompts_checked": check.seen, "demos_checked": demos}))


# ---------------------------------------------------------------------------------------------
# the runs, side by side


def run_process(cmd: List[str], log: Path) -> dict:
    """`cmd` in a process of its own, its output to `log`: exit code, peak RSS, wall time, and the
    1-minute load average before and after it."""
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        code, rss = bench_trl.wait_rusage(proc, None)
    return {"returncode": code, "peak_rss_gib": rss, "wall_s": time.perf_counter() - start,
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def rlnotes_steps(run_dir: Path) -> List[dict]:
    """Each step of an rlnotes run as the TRL worker writes its own: stage, step and sampling seconds,
    turns and tokens per episode (the model's, the observations')."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "time/step_s" not in r:
            continue
        rows.append({"stage": "warm-up" if "sft_warmup/loss" in r else "GRPO", "step_s": r["time/step_s"],
                     "generate_s": r.get("time/generate_s", 0.0), "turns": r.get("episode/turns"),
                     "model_tokens": r.get("episode/model_tokens"), "env_tokens": r.get("episode/env_tokens")})
    return rows


def rlnotes_side(spec: dict, args: argparse.Namespace, r: int) -> dict:
    run_dir = args.out / f"rlnotes-r{r}"
    overrides = args.overrides + ([] if args.eval else ["trainer.eval_every=null"])
    run = run_process(vs.rlnotes_command(spec["seed"], overrides, run_dir, EXPERIMENT), args.out / f"rlnotes-r{r}.log")
    if run["returncode"] == 0:
        curve = vs.rlnotes_curve(run_dir)
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        run.update(steps=rlnotes_steps(run_dir), accuracy=curve[-1]["accuracy"] if curve else None,
                   train_s=curve[-1]["train_s"] if curve else last["time/elapsed_s"])
    return run


def trl_side(spec: dict, args: argparse.Namespace, r: int) -> dict:
    """TRL's worker, then (with --eval) `rlnotes eval` of the adapter it saved: the evaluation rlnotes'
    own run makes at its end, on the same held-out problems."""
    adapter = args.out / f"trl-r{r}-adapter"
    spec = {**spec, "out": str(args.out / f"trl-r{r}.json"), "adapter": str(adapter) if args.eval else None}
    spec_path = args.out / f"trl-r{r}.spec.json"
    spec_path.write_text(json.dumps(spec))
    run = run_process([sys.executable, os.path.abspath(__file__), "--worker", str(spec_path)],
                      args.out / f"trl-r{r}.log")
    if run["returncode"] != 0:
        return run
    run.update(json.loads(Path(spec["out"]).read_text()))
    if args.eval:
        evaluated = args.out / f"trl-r{r}-eval"
        cmd = [sys.executable, "-m", "rlnotes", "eval", f"experiment={EXPERIMENT}", f"seed={spec['seed']}",
               f"eval.policy={adapter}", f"eval.out={evaluated}", *args.overrides]
        done = run_process(cmd, args.out / f"trl-r{r}-eval.log")
        run["accuracy"] = json.loads((evaluated / "eval.jsonl").read_text())["eval/accuracy"] \
            if done["returncode"] == 0 else None
    return run


def median(runs: List[dict], stage: str, key: str) -> Optional[float]:
    values = [s[key] for run in runs if run["returncode"] == 0 for s in run["steps"]
              if s["stage"] == stage and s.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(value: Optional[float], spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def report(runs: Dict[str, List[dict]]) -> str:
    """The medians of each tool's steps over all rounds, their ratios TRL / rlnotes, training time,
    held-out accuracy, peak RSS and the load around each run."""
    rl, trl = runs["rlnotes"], runs["trl"]
    for run in rl + trl:
        for s in run.get("steps", []):
            s["rest_s"] = s["step_s"] - s["generate_s"] if s["stage"] == "GRPO" else None
    lines = ["| per step (medians over all rounds) | rlnotes | TRL 1.16 | TRL / rlnotes |", "|---|---|---|---|"]
    for label, stage, key in (("warm-up step, s", "warm-up", "step_s"), ("GRPO step, s", "GRPO", "step_s"),
                              ("sampling the 16 episodes, s", "GRPO", "generate_s"),
                              ("the rest of the GRPO step (rewards, training pass), s", "GRPO", "rest_s"),
                              ("turns per episode", "GRPO", "turns"), ("model tokens per episode", "GRPO", "model_tokens"),
                              ("tool-result tokens per episode", "GRPO", "env_tokens")):
        a, b = median(rl, stage, key), median(trl, stage, key)
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(b / a if a and b else None, '.2f')} |")
    lines.append(f"| TRL: calls of generate per step, tokens given to them | | {fmt(median(trl, 'GRPO', 'generate_calls'))}, "
                 f"{fmt(median(trl, 'GRPO', 'prefilled_tokens'), '.0f')} | |")
    calls = [c for run in trl if run["returncode"] == 0 for s in run["steps"] for c in enumerate(s.get("calls", []))]
    for label, later in (("TRL: its first call of generate (the prompts): s, rows, tokens given", False),
                         ("TRL: a later call (the conversations so far, again): s, rows, tokens given", True)):
        picked = [c for i, c in calls if (i > 0) == later]
        if picked:
            lines.append(f"| {label} | | " + ", ".join(fmt(statistics.median(c[k] for c in picked), ".3g")
                                                      for k in ("s", "rows", "tokens")) + " | |")
    lines += ["", "| round | tool | training time, min | held-out accuracy | peak RSS, GiB | load average before -> after |",
              "|---|---|---|---|---|---|"]
    for r, (a, b) in enumerate(zip(rl, trl)):
        for name, run in (("rlnotes", a), ("TRL 1.16", b)):
            if run["returncode"] != 0:
                lines.append(f"| {r + 1} | {name} | failed (exit {run['returncode']}) | | | |")
                continue
            acc = run.get("accuracy")
            lines.append(f"| {r + 1} | {name} | {run['train_s'] / 60:.2f} | {'-' if acc is None else f'{acc:.1%}'} | "
                         f"{run['peak_rss_gib']:.2f} | {run['load_before']:.2f} -> {run['load_after']:.2f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="rounds of (rlnotes, TRL), alternating (default 1)")
    p.add_argument("--no-eval", dest="eval", action="store_false",
                   help="no held-out evaluation: step times only (rlnotes with trainer.eval_every=null)")
    p.add_argument("--out", type=Path, default=Path("runs/calculator-vs-trl"))
    p.add_argument("overrides", nargs="*", help="overrides of the experiment, given to both sides")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return trl_worker(json.loads(Path(args.worker).read_text()))
    if importlib.util.find_spec("trl") is None:
        raise SystemExit('calculator_vs_trl.py needs TRL 1.16 (pip extra bench): pip install -e ".[bench]"')
    cfg, train, test = vs.recipe(args.seed, args.overrides, EXPERIMENT)
    ro = cfg.rollout
    spec = {**vs.recipe_spec(cfg, args.seed, train, test), "tools": list(ro.tools), "max_turns": ro.max_turns,
            "max_episode_tokens": ro.max_episode_tokens or 2048}  # unbounded: SmolLM2's context
    args.out.mkdir(parents=True, exist_ok=True)
    head = bench_trl.environment(argv, "scripts/calculator_vs_trl.py")
    print(head, flush=True)
    runs: Dict[str, List[dict]] = {"rlnotes": [], "trl": []}
    for r in range(args.rounds):
        for tool, side in (("rlnotes", rlnotes_side), ("trl", trl_side)):
            run = side(spec, args, r)
            runs[tool].append(run)
            print(f"round {r + 1}/{args.rounds} {tool}: exit {run['returncode']}, wall {run['wall_s']:.0f} s, load "
                  f"{run['load_before']:.2f} -> {run['load_after']:.2f}", flush=True)
        (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    said = next((run["refusals"] for run in runs["trl"] if "refusals" in run), ["(the TRL worker failed)"] * 2)
    checked = next((run for run in runs["trl"] if "prompts_checked" in run), {})
    text = "\n".join([head, "",
                      f"TRL with SmolLM2's own chat template and tools=[calculator]: {said[0] or 'it ran'}",
                      f"TRL with a template that renders tools and tool calls, no response parser: {said[1] or 'it ran'}",
                      f"closest configuration: that template and TRL's Qwen3 response parser; TRL's prompts checked "
                      f"against rlnotes': {checked.get('prompts_checked', 0)} episodes' and "
                      f"{checked.get('demos_checked', 0)} demonstrations', token for token, all equal",
                      "", report(runs), ""])
    (args.out / "report.md").write_text(text)
    print("\n" + text + f"\nwritten to {args.out / 'report.md'} (every step in {args.out / 'runs.json'})")


if __name__ == "__main__":
    main()
