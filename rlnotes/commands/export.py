"""`rlnotes export RUN_DIR/final OUT_DIR`: a trained policy as a standard Hugging Face model dir.

A LoRA run saves only its adapter; export loads the base model the run's config.yaml names (the
tiny model built in code, SmolLM2-135M from the cache, a local dir or a hub id), merges the adapter
into the base weights (W + alpha/r B A) and saves model weights (safetensors), config, generation
config and the tokenizer with its chat template, so that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load it with no peft and no rlnotes. A full fine-tuning run
(`model.lora=null`) is re-saved the same way. Before saving, the merged model's log-probs are
checked against the adapter model's on a probe text.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, List, Tuple, Union

import torch
from omegaconf import OmegaConf
from peft import PeftModel
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlnotes.commands.usage import Parser, UsageError
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import ModelConfig
from rlnotes.engine.model.loading import load_base, usual_modes
from rlnotes.engine.model.sources import check_policy_dir
from rlnotes.run import rundir

ADAPTER_FILE = "adapter_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBE = "What is 3+4? Answer with just the number.\n7"
# Largest |log p(merged) - log p(adapter)| accepted in float32 (merging reorders float sums: ~1e-6).
TOLERANCE = 1e-4


def find_run_config(policy_dir: Path) -> Path:
    """The config.yaml of the run that saved `policy_dir` (RUN_DIR/final, a checkpoint below RUN_DIR, ...)."""
    for parent in [policy_dir, *list(policy_dir.parents)[:3]]:
        if (parent / "config.yaml").exists():
            return parent / "config.yaml"
    raise ConfigError(f"no config.yaml of a run found above {policy_dir}; export needs the run's config.yaml "
                      "to know the base model (pass RUN_DIR/final of a run made by rlnotes train)")


def model_config(config_path: Path):
    """The run's `model` section, filled with the schema's defaults for keys an older run lacks."""
    run = OmegaConf.load(config_path)
    if "model" not in run:
        raise ConfigError(f"{config_path} has no model section; is it the config.yaml of an rlnotes run?")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), run.model)


def load_policy(policy_dir: Path) -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer) of a saved policy in float32 on CPU: a peft model (base + adapter) for a
    LoRA run, a plain causal LM for a full fine-tuning run."""
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, trust_remote_code=False)  # never a model's own code
    if not (policy_dir / ADAPTER_FILE).exists():
        if not (policy_dir / "config.json").exists():
            raise ConfigError(f"{policy_dir} holds neither a LoRA adapter ({ADAPTER_FILE}) nor a model (config.json); "
                              "pass RUN_DIR/final")
        return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32, trust_remote_code=False), tokenizer
    base, _ = load_base(base_config(policy_dir))
    return PeftModel.from_pretrained(base, policy_dir).eval(), tokenizer


def base_config(adapter_dir: Path):
    """The model section to load a LoRA adapter's base with: its run's, else (an adapter dir copied
    away from its run) the base its adapter_config.json names, with default settings."""
    try:
        return model_config(find_run_config(adapter_dir))
    except ConfigError:
        base = json.loads((adapter_dir / ADAPTER_FILE).read_text()).get("base_model_name_or_path")
        if not base:
            raise
        return OmegaConf.structured(ModelConfig(name_or_path=base))


@torch.no_grad()
def probe_logprobs(model, tokenizer, text: str = PROBE) -> torch.Tensor:
    """log p(token_t | tokens_<t) of every token of `text` after the first: [T-1] float32."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hide the deprecation notices transformers and peft raise about their own internals."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield


def _target(out_dir: Path) -> None:
    """Refuse an OUT_DIR that is not new or empty, or that lies inside a saved policy, a checkpoint
    or a run's checkpoints/, final/, interrupted/ or eval/ (rlnotes.run.rundir.enclosing): the next
    resume or save of that run would delete the export with them."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} already exists and is not an empty dir; choose a new OUT_DIR or remove it")
    problem = rundir.enclosing(out_dir)
    if problem:
        raise ConfigError(f"OUT_DIR {problem}, and would go with it; choose an OUT_DIR outside it")


def export(policy_dir: Union[str, Path], out_dir: Union[str, Path], dtype: str = "float32", console=None) -> Path:
    """Save the policy in `policy_dir` as a plain Hugging Face model dir `out_dir` (written to a
    temporary dir and renamed, so a failure never leaves a half-written model)."""
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    if not policy_dir.is_dir():
        raise ConfigError(f"{policy_dir} is not a directory; pass RUN_DIR/final (or a checkpoint dir)")
    check_policy_dir(policy_dir, "POLICY_DIR")  # a run dir instead of its final/: named, with what to pass
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not valid; choose one of: {', '.join(DTYPES)}")
    _target(out_dir)
    with _quiet():
        model, tokenizer = load_policy(policy_dir)
    lora = hasattr(model, "merge_and_unload")
    if lora:
        before = probe_logprobs(model, tokenizer)
        model = model.merge_and_unload()  # W <- W + (alpha / r) B A, in place; the peft wrappers go
        gap = float((probe_logprobs(model, tokenizer) - before).abs().max())
        if gap > TOLERANCE:
            raise ConfigError(f"the merged model's log-probs differ from the adapter's by {gap:.2e} (> {TOLERANCE}); "
                              "the adapter may not match the base model in config.yaml")
    model = model.to(DTYPES[dtype])
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        with _quiet():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        try:  # the run's full config, for the record
            shutil.copy(find_run_config(policy_dir), tmp / "rlnotes_config.yaml")
        except ConfigError:
            pass
        usual_modes(tmp)  # mkdtemp made it 0700, safetensors writes 0600
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if console is not None:
        how = "LoRA adapter merged into its base" if lora else "fully fine-tuned model"
        check = f"; merged log-probs match the adapter's to {gap:.1e}" if lora else ""
        check += f" (in float32, before the weights were cast to {dtype})" if lora and dtype != "float32" else ""
        console.print(f"exported {policy_dir} ({how}, {dtype}{check}) -> {out_dir}")
        if (policy_dir / "reward_head.safetensors").exists():
            console.print("[yellow]note: reward_head.safetensors (a reward model's scalar head) is not part of a "
                          "causal LM and was not exported[/]")
    return out_dir


def main(argv: List[str]) -> int:
    """`rlnotes export POLICY_DIR OUT_DIR [--dtype D]`."""
    parser = Parser(prog="rlnotes export", description="Merge a trained LoRA adapter into its base model (or "
                    "copy a fully fine-tuned one) and save a standard Hugging Face model dir.")
    parser.add_argument("policy", metavar="POLICY_DIR", help="RUN_DIR/final, RUN_DIR/interrupted or a checkpoint dir")
    parser.add_argument("out", metavar="OUT_DIR", help="new (or empty) dir for the model, tokenizer and config")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="dtype of the saved weights (default float32)")
    args = parser.parse_args(argv)
    try:
        # soft_wrap: a message is one line (its paths whole) however narrow the screen, or a pipe's 80 columns.
        export(args.policy, args.out, args.dtype, Console(stderr=True, soft_wrap=True))
    except ConfigError as e:
        raise UsageError(str(e)) from None
    return 0
