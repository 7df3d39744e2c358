"""A reward model: the base model with a LoRA adapter and a scalar linear head on the final
hidden state of each sequence's last real token (InstructGPT's RM, Ouyang et al. 2022, Sec. 3.5,
there a 6B model with its unembedding replaced by a scalar head).

`algo=rm` trains the adapter and head together on preference pairs; its run's `final/` holds the
adapter, the tokenizer and `reward_head.safetensors`, and `reward=model reward.path=RUN/final`
scores completions with it. `reward.path` may also be any local Hugging Face model dir that
AutoModelForSequenceClassification loads with one label (a published reward model). Either is
checked before any model loads (`check`): one label, and every weight of the score head saved, for
a missing one would be initialized at random (transformers only warns, and its warnings are muted).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Sequence

import torch
from omegaconf import OmegaConf

from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import saved_run_config
from rlnotes.engine.model.loading import load_base
from rlnotes.engine.policy.head import linear_float32
from rlnotes.engine.policy.passes import forward
from rlnotes.engine.prompts import as_messages, render_plain
from rlnotes.engine.sequences import Sequences, encode

HEAD = "reward_head"   # its name in Model.heads (training.context) and its file name in final/


def make_head(model: torch.nn.Module, bias: bool = False) -> torch.nn.Linear:
    """hidden -> 1, weights ~ N(0, 1/hidden) so initial rewards are O(1) and differ between
    sequences (a zero head would also zero LoRA's first gradient). No bias: the Bradley-Terry loss
    sees only r_w - r_l, so a bias gets a gradient of exactly 0 up to rounding, which Adam's
    normalised step turns into lr-sized moves in a direction the CPU's rounding picks. `bias`: a
    head saved with one (earlier versions) loads into its own shape."""
    d = model.config.hidden_size
    head = torch.nn.Linear(d, 1, bias=bias)
    torch.nn.init.normal_(head.weight, std=1 / math.sqrt(d))
    if bias:
        torch.nn.init.zeros_(head.bias)
    return head


def sequence_rewards(model: torch.nn.Module, head: torch.nn.Module, seqs: Sequences) -> torch.Tensor:
    """r(x, y) = w . h_last for each row of `seqs`: [N] float32."""
    out = forward(model, seqs.input_ids, seqs.attention_mask, 1, hidden_states=True)
    last = out.hidden_states[-1][torch.arange(seqs.input_ids.shape[0], device=seqs.input_ids.device),
                                 seqs.last_index]
    return linear_float32(head, last).squeeze(-1)


def load(path: Path, device: torch.device):
    """(model, head, tokenizer, model config) of a reward model saved by algo=rm (RUN/final or a
    checkpoint); the model config comes from the run's config.yaml, so prompts are encoded as in training."""
    from peft import PeftModel
    from safetensors.torch import load_file

    path = Path(path)
    run_cfg, weights = saved_run_config(path), path / f"{HEAD}.safetensors"
    if run_cfg is None or not weights.exists():
        raise ConfigError(f"reward.path={path} is not the final/ or checkpoint dir of an algo=rm run "
                          f"(it needs {weights.name} there and the run's config.yaml)")
    model_cfg = run_cfg.model
    base, tokenizer = load_base(model_cfg)
    model = PeftModel.from_pretrained(base.to(device), path).eval().requires_grad_(False)
    state = load_file(str(weights))
    head = make_head(base, bias="bias" in state)
    head.load_state_dict(state)
    return model, head.to(device).eval().requires_grad_(False), tokenizer, model_cfg


# A loaded reward model: (prompts, completions) -> r(x, y) [N] on CPU, no gradients.
Scorer = Callable[[Sequence, Sequence[str]], torch.Tensor]


def kind(path) -> str:
    """"rm" for the final/ dir of an algo=rm run, "hf" for a Hugging Face model dir; anything else
    is a config mistake, reported before a model loads."""
    path = Path(path)
    if (path / f"{HEAD}.safetensors").is_file():
        return "rm"
    if (path / "config.json").is_file():
        return "hf"
    raise ConfigError(f"reward model path {str(path)!r} is neither the final/ dir of an algo=rm run "
                      f"(with {HEAD}.safetensors) nor a Hugging Face model dir (with config.json)")


def check(path) -> None:
    """Before any model loads: `path` is a reward model dir (`kind`) that gives one score per
    sequence from saved weights: an algo=rm head file with its weight, or a Hugging Face model with
    one label whose score head is saved (check_hf). A config mistake, in one line."""
    if kind(path) == "hf":
        check_hf(Path(path))
        return
    from safetensors import safe_open

    head = Path(path) / f"{HEAD}.safetensors"
    with safe_open(str(head), "pt") as f:
        if "weight" not in f.keys():
            raise ConfigError(f"reward model {str(path)!r}: {head.name} has no weight; it is not the head an algo=rm "
                              "run saves")


def check_hf(path: Path) -> None:
    """A Hugging Face reward model: built-in code (never the model's own), one label, and every
    weight of its score head (the parameters outside its base model) in its saved weights, read
    from the names in a safetensors checkpoint without loading it (a .bin checkpoint is checked
    when it loads: _hf_scorer)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        if config.num_labels == 1:
            with torch.device("meta"):  # the parameters' names, no memory
                model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - an unreadable config.json, custom code, no classification class
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__
        raise ConfigError(f"reward model {str(path)!r} cannot be read as a sequence-classification model with "
                          f"transformers' own code ({why})") from None
    if config.num_labels != 1:
        raise ConfigError(f"reward model {str(path)!r} has {config.num_labels} labels; a reward model gives one score "
                          "per sequence (num_labels=1)")
    saved = _saved_names(path)
    prefix = f"{model.base_model_prefix}."
    missing = [k for k in model.state_dict() if not k.startswith(prefix) and saved is not None and k not in saved]
    if missing:
        raise ConfigError(_missing_head(path, missing))


def _missing_head(path: Path, missing) -> str:
    return (f"reward model {str(path)!r} has no saved weights for {', '.join(sorted(missing))}: it would score with "
            "weights initialized at random. Give the dir of a trained reward model (a sequence-classification "
            "model saved with its head), or train one with algo=rm")


def _saved_names(path: Path):
    """The tensor names of a safetensors checkpoint in `path` (one file or an index of shards); None
    for another format."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return set(f.keys())
    return None


def load_scorer(path, device: torch.device, batch_size: int) -> Scorer:
    """The reward model at `path` (either kind), loaded once, scoring `batch_size` sequences a pass."""
    load_kind = {"rm": _rm_scorer, "hf": _hf_scorer}[kind(path)]
    return load_kind(Path(path), device, batch_size)


def _rm_scorer(path: Path, device: torch.device, batch_size: int) -> Scorer:
    """An algo=rm model: prompts encoded as its training run encoded them (rlnotes.engine.sequences.encode,
    with that run's chat template setting and system prompt: data.system_prompt, else model's)."""
    model, head, tokenizer, model_cfg = load(path, device)
    data_system = OmegaConf.select(saved_run_config(path), "data.system_prompt")
    system = data_system if data_system is not None else model_cfg.system_prompt

    @torch.no_grad()
    def score(prompts, completions) -> torch.Tensor:
        out = []
        for i in range(0, len(completions), batch_size):
            seqs = encode(tokenizer, prompts[i:i + batch_size], completions[i:i + batch_size], device,
                          model_cfg.chat_template, system)
            out.append(sequence_rewards(model, head, seqs).float().cpu())
        return torch.cat(out)
    return score


def _hf_scorer(path: Path, device: torch.device, batch_size: int) -> Scorer:
    """A sequence-classification model with one label: r(x, y) is its logit on the conversation
    [user: x, assistant: y] rendered with its tokenizer's chat template (x + y without one)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)  # never its code
    model, info = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                                     trust_remote_code=False, output_loading_info=True)
    if model.config.num_labels != 1:
        raise ConfigError(f"reward model {str(path)!r} has {model.config.num_labels} labels; a reward model gives "
                          "one score per sequence (num_labels=1)")
    if info["missing_keys"]:  # weights initialized at random (a .bin checkpoint check_hf could not read)
        raise ConfigError(_missing_head(path, info["missing_keys"]))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Right padding keeps each row's positions 0..L-1 without position ids; the model reads the
    # score at the last token that is not padding.
    tokenizer.padding_side = "right"
    model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(prompts, completions) -> torch.Tensor:
        texts = [conversation_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        out = []
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(texts[i:i + batch_size], padding=True, add_special_tokens=not tokenizer.chat_template,
                              return_tensors="pt").to(device)
            out.append(model(**batch).logits[:, 0].float().cpu())
        return torch.cat(out)
    return score


def conversation_text(tokenizer, prompt, completion: str) -> str:
    """The text a Hugging Face reward model scores: [prompt messages or user: prompt, assistant:
    completion] through the chat template when the tokenizer has one, else the prompt as the
    rollout engine renders plain text (rlnotes.engine.prompts.render_plain), then the completion."""
    if tokenizer.chat_template:
        messages = as_messages(prompt) + [{"role": "assistant", "content": completion}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return render_plain(prompt) + completion
