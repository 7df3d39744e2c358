"""Every command of README.md and docs/*.md runs, as a reader would run it.

The test reads the fenced blocks of those files itself, so a command added to them is picked up
and a command it does not know how to run fails it (nothing untested gets in silently):

- ```bash blocks: each line is a command (`\\` continues a line; a `# comment` is dropped; leading
  `VAR=value` words are its environment);
- ```text blocks: a line after a `$ ` prompt is a command, the lines up to the next prompt its
  documented output, which must appear in what the command prints (run exactly as written);
- ```python blocks whose first line is a comment naming a file (`# rewards.py, ...`) are that
  file, written where the commands of the same document run; other python blocks run as code;
- ```yaml blocks are files the prose around them names, with the command that uses them
  (YAML_FILES).

Each command runs in a fresh directory laid out like a checkout's root (docs/ exists), holding the
document's own files and the data files the docs name without showing (USER_FILES). Commands of a
block that read what an earlier one writes (a run dir, an export, a data file) run together, in
order, in one directory; placeholders (RUN_DIR, RUN_A, SWEEP_DIR, outputs/DATE/TIME-rm, my-model,
...) that no earlier command made are real dirs made once per test run by short runs (PLACEHOLDERS).

`rlnotes ...` runs in this process through rlnotes.commands.cli.main (a subprocess costs 8 s of
imports), shrunk to seconds by `shrunk` (one step, a tiny stand-in for SmolLM2, 8 eval prompts,
one member a sweep); `python scripts/X.py ...` runs in this process too. What cannot run here, or
would start processes, or only sets values the default run already runs with, is checked another
way (composed and validated as `rlnotes train` does first, for most), each with its reason, in
EXCEPTIONS; a command that fails today is in KNOWN_FAILURES. Slow-marked variants
(test_documented_command_runs_as_written) run the SmolLM2 commands as written, without shrinking,
and those the exceptions compose for time through the console script.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))


# ---------------------------------------------------------------------------------------------
# Reading the documents


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence
    lang: str
    text: str


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as documented: continuation lines joined, the trailing comment dropped
    argv: Tuple[str, ...]
    env: Tuple[Tuple[str, str], ...] = ()
    expected: Tuple[str, ...] = ()  # the documented output of a `$ ` command
    kind: str = "shell"  # shell | python (a code block) | yaml (YAML_FILES)
    code: str = ""  # a python block's source

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL = ("bash", "sh", "shell", "console")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# A python block that is a file: its first line is a comment naming it ("# rewards.py, in the ...").
FILE_COMMENT = re.compile(r"^#\s*([\w./-]+\.py)\b")


def blocks(text: str, doc: str) -> List[Block]:
    return [Block(doc, text[:m.start()].count("\n") + 1, m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]


def shell_commands(block: Block) -> List[Command]:
    """The commands of a ```bash block (or the `$ ` lines of a ```text block, with their output)."""
    commands: List[Command] = []
    lines = block.text.split("\n")
    i = 0
    while i < len(lines):
        start, line = i, lines[i]
        i += 1
        if block.lang == "text":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        words = shlex.split(line, comments=True)
        if not words:
            continue  # blank, or a comment alone
        env = []
        while words and ENV_WORD.match(words[0]):
            env.append(tuple(words.pop(0).split("=", 1)))
        expected: List[str] = []
        if block.lang == "text":
            while i < len(lines) and not lines[i].startswith("$ "):
                if lines[i].strip():
                    expected.append(lines[i])
                i += 1
        text = " ".join(shlex.quote(w) for w in [*(f"{k}={v}" for k, v in env), *words])
        commands.append(Command(block.doc, block.line + 1 + start, text, tuple(words), tuple(env), tuple(expected)))
    return commands


def user_files(doc_blocks: Sequence[Block]) -> Dict[str, str]:
    """The files a document's python blocks define: {name: source}."""
    files = {}
    for b in doc_blocks:
        m = FILE_COMMENT.match(b.text) if b.lang == "python" else None
        if m:
            files[m.group(1)] = b.text
    return files


def block_commands(b: Block) -> List[Command]:
    if b.lang in SHELL or b.lang == "text":
        return shell_commands(b)
    if b.lang == "python" and not FILE_COMMENT.match(b.text):
        first = b.text.strip().splitlines()[0]
        return [Command(b.doc, b.line, first, (), kind="python", code=b.text)]
    if b.lang == "yaml":
        first = b.text.strip().splitlines()[0]
        return [Command(b.doc, b.line, first, (), kind="yaml", code=b.text)]
    return []


# ---------------------------------------------------------------------------------------------
# Commands that read what an earlier one wrote run together: a chain


def _pairs(words: Sequence[str]) -> List[Tuple[str, str]]:
    return [tuple(w.lstrip("+").split("=", 1)) for w in words if "=" in w and not w.startswith("-")]


