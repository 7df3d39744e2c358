"""Demonstrations of the calculator tool for a short SFT warm-up before experiment=smollm2_calculator:
`python scripts/calculator_sft_data.py OUT.jsonl` writes the training problems of data=arith
data.digits=3 (never the held-out ones) as (prompt, completion) rows whose prompt is the conversation
the multi-turn rollout renders: the experiment's system prompt with the tools block appended. Half
the rows demonstrate the first turn (the call), half the second (the answer after the tool's result).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from rlnotes.agents.tools import load_tools, tool_schema, tools_system_prompt
from rlnotes.data.tasks import arith

EXPERIMENT = Path(__file__).resolve().parents[1] / "conf" / "experiment" / "smollm2_calculator.yaml"


def main(out: str) -> None:
    data = yaml.safe_load(EXPERIMENT.read_text())["data"]
    system = f"{data['system_prompt']}\n\n{tools_system_prompt([tool_schema(f) for f in load_tools(['calculator'])])}"
    cfg = OmegaConf.create(dict(digits=data["digits"], max_digits=None, ops=data["ops"], train_size=1000,
                                eval_size=None, seed=1234, instruction="Answer with just the number."))
    train, _ = arith(cfg)
    with open(out, "w") as f:
        for i, row in enumerate(train):
            expression = row["prompt"].removeprefix("What is ").split("?")[0]
            call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression
            messages = [{"role": "system", "content": system}, {"role": "user", "content": row["prompt"]}]
            if i % 2:  # the second turn: the call made, its result back, the answer
                messages += [{"role": "assistant", "content": call},
                             {"role": "tool", "name": "calculator", "content": row["answer"]}]
            f.write(json.dumps({"prompt": messages, "completion": row["answer"] if i % 2 else call}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
