"""The policy/reference pair.

Policy = base model + LoRA adapter; reference = the same base with the adapter disabled, so
there is one copy of the weights. Without LoRA (`model.lora=null`) every weight trains and a
frozen copy serves as the reference. Its log-probs are the passes of rlnotes.engine.policy.passes.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Dict, Iterator, Optional

import torch

from rlnotes.engine.hardware.fsdp import is_sharded
from rlnotes.engine.model.loading import check_lora, load_base, usual_modes
from rlnotes.engine.model.precision import frozen_linears_to_bf16
from rlnotes.engine.model.sources import check_policy_dir
from rlnotes.engine.policy.merged import lora_slots, merged_adapters
from rlnotes.engine.policy.packed import packed_linears
from rlnotes.engine.policy.passes import sequence_logprobs


class Policy:
    """A trainable policy and its fixed reference, sharing one base model when LoRA is on."""

    def __init__(self, model: torch.nn.Module, tokenizer, reference: Optional[torch.nn.Module] = None,
                 share_prompts: bool = True):
        self.model, self.tokenizer, self._reference = model, tokenizer, reference
        self.uses_lora = reference is None
        self._modules: list = []      # the policy's modules, whose training flag train() sets (listed on first use)
        self._lora_layers: list = []  # the adapter's layers, which reference() switches off (found on first use)
        self._slots: Optional[list] = None  # the LoRA linear layers and their parents, which sampling() merges
        # Rows with the same prompt forward it once (trainer.shared_prompt; see completion_states).
        self.share_prompts = share_prompts

    @classmethod
    def from_config(cls, cfg, device: torch.device, share_prompts: bool = True) -> "Policy":
        """The policy of the model section `cfg`, its reference beside it; `share_prompts`:
        trainer.shared_prompt (rows with the same prompt forward it once)."""
        base, tokenizer = load_base(cfg)
        base.to(device)
        if cfg.lora is None:
            reference = copy.deepcopy(base).eval().requires_grad_(False)
            return cls(base, tokenizer, reference, share_prompts)
        from peft import LoraConfig, get_peft_model

        check_lora(base, cfg.lora)
        targets = list(cfg.lora.target_modules)
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=targets[0] if targets == ["all-linear"] else targets,
                          task_type="CAUSAL_LM")
        return cls(get_peft_model(base, lora), tokenizer, share_prompts=share_prompts)

    @classmethod
    def from_saved(cls, cfg, path: Path, device: torch.device) -> "Policy":
        """A saved policy (for evaluation): a LoRA adapter dir on top of `cfg`'s base model, or a full
        model dir (a run with model.lora=null). The reference is not loaded."""
        path = Path(path)
        check_policy_dir(path)
        if (path / "adapter_config.json").is_file():
            from peft import PeftModel

            base, tokenizer = load_base(cfg)
            model = PeftModel.from_pretrained(base.to(device), str(path))
        else:
            from omegaconf import OmegaConf

            model, tokenizer = load_base(OmegaConf.merge(cfg, {"name_or_path": str(path)}))
            model.to(device)
        return cls(model.eval(), tokenizer, reference=model)

    def store_frozen_in_bf16(self) -> None:
        """hardware.precision=bf16: the linear weights that do not train (the base model's under LoRA,
        the reference copy's without it) stored in bf16, LoRA and every trainable weight in float32
        (rlnotes.engine.model.precision)."""
        for model in {id(m): m for m in (self.model, self._reference) if m is not None}.values():
            frozen_linears_to_bf16(model)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference model: the base with the adapter disabled, or the frozen copy."""
        if self.uses_lora:
            # What peft's model.disable_adapter() does, on the adapter layers found once: it walks
            # every module twice and takes the adapters' status every call (a tenth of a tiny step).
            layers = self._lora_layers or self._find_lora_layers()
            for layer in layers:
                layer.enable_adapters(False)
            try:
                yield self.model
            finally:
                for layer in layers:
                    layer.enable_adapters(True)
        else:
            yield self._reference

    @contextlib.contextmanager
    def sampling(self, merge: bool = True, pack: bool = True) -> Iterator[torch.nn.Module]:
        """The model to sample with: the policy, its LoRA layers merged into copies of their weights
        (over bf16 weights, the update added to the output instead; rlnotes.engine.policy.merged) unless
        `merge` is off, and its large linear layers on the CPU through copies packed for oneDNN
        (rlnotes.engine.policy.packed) unless `pack` is off: the same outputs up to rounding, faster
        token by token. Neither where FSDP shards the weights."""
        if is_sharded(self.model):
            yield self.model
            return
        if merge and self._slots is None:
            self._slots = lora_slots(self.model)
        with merged_adapters(self._slots if merge else []), \
                packed_linears(self.model) if pack else contextlib.nullcontext():
            yield self.model

    def _find_lora_layers(self) -> list:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self._lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        return self._lora_layers

    def train(self, mode: bool = True) -> None:
        """model.train(mode) (eval: mode=False), the flag set on the modules listed once: the model's
        own train() walks the module tree on every call, twice a step, a cost a tiny step notices."""
        self._modules = self._modules or list(self.model.modules())
        for module in self._modules:
            module.training = mode

    def eval(self) -> None:
        self.train(False)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def logprobs(self, input_ids, attention_mask, n_completion, temperature=1.0) -> torch.Tensor:
        return sequence_logprobs(self.model, input_ids, attention_mask, n_completion, temperature, self.share_prompts)

    @torch.no_grad()
    def ref_logprobs(self, input_ids, attention_mask, n_completion, temperature=1.0) -> torch.Tensor:
        """log pi_ref of the last n_completion tokens of each row: the reference evaluated (no dropout),
        also between two training passes of the policy (DPO's micro-batches), which train on after it."""
        training = self.model.training
        if training:
            self.eval()
        try:
            with self.reference() as ref:
                return sequence_logprobs(ref, input_ids, attention_mask, n_completion, temperature, self.share_prompts)
        finally:
            if training:
                self.train()

    def save(self, path: Path, state_dict: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """A peft adapter dir (LoRA) or a full model dir, with the tokenizer beside it; `state_dict`:
        the whole weights FSDP gathered from the ranks' shards (else the model's own)."""
        if self.uses_lora:
            self.model.save_pretrained(path, state_dict=state_dict, save_embedding_layers=embeddings_saved(self.model))
        else:
            self.model.save_pretrained(path, state_dict=state_dict)
        self.tokenizer.save_pretrained(path)
        usual_modes(path)


def embeddings_saved(model) -> bool | str:
    """peft's save_embedding_layers: "auto" (saved) when LoRA adapts an embedding, else False. peft's
    own "auto" would otherwise look the base model up on the hub by its name (tiny too) to see
    whether the vocabulary grew, at every save; rlnotes never resizes it."""
    from peft.utils.constants import EMBEDDING_LAYER_NAMES

    targets = model.peft_config["default"].target_modules
    names = [targets] if isinstance(targets, str) else list(targets or [])
    return "auto" if any(n.split(".")[-1] in EMBEDDING_LAYER_NAMES for n in names) else False