def _positionals(words: Sequence[str]) -> List[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w.startswith("--") and "=" not in w:
            skip = w not in FLAGS
        elif not w.startswith("-") and "=" not in w:
            out.append(w)
    return out


# Options without a value (the rest of the `--name value` options take the next word).
FLAGS = {"--cfg", "--multirun", "--help", "--hydra-help", "--info", "--shared-prompt", "--smollm2"}
DEFAULT_ALGO = "grpo"  # conf/config.yaml's default algo, the name of a run dir it makes


def writes(c: Command) -> List[str]:
    """The paths a command writes (a run dir, an export, a file it makes)."""
    a = c.argv
    if a[:1] == ("rlnotes",) and len(a) > 1:
        sub, rest = a[1], a[2:]
        values = dict(_pairs(rest))
        if sub == "train" and not {"--cfg", "--help", "--hydra-help", "--info"} & set(rest):
            sweep = "-m" in rest or "--multirun" in rest
            explicit = values.get("hydra.sweep.dir" if sweep else "hydra.run.dir")
            algo = values.get("algo", DEFAULT_ALGO)
            return [explicit or f"{'multirun' if sweep else 'outputs'}/DATE/TIME-{algo}"]
        if sub == "eval":
            return [values["eval.out"]] if "eval.out" in values else []
        if sub == "export":
            return _positionals(rest)[1:2]
        if sub == "plot" and "--out" in rest:
            return [rest[rest.index("--out") + 1]]
    if len(a) > 1 and a[0] in ("python", "python3") and a[1] in SCRIPT_OUTPUTS:
        return SCRIPT_OUTPUTS[a[1]](a[2:])
    return []


# Where a script documented with `python scripts/X.py ...` writes, from its arguments.
SCRIPT_OUTPUTS: Dict[str, Callable[[Sequence[str]], List[str]]] = {}


def _reads(c: Command) -> List[str]:
    return [w.split("=", 1)[1] if "=" in w else w for w in c.argv[1:]]


def _same_run(path: str) -> str:
    """A path with its run dir's date and time as placeholders: outputs/DATE/TIME-rm/final."""
    return re.sub(r"^(outputs|multirun)/[^/]+/[^/]+-(\w+)", r"\1/DATE/TIME-\2", path)


def depends(later: Command, earlier: Command) -> bool:
    made = [_same_run(w) for w in writes(earlier) if not NAMED.search(w)]  # RUN_DIR: an existing run, not a new one
    return any(r == w or r.startswith(w + "/") for r in map(_same_run, _reads(later)) for w in made)


def chains(commands: Sequence[Command]) -> List[List[Command]]:
    """The commands of a block in groups: a command joins the group of every earlier one it reads from."""
    group = list(range(len(commands)))

    def root(i):
        while group[i] != i:
            i = group[i]
        return i

    for j, later in enumerate(commands):
        for i in range(j):
            if depends(later, commands[i]):
                group[root(j)] = root(i)
    out: Dict[int, List[Command]] = {}
    for i, c in enumerate(commands):
        out.setdefault(root(i), []).append(c)
    return list(out.values())


@dataclass(frozen=True)
class Unit:
    """Commands run in order in one fresh directory, with the files of their document."""
    commands: Tuple[Command, ...]
    files: Tuple[Tuple[str, str], ...]

    @property
    def name(self) -> str:
        first = self.commands[0]
        more = f" (+{len(self.commands) - 1} reading what it writes)" if len(self.commands) > 1 else ""
        return f"{first.where} {first.text[:110]}{more}"


def units() -> List[Unit]:
    found, seen = [], set()
    for doc in DOCS:
        doc_blocks = blocks((ROOT / doc).read_text(), doc)
        files = tuple(sorted(user_files(doc_blocks).items()))
        for b in doc_blocks:
            for chain in chains(block_commands(b)):
                unit = Unit(tuple(chain), files)
                # The same command twice runs once (steps and eval sizes aside: they are shrunk), unless it
                # uses a file its documents define differently.
                said = " ".join(f"{c.text} {c.code}" for c in chain)
                used = tuple((name, text) for name, text in files
                             if re.search(rf"(?<![\w/.]){re.escape(Path(name).stem)}[.:]", said))
                shrinks = r" (trainer\.steps|eval\.size)=\d+"
                key = (tuple((re.sub(shrinks, "", f"{c.text} {c.code}"), c.expected) for c in chain), used)
                if key not in seen:
                    seen.add(key)
                    found.append(unit)
    return found


# ---------------------------------------------------------------------------------------------
# The tables: what the test does instead of running a command, the files the docs name without
# showing them, and the dirs that stand for placeholders.

# (pattern of the command, how it is checked, why it is not run as documented). The first match wins.
# compose: composed and validated as `rlnotes train` does before it starts anything (every member
#   of a sweep; torch told a GPU is there when the command asks for CUDA); an error that an optional
#   package is not installed here is the only one allowed.
# compose, slow runs it: the same, and the slow variant runs it (shrunk, tiny model).
EXCEPTIONS: List[Tuple[str, str, str]] = [
    (r"(^|/|-m )pip install ", "pip",
     "installs from the network: the extras it names must be in pyproject.toml, its packages among its dependencies"),
    (r"^python3? -m venv ", "venv", "run with --without-pip: pip's own install into a new venv costs ~8 s"),
    (r"^make ", "make",
     "make targets install .venv first (pip, network) or run the whole suite: `make -n` must accept the target and "
     "its variables, and the rlnotes commands it would run are composed, bench_trl.py's arguments parsed"),
    (r"^torchrun ", "torchrun",
     "several processes or nodes: torchrun's own parser reads its arguments and the rlnotes command is composed"),
    (r"hydra/launcher=submitit_slurm", "compose", "submits Slurm jobs"),
    (r"rollout\.engine=vllm|hardware=cuda", "compose", "needs a CUDA GPU (and vllm for rollout.engine=vllm)"),
    (r"hardware\.nproc=([3-9]|\d\d)", "compose",
     "more processes than this machine's 2 cores can run (a GPU each where they are written for one)"),
    (r"hardware\.nproc=2\b", "compose, slow runs it",
     "starts torchrun: a process per rank at 8 s of imports each; tests/test_distributed.py trains under torchrun"),
    (r"hydra/launcher=(joblib|submitit_local)", "compose, slow runs it",
     "runs members in new processes at 8 s of imports each; tests/test_sweep.py runs both launchers"),
    (r"data=hub", "compose", "reads a dataset from the Hugging Face Hub: no network here"),
    (r"^rlnotes train( -m)?( (optim\.\w+|algo\.(beta|group_size|clip_eps)|seed|rollout\.(temperature|max_new_tokens)|"
     r"logging\.(print_every|samples_every|samples_shown|sort_by|progress))=\S+)+$", "compose, slow runs it",
     "only values of settings that select no code (rates, beta, group size, seeds, what the console shows): "
     "composing checks their names, types and ranges, and the run is the default one (`rlnotes train` runs); time"),
    (r"logging=\S*\b(wandb|mlflow|trackio)\b", "compose unless installed",
     "needs an optional tracker package; where it is installed the command runs"),
    (r"hardware\.precision=\S*bf16", "compose unless bf16 units",
     "bf16 runs on a CPU with bf16 units and is refused on one without (tests/test_precision.py); where this CPU "
     "has them the command runs"),
    (r"^python scripts/bench_trl\.py", "bench_trl",
     "needs trl (pip extra bench) and runs each tool in its own process: its arguments are parsed by the script's "
     "own parser; tests/test_bench_trl.py runs a tiny round of each tool where trl is installed"),
    (r"^python scripts/arith_vs_trl\.py", "arith_vs_trl",
     "needs trl and the SmolLM2 recipe's run (hours): its arguments are parsed by the script's own parser; "
     "tests/test_scripts.py runs its rlnotes side and its report on the tiny model"),
    (r"^python scripts/calculator_vs_trl\.py", "calculator_vs_trl",
     "needs trl and runs the calculator recipe in both tools (an hour on 2 cores): its arguments are parsed by the "
     "script's own parser; tests/test_scripts.py checks its chat template for TRL, its report and its refusal "
     "without trl"),
    (r"^fn\(prompts=", "not code", "the shape of a call, with <placeholders> for keywords: not Python to run"),
]

# The yaml blocks: {first line of the block: (the file the prose around it puts it in, the command it gives)}.
YAML_FILES: Dict[str, Tuple[str, str]] = {
    "functions:": ("myconf/reward/mix.yaml", "rlnotes train --config-dir myconf data=arith reward=mix"),
    "# @package _global_": ("conf/experiment/search.yaml", "rlnotes train -m --config-dir conf experiment=search"),
    "# myconf/mine.yaml: GRPO on the letter task, with my settings over rlnotes' defaults": (
        "myconf/mine.yaml", "rlnotes train --config-dir myconf --config-name mine"),
}

_ROWS = [(a, b) for a in range(1, 5) for b in range(1, 5)]
# Files the docs' commands read but do not show: small ones of the documented shape.
USER_FILES: Dict[str, str] = {
    "train.jsonl": "".join(f'{{"prompt": "What is {a}+{b}?", "answer": "{a + b}", "ground_truth": "{a + b}"}}\n'
                           for a, b in _ROWS),
    "qa.csv": "question,solution\n" + "".join(f"What is {a}+{b}?,{a + b}\n" for a, b in _ROWS),
    "pairs.jsonl": "".join(f'{{"prompt": "What is {a}+{b}?", "chosen": "{a + b}", "rejected": "{a + b + 1}"}}\n'
                           for a, b in _ROWS),
    "chats.jsonl": "".join(f'{{"messages": [{{"role": "user", "content": "What is {a}+{b}?"}}, '
                           f'{{"role": "assistant", "content": "{a + b}"}}]}}\n' for a, b in _ROWS),
    "guesses.jsonl": "".join(f'{{"prompt": "Guess my number from 1 to 9:", "answer": "{a + b}"}}\n' for a, b in _ROWS),
    "mixed.jsonl": "".join(f'{{"prompt": "Count to {n}.", "target": {n}, "environment": "counter"}}\n'
                           f'{{"prompt": "Guess my number from 1 to 9:", "answer": "{n + 4}", '
                           f'"environment": "guess"}}\n' for n in (1, 2, 3, 4) * 2),
    "problems.jsonl": "".join(f'{{"prompt": "How many letters has the word {w}?", "answer": "{len(w)}"}}\n'
                              for w in ("cat", "horse", "banana", "me") * 4),
    "my_rewards.py": "def right(completions, answer, **kwargs):\n"
                     "    return [float(a in str(c)) for c, a in zip(completions, answer)]\n",
    "mypkg/__init__.py": "",
    "mypkg/rewards.py": "def my_fn(completions, **kwargs):\n"
                        "    return [float(len(str(c)) < 20) for c in completions]\n\n"
                        "def gsm8k(completions, answer, **kwargs):\n"
                        "    return [float(str(a) in str(c)) for c, a in zip(completions, answer)]\n",
}

# Placeholders of existing dirs: (pattern, the fixture dir that stands for it (FIXTURES), the path within it).
NAMED = re.compile(r"\b(RUN_DIR|RUN_A|RUN_B|SWEEP_DIR)\b")
PLACEHOLDERS: List[Tuple[str, str, str]] = [
    (r"\bRUN_DIR\b", "run", ""),
    (r"\bRUN_A\b", "sweep", "0"),
    (r"\bRUN_B\b", "sweep", "1"),
    (r"\bSWEEP_DIR\b", "sweep", ""),
    (r"\boutputs/A\b", "sweep", "0"),
    (r"\boutputs/B\b", "sweep", "1"),
    (r"\bmultirun/(DATE|\d{4}-\d\d-\d\d)/(TIME|\d\d-\d\d-\d\d)-grpo\b", "sweep", ""),
    (r"\boutputs/(DATE|\d{4}-\d\d-\d\d)/(TIME|\d\d-\d\d-\d\d)-grpo\b", "run", ""),
    (r"\boutputs/(DATE|\d{4}-\d\d-\d\d)/(TIME|\d\d-\d\d-\d\d)-rm\b", "rm", ""),
    (r"(?<![\w/-])my-model\b", "export", ""),
    (r"/models/my-reward-model\b", "classifier", ""),
    (r"\bORG/NAME\b", "standin", ""),   # a hub id: offline here, the check refuses one not in the hub cache
]
# Where a command writes: these values are not placeholders to resolve (except RUN_DIR & co., above).
OUTPUT_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "eval.out")

