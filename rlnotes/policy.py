"""The policy/reference pair and per-token log-probs.

Policy = base model + LoRA adapter; reference = the same base with the adapter disabled, so
there is one copy of the weights. Without LoRA (`model.lora=null`) every weight trains and a
frozen copy serves as the reference.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from rlnotes.models import load_base, usual_modes


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk: int = 8) -> torch.Tensor:
    """log softmax(logits / T)[token] for logits [B,T,V] and tokens [B,T] -> [B,T] (float32).

    A few rows at a time, so only a chunk's [rows,T,V] log-softmax exists at once; the fused
    log_softmax kernel and its backward are 2-3x faster here than logit - logsumexp(logit).
    """
    out = []
    for lg, tk in zip(logits.split(chunk), tokens.split(chunk)):
        lg = lg.float() if temperature == 1.0 else lg.float() / temperature
        out.append(F.log_softmax(lg, dim=-1).gather(-1, tk.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
            hidden_states: bool = False):
    """One forward pass over [left-padded prompt | completion] rows, with position ids that follow
    the attention mask and logits for the last `logits_to_keep` positions only."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                 use_cache=False, logits_to_keep=logits_to_keep, output_hidden_states=hidden_states)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n_completion: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, n_completion] of the last `n_completion` tokens of each row.

    Rows are [left-padded prompt | completion]; position ids follow the attention mask so
    padding never shifts positions, and only the completion positions reach the LM head.
    """
    logits = forward(model, input_ids, attention_mask, n_completion + 1).logits[:, :-1]
    return token_logprobs(logits, input_ids[:, -n_completion:], temperature)


class Policy:
    """A trainable policy and its fixed reference, sharing one base model when LoRA is on."""

    def __init__(self, model: torch.nn.Module, tokenizer, reference: Optional[torch.nn.Module] = None):
        self.model, self.tokenizer, self._reference = model, tokenizer, reference
        self.uses_lora = reference is None

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "Policy":
        base, tokenizer = load_base(cfg)
        base.to(device)
        if cfg.lora is None:
            reference = copy.deepcopy(base).eval().requires_grad_(False)
            return cls(base, tokenizer, reference)
        from peft import LoraConfig, get_peft_model

        targets = list(cfg.lora.target_modules)
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=targets[0] if targets == ["all-linear"] else targets,
                          task_type="CAUSAL_LM")
        return cls(get_peft_model(base, lora), tokenizer)

    @classmethod
    def from_saved(cls, cfg, path: Path, device: torch.device) -> "Policy":
        """A saved policy (for evaluation): a LoRA adapter dir on top of `cfg`'s base model, or a full
        model dir (a run with model.lora=null). The reference is not loaded."""
        path = Path(path)
        if (path / "adapter_config.json").is_file():
            from peft import PeftModel

            base, tokenizer = load_base(cfg)
            model = PeftModel.from_pretrained(base.to(device), str(path))
        else:
            from omegaconf import OmegaConf

            model, tokenizer = load_base(OmegaConf.merge(cfg, {"name_or_path": str(path)}))
            model.to(device)
        return cls(model.eval(), tokenizer, reference=model)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference model: the base with the adapter disabled, or the frozen copy."""
        if self.uses_lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self._reference

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logprobs(self, input_ids, attention_mask, n_completion, temperature=1.0) -> torch.Tensor:
        return sequence_logprobs(self.model, input_ids, attention_mask, n_completion, temperature)

    @torch.no_grad()
    def ref_logprobs(self, input_ids, attention_mask, n_completion, temperature=1.0) -> torch.Tensor:
        with self.reference() as ref:
            return sequence_logprobs(ref, input_ids, attention_mask, n_completion, temperature)

    def save(self, path: Path) -> None:
        """A peft adapter dir (LoRA) or a full model dir, with the tokenizer beside it."""
        if self.uses_lora:
            self.model.save_pretrained(path, save_embedding_layers=_embeddings_saved(self.model))
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        usual_modes(path)


def _embeddings_saved(model) -> bool | str:
    """peft's save_embedding_layers: "auto" (saved) when LoRA adapts an embedding, else False. peft's
    own "auto" would otherwise look the base model up on the hub by its name (tiny too) to see
    whether the vocabulary grew, at every save; rlnotes never resizes it."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    targets = model.peft_config["default"].target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    return "auto" if any(n.split(".")[-1] in EMBEDDING_LAYER_NAMES for n in names) else False
