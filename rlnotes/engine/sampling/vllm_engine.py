"""rollout.engine=vllm: completions sampled by a vLLM engine colocated on this process's GPU.

Each step the policy's LoRA adapter, and only the adapter (the base weights never change), is
written to a RAM-backed dir and handed to vLLM as a new LoRA request; vLLM samples the batch
with it and returns the log-prob of every sampled token. The trainer then recomputes its own
log-probs of those tokens in one no-grad pass: the two engines' numerics differ (kernels,
precision), so the loss uses the trainer's, the difference is logged (sampler/*), and
rollout.tis_cap corrects the policy gradient for it (rlnotes.notes.tis).

Only the engine calls need vLLM and a GPU; building the request, exporting the adapter and
turning vLLM's outputs into a Rollout are plain functions, tested on CPU.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from rlnotes.engine.hardware import distributed
from rlnotes.engine.model.loading import SMOLLM2, smollm2_dir
from rlnotes.engine.policy.policy import embeddings_saved
from rlnotes.engine.rollout import Rollout, left_pad
from rlnotes.engine.sampling.episodes import EpisodeTokens, Respond, between_turns, budgets, episode_rollout
from rlnotes.engine.sampling.generate import mix32
from rlnotes.engine.sampling.settings import EpisodeLimits


@dataclass
class Sample:
    """One completion as vLLM returns it."""
    token_ids: List[int]
    logprobs: List[float]      # the sampled tokens' log-probs, one per token
    truncated: bool            # stopped by max_tokens (finish_reason "length"), not by EOS


def model_path(model_cfg) -> str:
    """The directory or hub id vLLM loads the base model from (SmolLM2: its converted cache dir)."""
    return str(smollm2_dir()) if model_cfg.name_or_path == SMOLLM2 else model_cfg.name_or_path


def export_adapter(policy, root: Path, step: int) -> Path:
    """The policy's LoRA adapter (adapter_config.json and adapter_model.safetensors, no base
    weights) written to root/step_N, the dir of the previous steps removed."""
    out = Path(root) / f"step_{step:06d}"
    for old in Path(root).glob("step_*"):
        if old != out:
            shutil.rmtree(old, ignore_errors=True)
    policy.model.save_pretrained(out, save_embedding_layers=embeddings_saved(policy.model))
    return out


def to_rollout(prompts: Sequence[Sequence[int]], samples: Sequence[Sequence[Sample]], pad_id: int,
               tokenizer, device: torch.device) -> Rollout:
    """A Rollout of vLLM's samples: `samples[i]` are prompt i's G completions. `logprobs` and
    `sampler_logprobs` both hold vLLM's until the trainer puts its own in `logprobs`."""
    group_size = len(samples[0])
    flat = [s for group in samples for s in group]
    width = max(max((len(s.token_ids) for s in flat), default=1), 1)
    ids = torch.full((len(flat), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(flat), width))
    logps = torch.zeros((len(flat), width))
    for i, s in enumerate(flat):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[i, :n] = 1.0
        logps[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    texts = tokenizer.batch_decode([s.token_ids for s in flat], skip_special_tokens=True)
    truncated = torch.tensor([s.truncated for s in flat])
    logps = logps.to(device)
    return Rollout(prompt_ids.repeat_interleave(group_size, 0).to(device),
                   prompt_mask.repeat_interleave(group_size, 0).to(device), ids.to(device), mask.to(device),
                   logps, texts, truncated.to(device), sampler_logprobs=logps.clone())


def _logprobs(completion) -> List[float]:
    """The log-prob vLLM gave each token it sampled (logprobs=0: the sampled token's alone)."""
    return [completion.logprobs[t][tok].logprob for t, tok in enumerate(completion.token_ids)]


class VLLMEngine:
    """A vLLM engine on this process's GPU, sampling with the policy's current LoRA adapter."""

    def __init__(self, cfg, tokenizer, stops: Sequence[int]):
        """`stops`: the ids that end a completion (generate.stop_ids of the policy)."""
        from vllm import LLM  # optional: vllm, only with rollout.engine=vllm

        lora = cfg.model.lora
        extra = {"distributed_executor_backend": "external_launcher"} if distributed.active() else {}
        self.llm = LLM(model=model_path(cfg.model), tokenizer=model_path(cfg.model), enable_lora=True,
                       max_lora_rank=lora.r, max_loras=1, gpu_memory_utilization=cfg.rollout.vllm_gpu_memory,
                       seed=cfg.seed + distributed.rank(), logprobs_mode="processed_logprobs",  # log softmax(z / T)
                       enable_prefix_caching=True, **extra)
        self.tokenizer, self.cfg, self.stops = tokenizer, cfg, list(stops)
        self.dir = Path(tempfile.mkdtemp(prefix="rlnotes-lora-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        self.step: Optional[int] = None
        self.request = None

    def sync(self, policy, step: int) -> None:
        """Hand the policy's adapter to vLLM, once per optimizer step."""
        if step == self.step:
            return
        from vllm.lora.request import LoRARequest  # optional: vllm

        if self.request is not None:
            self.llm.llm_engine.remove_lora(self.request.lora_int_id)
        path = export_adapter(policy, self.dir, step)
        self.request = LoRARequest(f"policy_step_{step}", step + 1, str(path))
        self.step = step

    def generate(self, prompts: Sequence[Sequence[int]], group_size: int, seeds: Optional[List[int]],
                 device: torch.device) -> Rollout:
        """group_size completions of each prompt; `seeds` (one per prompt) make each prompt's draw
        its own (rollout.per_prompt_seed), None leaves them to the engine's stream."""
        outputs = self._requests(prompts, group_size, [self.cfg.rollout.max_new_tokens] * len(prompts), seeds)
        samples = [[Sample(list(c.token_ids), _logprobs(c), c.finish_reason == "length") for c in out.outputs]
                   for out in outputs]
        return to_rollout(prompts, samples, self.tokenizer.pad_token_id, self.tokenizer, device)

    def _requests(self, sequences: Sequence[Sequence[int]], n: int, max_tokens: Sequence[int],
                  seeds: Optional[List[int]]) -> list:
        """vLLM's outputs of one request per sequence, n samples each, at most max_tokens[i] tokens."""
        from vllm import SamplingParams  # optional: vllm
        from vllm.inputs import TokensPrompt  # optional: vllm

        r = self.cfg.rollout
        params = [SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, max_tokens=int(m), logprobs=0,
                                 stop_token_ids=self.stops, seed=None if seeds is None else seeds[i])
                  for i, m in enumerate(max_tokens)]
        return self.llm.generate([TokensPrompt(prompt_token_ids=list(q)) for q in sequences], params,
                                 lora_request=self.request, use_tqdm=False)

    def generate_episodes(self, prompts: Sequence[Sequence[int]], group_size: int, respond: Respond,
                          limits: EpisodeLimits, seeds: Optional[torch.Tensor], device: torch.device) -> Rollout:
        """Multi-turn episodes (rlnotes.engine.sampling.episodes) sampled by vLLM: each round, every running
        episode's whole sequence so far is one request, and vLLM's prefix cache keeps the keys and
        values of what it has seen, so a round computes the new observation and turn. `seeds` (one
        per episode, rollout.per_prompt_seed) seed each turn's draw with the turn's number."""
        budget = budgets(prompts, group_size, limits.max_episode_tokens, None)
        per_turn = self.cfg.rollout.max_new_tokens
        starts = [list(p) for p in prompts for _ in range(group_size)]
        episodes = [EpisodeTokens() for _ in starts]
        running = list(range(len(starts)))
        while running:
            room = [min(per_turn, budget[i] - len(episodes[i].ids)) for i in running]
            turn_seeds = None if seeds is None else [int(mix32(seeds[i] ^ episodes[i].turns)) for i in running]
            outputs = self._requests([starts[i] + episodes[i].ids for i in running], 1, room, turn_seeds)
            for i, out in zip(running, (o.outputs[0] for o in outputs)):
                ep = episodes[i]
                ep.turns += 1
                ep.ids += list(out.token_ids)
                ep.model_mask += [1.0] * len(out.token_ids)
                ep.logps += _logprobs(out)
                ep.truncated = not out.token_ids or out.token_ids[-1] not in self.stops  # cut
            running = sorted(between_turns(episodes, running, respond, limits.max_turns, budget))
        prompt_ids, prompt_mask = left_pad(starts, self.tokenizer.pad_token_id)
        rollout = episode_rollout(self.tokenizer, prompt_ids, prompt_mask, episodes, device)
        rollout.sampler_logprobs = rollout.logprobs.clone()
        return rollout

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