# Commands the docs give only in a comment beside another: (pattern of the documented command, the
# overrides that make the other one from it, the comment).
ALSO: List[Tuple[str, Tuple[str, ...], str]] = [
    (r"experiment=smollm2_arith seed=0 hydra\.run\.dir=runs/arith-0", ("seed=1", "hydra.run.dir=runs/arith-1"),
     "# and seed=1: the report after it reads runs/arith-1"),
    (r"eval\.out=runs/arith-0-1digit", ("eval.policy=runs/arith-1/final", "eval.out=runs/arith-1-1digit"),
     "# each seed: the report after it reads runs/arith-1-1digit"),
]

# Documented commands that fail today, to be fixed where they are documented: (pattern, why, strict).
# Strict: the test fails once the command works, so the entry goes with the fix.
KNOWN_FAILURES: List[Tuple[str, str, bool]] = []

# Commands whose as-written run is too long even for the slow variant: (pattern, why).
TOO_LONG: List[Tuple[str, str]] = [
    (r"rlnotes train .*(model=smollm2-135m|experiment=smollm2_)",
     "SmolLM2 training as documented: 60 GRPO steps by default (a recipe's own steps and evaluations) at 15-40 s a "
     "step on 2 cores, 15 minutes to over an hour; tests/test_recipes.py runs the arithmetic recipe cut short"),
]


