"""A reward model: the base model with a LoRA adapter and a scalar linear head on the final
hidden state of each sequence's last real token (InstructGPT's RM, Ouyang et al. 2022, Sec. 3.5,
there a 6B model with its unembedding replaced by a scalar head).

`algo=rm` trains the adapter and head together on preference pairs; its run's `final/` holds the
adapter, the tokenizer and `reward_head.safetensors`, and `reward=model reward.path=RUN/final`
scores completions with it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rlnotes.offline import Sequences
from rlnotes.policy import forward

HEAD = "reward_head"   # its name in Context.heads and its file name in final/


def make_head(model: torch.nn.Module) -> torch.nn.Linear:
    """hidden -> 1, weights ~ N(0, 1/hidden) so initial rewards are O(1) and differ between
    sequences (a zero head would also zero LoRA's first gradient)."""
    d = model.config.hidden_size
    head = torch.nn.Linear(d, 1)
    torch.nn.init.normal_(head.weight, std=1 / math.sqrt(d))
    torch.nn.init.zeros_(head.bias)
    return head


def sequence_rewards(model: torch.nn.Module, head: torch.nn.Module, seqs: Sequences) -> torch.Tensor:
    """r(x, y) = w . h_last + b for each row of `seqs`: [N] float32."""
    out = forward(model, seqs.input_ids, seqs.attention_mask, 1, hidden_states=True)
    last = out.hidden_states[-1][torch.arange(seqs.input_ids.shape[0], device=seqs.input_ids.device),
                                 seqs.last_index]
    return head(last.float()).squeeze(-1)


def load(path: Path, device: torch.device):
    """(model, head, tokenizer, model config) of a reward model saved by algo=rm in RUN/final;
    the model config comes from RUN/config.yaml, so prompts are encoded as in training."""
    from omegaconf import OmegaConf
    from peft import PeftModel
    from safetensors.torch import load_file

    from rlnotes.config import ConfigError
    from rlnotes.models import load_base

    path = Path(path)
    config, weights = path.parent / "config.yaml", path / f"{HEAD}.safetensors"
    if not config.exists() or not weights.exists():
        raise ConfigError(f"reward.path={path} is not the final/ dir of an algo=rm run "
                          f"(it needs {weights.name} there and config.yaml beside it)")
    model_cfg = OmegaConf.load(config).model
    base, tokenizer = load_base(model_cfg)
    model = PeftModel.from_pretrained(base.to(device), path).eval().requires_grad_(False)
    head = make_head(base)
    head.load_state_dict(load_file(str(weights)))
    return model, head.to(device).eval().requires_grad_(False), tokenizer, model_cfg
