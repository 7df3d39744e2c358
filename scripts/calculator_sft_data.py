"""Demonstrations of the calculator tool for a short SFT warm-up before experiment=smollm2_calculator:
`python scripts/calculator_sft_data.py OUT.jsonl [OVERRIDES...]` writes the training problems of the
experiment's task (data=arith data.digits=3, never the held-out ones) as (prompt, completion) rows
whose prompt is the conversation the multi-turn rollout renders: the experiment's system prompt with
the tools block appended. Half the rows demonstrate the first turn (the call), half the second (the
answer after the tool's result).

The settings are the experiment's as `rlnotes train experiment=smollm2_calculator` composes and
checks them (every key of the data schema, its defaults included), so a key added to the schema is
never missing here; overrides after OUT.jsonl change them as on that command line (data.train_size=16).
"""

from __future__ import annotations

import json
import sys
from typing import List

from rlnotes.agents.tools import load_tools, tool_schema, tools_system_prompt
from rlnotes.commands.check import check
from rlnotes.commands.usage import UsageError
from rlnotes.data.settings import system_prompt
from rlnotes.data.tasks import arith

EXPERIMENT = "experiment=smollm2_calculator"


def main(argv: List[str]) -> int:
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(f"usage: python scripts/calculator_sft_data.py OUT.jsonl [OVERRIDES...]\n\n{__doc__}", file=sys.stderr)
        return 2
    out, overrides = argv[0], argv[1:]
    try:
        cfg = check([EXPERIMENT, *overrides], multirun=False, config_dir=None)[0]
    except UsageError as e:
        print(f"calculator_sft_data.py: error: {e}", file=sys.stderr)
        return 2
    if cfg.data.name != "arith":  # the calls below are read off arith's "What is A+B?" prompts
        print(f"calculator_sft_data.py: error: data={cfg.data.name}: the demonstrations are of arith problems",
              file=sys.stderr)
        return 2
    tools = [tool_schema(f) for f in load_tools(list(cfg.rollout.tools))]
    system = f"{system_prompt(cfg)}\n\n{tools_system_prompt(tools)}"
    train, _ = arith(cfg.data)
    with open(out, "w") as f:
        for i, row in enumerate(train):
            expression = row["prompt"].removeprefix("What is ").split("?")[0]
            call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression
            messages = [{"role": "system", "content": system}, {"role": "user", "content": row["prompt"]}]
            if i % 2:  # the second turn: the call made, its result back, the answer
                messages += [{"role": "assistant", "content": call},
                             {"role": "tool", "name": "calculator", "content": row["answer"]}]
            f.write(json.dumps({"prompt": messages, "completion": row["answer"] if i % 2 else call}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