def exception_for(c: Command) -> Optional[Tuple[str, str, str]]:
    return next((e for e in EXCEPTIONS if re.search(e[0], c.text)), None)


# ---------------------------------------------------------------------------------------------
# Fixture dirs, made once per test run by short runs, copied into a unit's directory when it uses one


class Fixtures:
    """Dirs made once by short runs, under `root` (shared by the xdist workers of one test run: a
    lock per dir, so one worker makes it and the others wait)."""

    def __init__(self, root: Path):
        self.root = root

    def get(self, name: str) -> Path:
        from filelock import FileLock

        path = self.root / name
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                tmp = self.root / f".{name}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                getattr(self, f"_{name}")(tmp)
                tmp.rename(path)
        return path

    def _sweep(self, path: Path) -> Path:
        _quiet_rlnotes(["train", "-m", "seed=0,1", "trainer.steps=1", "trainer.eval_every=1", "eval.size=8",
                        "data.train_size=32", "data.eval_size=8", f"hydra.sweep.dir={path}"])
        return path

    def _run(self, path: Path) -> Path:
        shutil.copytree(self.get("sweep") / "0", path)
        return path

    def _rm(self, path: Path) -> Path:
        _quiet_rlnotes(["train", "algo=rm", "data=letters_pairs", "trainer.steps=1", "data.train_size=32",
                        "data.eval_size=8", f"hydra.run.dir={path}"])
        return path

    def _export(self, path: Path) -> Path:
        _quiet_rlnotes(["export", str(self.get("sweep") / "0" / "final"), str(path)])
        return path

    def _standin(self, path: Path) -> Path:
        """SmolLM2's stand-in: the tiny model saved as a model dir, with room for 4096 positions (the
        calculator recipe's prompts are ~1200 of its characters; the built-in one holds 512)."""
        from omegaconf import OmegaConf

        from rlnotes.core.schema import ModelConfig
        from rlnotes.engine.model.loading import load_base

        model, tokenizer = load_base(OmegaConf.structured(ModelConfig()))
        model.config.max_position_embeddings = 4096
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    def _classifier(self, path: Path) -> Path:
        from tests.test_rewards import tiny_classifier

        tiny_classifier(path)
        return path


def _quiet_rlnotes(argv: List[str]) -> None:
    from rlnotes.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main([*argv, "logging.progress=false"] if argv[0] == "train" else argv)
    finally:
        sys.stdout, sys.stderr = old
    assert code == 0, f"making a fixture: rlnotes {' '.join(argv)} -> {code}\n{err.getvalue()[-3000:]}"


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()  # under xdist a worker's own: its parent is the test run's
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "documented-fixtures"
    root.mkdir(exist_ok=True)
    return Fixtures(root)


# ---------------------------------------------------------------------------------------------
# Running a unit


def shrunk(argv: Sequence[str], standin: str) -> List[str]:
    """An `rlnotes train|eval` command line cut to seconds: 1 optimizer step (one more when it resumes
    a run, so that a step is left to run, and one more for a one-step SFT warm-up), evaluations within
    those steps on 8 prompts, a built-in task of 32 training rows, at most 16 new tokens a turn, sweeps
    of one member (the first value of every list swept) or two (sweep.seeds=2), one trial of a search,
    and the model dir `standin` where the command has SmolLM2 (its other model settings stay). The
    values it replaces are read from the command's composed config (its first member's), so an
    experiment's are too."""
    from rlnotes.commands import hydra
    from rlnotes.commands.check import loader, members
    from rlnotes.commands.eval import with_run_settings

    sub, words = argv[0], list(argv[1:])
    if sub not in ("train", "eval"):
        return list(argv)
    args = hydra.parse_args(words)
    if args.help or args.hydra_help or args.cfg or args.info:
        return list(argv)
    try:
        configs = loader(args.config_dir)
        cfg = hydra.compose(configs, members(args.overrides, args.multirun, configs)[0])
        if sub == "eval":
            cfg = with_run_settings(cfg, args.overrides)
    except Exception:  # noqa: BLE001 - it fails as written: the command says why
        return list(argv)
    new: Dict[str, object] = {}
    if cfg.model.name_or_path == "smollm2-135m":
        new["model.name_or_path"] = standin
    if cfg.eval.size is None or cfg.eval.size > 8:
        new["eval.size"] = 8
    if cfg.data.source == "task" and not cfg.data.path:  # (a path alone means data=file)
        if cfg.data.train_size > max(32, cfg.trainer.batch_size):
            new["data.train_size"] = max(32, cfg.trainer.batch_size)
        if cfg.data.eval_size is None or cfg.data.eval_size > 8:
            new["data.eval_size"] = 8
    if cfg.rollout.max_new_tokens > 16:
        new["rollout.max_new_tokens"] = 16
    if sub == "train":
        warmup = min(cfg.sft_warmup.steps, 1)
        steps = 1 + warmup + (1 if cfg.trainer.resume else 0)
        if cfg.trainer.steps > steps:
            new["trainer.steps"] = steps
        if cfg.sft_warmup.steps > warmup:
            new["sft_warmup.steps"] = warmup
        if cfg.trainer.eval_every and cfg.trainer.eval_every > steps:
            new["trainer.eval_every"] = steps
        if args.multirun and cfg.sweep.seeds > 2:
            new["sweep.seeds"] = 2
        if args.multirun and (cfg.hydra.sweeper.get("n_trials") or 0) > 1:
            new["hydra.sweeper.n_trials"] = 1
    if args.multirun:  # one member, or two seeds: the first value of every list swept
        words = [re.sub(r"^([\w.+/-]+=[^,()\[\]{}'\" ]+)(,[^,()\[\]{}'\" ]+)+$", r"\1", w) for w in words]
    return [sub, *_with(words, [f"{key}={value}" for key, value in new.items()])]


def _with(words: Sequence[str], overrides: Sequence[str]) -> List[str]:
    """`words` with each of `overrides` (key=value) in place of the word that sets its key, or added."""
    words = list(words)
    for override in overrides:
        key = override.split("=", 1)[0]
        at = [i for i, w in enumerate(words) if w.lstrip("+").split("=", 1)[0] == key]
        if at:
            words[at[0]] = override
        else:
            words.append(override)
    return words


class Runner:
    """Runs a unit's commands in its directory `cwd`; each method checks one kind of command."""

    def __init__(self, cwd: Path, fixtures: Fixtures, monkeypatch, capsys, slow: bool = False):
        self.cwd, self.fixtures, self.monkeypatch, self.capsys, self.slow = cwd, fixtures, monkeypatch, capsys, slow
        self.copied: Dict[str, str] = {}
        self.clock: Dict[str, float] = {}  # an outputs/DATE/TIME-ALGO dir: when a command of the unit made one

    # -- placeholders

    def resolve(self, text: str, output: bool = False) -> str:
        """`text` with its placeholders replaced by real dirs: one an earlier command made here, else
        a fixture copied here. A path where a command writes keeps its name (RUN_DIR & co. excepted)."""
        for pattern, fixture, inner in PLACEHOLDERS:
            if output and not NAMED.search(pattern):
                continue
            text = re.sub(pattern, lambda m: self._stand_in(m.group(0), fixture, inner), text)
        return re.sub(r"[\w./-]*/checkpoints/step_\d+", lambda m: self._checkpoint(m.group(0)), text)

    def _stand_in(self, placeholder: str, fixture: str, inner: str) -> str:
        if (self.cwd / placeholder).exists():
            return placeholder
        dated = re.match(r"(outputs|multirun)/[^/]+/[^/]+-(\w+)$", placeholder)
        made = sorted(self.cwd.glob(f"{dated.group(1)}/*/*-{dated.group(2)}")) if dated else []
        if made:  # an earlier command of the unit made it
            return str(made[-1].relative_to(self.cwd))
        if fixture not in self.copied:
            self.copied[fixture] = f"fixture-{fixture}"
            shutil.copytree(self.fixtures.get(fixture), self.cwd / self.copied[fixture])
        return f"{self.copied[fixture]}/{inner}".rstrip("/")

    def _checkpoint(self, path: str) -> str:
        """A checkpoint the docs name by an example step: the latest of that run."""
        if (self.cwd / path).exists():
            return path
        found = sorted((self.cwd / path).parent.glob("step_*"))
        assert found, f"{path}: no checkpoint in {(self.cwd / path).parent}"
        return str(found[-1].relative_to(self.cwd))

    def words(self, c: Command) -> List[str]:
        out = []
        for i, w in enumerate(c.argv):
            key = w.split("=", 1)[0] if "=" in w else None
            positional_out = w in writes(c) and key is None
            out.append(self.resolve(w, output=key in OUTPUT_KEYS or positional_out))
        return out

    # -- running

    def run(self, c: Command) -> None:
        if c.kind == "python":
            return self.python(c)
        if c.kind == "yaml":
            return self.yaml(c)
        for k, v in c.env:
            self.monkeypatch.setenv(k, v)
        words = self.words(c)
        if c.expected:
            return self.documented_output(c, words)
        exception = exception_for(c)
        if exception is not None and self.slow and exception[1] == "compose, slow runs it":
            return self.console_script(c, words)
        if exception is not None:
            return self.otherwise(c, words, exception)
        if words[0] == "rlnotes":
            self.new_second(c)
            argv = shrunk(words[1:], str(self.fixtures.get("standin")))
            code, out = self.rlnotes(argv)
            assert code == 0, f"{c.where}: `{c.text}` exited with {code}; ran: rlnotes {shlex.join(argv)}\n" \
                              f"{out[-4000:]}"
            for pattern, overrides, comment in ALSO:
                if re.search(pattern, c.text):
                    other = _with(c.argv, overrides)
                    self.run(Command(c.doc, c.line, f"{shlex.join(other)}  {comment}", tuple(other)))
            return None
        if words[0] in ("python", "python3") and len(words) > 1 and words[1].startswith("scripts/"):
            return self.script(c, words)
        pytest.fail(f"{c.where}: the test does not know how to run `{c.text}`: teach it (Runner.run) or add the "
                    "command to EXCEPTIONS with the reason it is checked another way")

    def new_second(self, c: Command) -> None:
        """Two runs of a unit into Hydra's outputs/DATE/TIME-ALGO would share a dir within one second
        (the second refused): a reader types them seconds apart."""
        for path in writes(c):
            if "DATE/TIME" in path:
                if int(self.clock.get(path, -1)) == int(time.time()):
                    time.sleep(1 - time.time() % 1)
                self.clock[path] = time.time()

    def console_script(self, c: Command, words: List[str]) -> None:
        """The slow variant of a command that starts processes: the console script, shrunk."""
        argv = [str(Path(sys.executable).with_name("rlnotes")), *shrunk(words[1:], str(self.fixtures.get("standin")))]
        done = subprocess.run(argv, cwd=self.cwd, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, f"{c.where}: `{c.text}` exited with {done.returncode}\n{done.stderr[-4000:]}"

    def rlnotes(self, argv: Sequence[str]) -> Tuple[int, str]:
        from rlnotes.commands.cli import main

        def execv(*args):  # rlnotes becomes torchrun for hardware.nproc > 1: not this test process
            raise AssertionError(f"rlnotes {shlex.join(argv)} would start torchrun in the test's process: give the "
                                 "command an entry in EXCEPTIONS")

        self.monkeypatch.setattr(os, "execv", execv)
        self.capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = self.capsys.readouterr()
        return code, captured.out + captured.err

    def documented_output(self, c: Command, words: List[str]) -> None:
        """A `$ ` command, run exactly as written: its documented output appears in what it printed
        (spaces aside). An error that an optional package is missing is only shown where it is."""
        assert words[0] == "rlnotes", f"{c.where}: the test runs only rlnotes commands after a `$ ` prompt: {c.text}"
        for package in re.findall(r"needs the (\w+) package", " ".join(c.expected)):
            if importlib.util.find_spec(package) is not None:
                pytest.skip(f"{c.where}: shows the error of a missing {package}, which is installed here")
        code, out = self.rlnotes(words[1:])
        said = " ".join(out.split())
        for line in c.expected:
            assert " ".join(line.split()) in said, \
                f"{c.where}: `{c.text}` did not print\n  {line}\nit printed:\n{out[-4000:]}"

    def script(self, c: Command, words: List[str]) -> None:
        path = ROOT / words[1]
        assert path.is_file(), f"{c.where}: no {words[1]}"
        argv = [str(path), *words[2:], *SCRIPT_SHRINK.get(words[1], ())]
        self.monkeypatch.setattr(sys, "argv", argv)
        try:
            runpy.run_path(str(path), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = self.capsys.readouterr()
        assert code == 0, f"{c.where}: `{c.text}` exited with {code}\n{(captured.out + captured.err)[-4000:]}"

    def python(self, c: Command) -> None:
        exception = exception_for(c)
        if exception is not None:
            assert exception[1] == "not code", exception
            return
        exec(compile(self.resolve(c.code), f"{c.where} (python block)", "exec"), {"__name__": "__main__"})

    def yaml(self, c: Command) -> None:
        assert c.text in YAML_FILES, (f"{c.where}: a yaml block the test does not know ({c.text!r}): add it to "
                                      "YAML_FILES with the file the docs put it in and the command that uses it")
        path, command = YAML_FILES[c.text]
        (self.cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (self.cwd / path).write_text(c.code)
        self.run(Command(c.doc, c.line, command, tuple(shlex.split(command))))

    # -- the exceptions

    def otherwise(self, c: Command, words: List[str], exception: Tuple[str, str, str]) -> None:
        how = exception[1]
        if how.startswith("compose"):
            if how == "compose unless installed" and not _missing_packages(c.text):
                return self.run_anyway(c, words)
            if how == "compose unless bf16 units":
                if _bf16_units():
                    return self.run_anyway(c, words)
                from rlnotes.engine.hardware import devices  # composed as on a CPU with bf16 units

                self.monkeypatch.setattr(devices, "bf16_units", lambda device: "emulated")
            return self.compose(c, words[words.index("rlnotes") + 1:])
        getattr(self, how.replace(" ", "_"))(c, words)

    def run_anyway(self, c: Command, words: List[str]) -> None:
        argv = shrunk(words[1:], str(self.fixtures.get("standin")))
        code, out = self.rlnotes(argv)
        assert code == 0, f"{c.where}: `{c.text}` exited with {code}\n{out[-4000:]}"

    def compose(self, c: Command, argv: List[str]) -> None:
        assert argv[0] == "train", f"{c.where}: only `rlnotes train` commands are composed: {c.text}"
        composed(argv[1:], c.text, self.monkeypatch, c.where)

    def pip(self, c: Command, words: List[str]) -> None:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        extras = project["optional-dependencies"]
        known = {re.split(r"[<>=!\[ ;]", d)[0].lower() for d in
                 [*project["dependencies"], *(d for ds in extras.values() for d in ds)]}
        args = words[words.index("install") + 1:]
        wanted, skip = [], False
        for w in args:
            if skip:
                skip = False
            elif w in ("--index-url", "--extra-index-url", "-r", "-c", "--target"):
                skip = True
            elif w == "-e" or not w.startswith("-"):
                if w != "-e":
                    wanted.append(w)
        assert wanted, f"{c.where}: `{c.text}` installs nothing"
        for requirement in wanted:
            m = re.fullmatch(r"(\.|rlnotes)(?:\[([\w,-]+)\])?", requirement)
            if m:
                unknown = set((m.group(2) or "").split(",")) - set(extras) - {""}
                assert not unknown, f"{c.where}: `{c.text}`: no extra {unknown} in pyproject.toml ({', '.join(extras)})"
            else:
                name = re.split(r"[<>=!\[]", requirement)[0].lower()
                assert name in known, f"{c.where}: `{c.text}`: {name} is not a dependency of rlnotes (pyproject.toml)"

    def venv(self, c: Command, words: List[str]) -> None:
        out = subprocess.run([sys.executable, *words[1:], "--without-pip"], cwd=self.cwd, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, f"{c.where}: `{c.text}`: {out.stderr}"

    def make(self, c: Command, words: List[str]) -> None:
        env = {**os.environ, "MAKEFLAGS": ""}
        out = subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0, f"{c.where}: `{c.text}`: make -n failed:\n{out.stderr}"
        for line in out.stdout.splitlines():
            recipe = shlex.split(line.replace("&&", ";").split(";")[-1]) if line.strip() else []
            if len(recipe) > 1 and recipe[0].endswith("/rlnotes"):
                self.compose(c, recipe[1:])
            elif any(w.endswith("scripts/bench_trl.py") for w in recipe):
                _bench_trl().parse_args(recipe[[w.endswith("bench_trl.py") for w in recipe].index(True) + 1:])

    def torchrun(self, c: Command, words: List[str]) -> None:
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(words[1:])
        assert args.module and args.training_script == "rlnotes", f"{c.where}: `{c.text}` does not run -m rlnotes"
        self.compose(c, list(args.training_script_args))

    def bench_trl(self, c: Command, words: List[str]) -> None:
        _bench_trl().parse_args(words[2:])

    def arith_vs_trl(self, c: Command, words: List[str]) -> None:
        _script("arith_vs_trl").parse_args(words[2:])

    def calculator_vs_trl(self, c: Command, words: List[str]) -> None:
        _script("calculator_vs_trl").parse_args(words[2:])

    def not_code(self, c: Command, words: List[str]) -> None:
        pass


def composed(overrides: List[str], text: str, monkeypatch, where: str = "") -> None:
    """Compose and validate every job of `rlnotes train OVERRIDES` as the command does before it
    starts anything; where `text` asks for CUDA or vLLM, torch is told a GPU is there. An error that an
    optional package `text` names is not installed here is the only one allowed."""
    import torch

    from rlnotes.commands import hydra
    from rlnotes.commands.check import check
    from rlnotes.commands.usage import UsageError

    if re.search(r"cuda|vllm", text):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    args = hydra.parse_args(list(overrides))
    try:
        check(args.overrides, args.multirun, args.config_dir)
    except UsageError as e:
        missing = re.search(r"needs the (\w+) package", str(e))
        assert missing and missing.group(1) in _missing_packages(text), f"{where}: `{text}`: {e}"


def _missing_packages(text: str) -> List[str]:
    """The optional packages `text` names that are not installed here."""
    return [p for p in ("wandb", "mlflow", "trackio", "vllm") if re.search(rf"\b{p}\b", text)
            and importlib.util.find_spec(p) is None]


def _bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (hardware.precision=bf16 runs)."""
    import torch

    from rlnotes.engine.hardware.devices import bf16_units

    return bf16_units(torch.device("cpu")) is not None


def _script(name: str):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _bench_trl():
    return _script("bench_trl")


# What a documented script command gets appended in the test, to run in seconds.
SCRIPT_SHRINK: Dict[str, Tuple[str, ...]] = {
    # the tiny model for SmolLM2 (minutes); tests/test_sampling_check.py runs it on SmolLM2, slow-marked
    "scripts/sampling_check.py": ("--model", "tiny", "--samples", "256", "--draws", "20000", "--threads", "1"),
    # few rows and one timing of each product: the table's shape, not its figures
    "scripts/step_floor.py": ("--rows", "4", "--repeats", "1", "--threads", "1"),
}


@pytest.fixture
def unit_dir(tmp_path, monkeypatch):
    """A fresh directory as a checkout's root (docs/ exists: figures are written there), the cwd, with
    the data files the docs name; user modules imported from it are forgotten afterwards, and so is
    the cwd rlnotes put on sys.path to import them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))  # rlnotes appends the cwd to import a user's module
    (tmp_path / "docs").mkdir()
    for name, text in USER_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def _run_unit(unit: Unit, cwd: Path, fixtures, monkeypatch, capsys, slow: bool = False) -> None:
    for name, text in unit.files:
        (cwd / name).write_text(text)
    runner = Runner(cwd, fixtures, monkeypatch, capsys, slow)
    for c in unit.commands:
        runner.run(c)


def _param(unit: Unit):
    texts = [c.text for c in unit.commands]
    known = next(((why, strict) for pattern, why, strict in KNOWN_FAILURES
                  if any(re.search(pattern, t) for t in texts)), None)
    marks = [pytest.mark.xfail(reason=known[0], strict=known[1])] if known else []
    return pytest.param(unit, marks=marks, id=unit.name)


UNITS = units()


@pytest.mark.parametrize("unit", [_param(u) for u in UNITS])
def test_documented_command_runs(unit, unit_dir, fixtures, monkeypatch, capsys):
    _run_unit(unit, unit_dir, fixtures, monkeypatch, capsys)


def _slow_units() -> List[Tuple[Unit, Optional[str]]]:
    """The units whose default run swaps SmolLM2 for its stand-in, or only composes a command that
    runs here (a launcher), each with why it is too long to run as written, if it is."""
    out = []
    for u in UNITS:
        how = [(exception_for(c) or ("", ""))[1] if not c.expected else "as written" for c in u.commands]
        launcher = "compose, slow runs it" in how
        real = any(not h and "smollm2" in f"{c.text} {c.code}" for c, h in zip(u.commands, how))
        if launcher or real:
            texts = " ".join(c.text for c in u.commands)
            out.append((u, next((why for pattern, why in TOO_LONG if real and re.search(pattern, texts)), None)))
    return out


SLOW = _slow_units()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("unit,too_long", SLOW, ids=[u.name for u, _ in SLOW])
def test_documented_command_runs_as_written(unit, too_long, unit_dir, fixtures, monkeypatch, capsys):
    """SmolLM2 commands as written (no shrinking at all), and the launchers the default run only composes."""
    if too_long:
        pytest.skip(too_long)
    if any(exception_for(c) and exception_for(c)[1] == "compose, slow runs it" for c in unit.commands):
        _run_unit(unit, unit_dir, fixtures, monkeypatch, capsys, slow=True)
        return
    monkeypatch.setattr(sys.modules[__name__], "shrunk", lambda argv, standin: list(argv))
    _run_unit(unit, unit_dir, fixtures, monkeypatch, capsys)


# ---------------------------------------------------------------------------------------------
# The reading itself


def test_blocks_are_read_as_a_reader_would():
    doc = "\n".join([
        "Intro", "```bash",
        "rlnotes train a=1 \\", "    b='x y'   # a comment", "# a line of comment", "",
        "WANDB_MODE=offline rlnotes train logging=wandb", "```",
        "```text", "$ rlnotes train algo=foo", "rlnotes: error: algo=foo is not an option", "other output",
        "$ rlnotes train x=1", "said", "```",
        "```python", "# my_tools.py: tools", "def f(): pass", "```",
        "```python", "print(1)", "```"])
    bs = blocks(doc, "X.md")
    assert [(b.lang, b.line) for b in bs] == [("bash", 2), ("text", 9), ("python", 16), ("python", 20)]
    first, second = shell_commands(bs[0])
    assert first.argv == ("rlnotes", "train", "a=1", "b=x y") and first.line == 3
    assert second.env == (("WANDB_MODE", "offline"),) and second.argv == ("rlnotes", "train", "logging=wandb")
    a, b = shell_commands(bs[1])
    assert a.argv == ("rlnotes", "train", "algo=foo") and a.expected == (
        "rlnotes: error: algo=foo is not an option", "other output")
    assert b.expected == ("said",)
    assert user_files(bs) == {"my_tools.py": "# my_tools.py: tools\ndef f(): pass\n"}
    assert [c.kind for c in block_commands(bs[3])] == ["python"]


def test_commands_that_read_what_another_writes_run_together(monkeypatch):
    def cmd(text):
        return Command("X.md", 1, text, tuple(shlex.split(text)))

    monkeypatch.setitem(SCRIPT_OUTPUTS, "scripts/write_rows.py", lambda args: _positionals(args)[:1])
    block = [cmd("python scripts/write_rows.py calc.jsonl"),
             cmd("rlnotes train data.path=calc.jsonl hydra.run.dir=runs/a"),
             cmd("rlnotes train algo=rm"),
             cmd("rlnotes export runs/a/final runs/m"),
             cmd("rlnotes train reward=model reward.path=outputs/DATE/TIME-rm/final"),
             cmd("rlnotes train trainer.resume=auto hydra.run.dir=RUN_DIR"),
             cmd("rlnotes eval eval.policy=RUN_DIR/final")]
    assert [[c.text for c in chain] for chain in chains(block)] == [
        [block[0].text, block[1].text, block[3].text], [block[2].text, block[4].text], [block[5].text],
        [block[6].text]]
