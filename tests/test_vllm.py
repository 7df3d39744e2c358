"""rollout.engine=vllm on CPU: everything but the engine call (no GPU, no vllm package needed).

The truncated importance-sampling weights against hand values, the config checks, the adapter
export, the Rollout built from vLLM's outputs, and a GRPO run whose 'vLLM' is a stand-in that
samples with the policy and reports log-probs off by a known amount.
"""

import json
import math

import pytest
import torch
from omegaconf import open_dict

from rlnotes.commands.cli import main
from rlnotes.engine.sampling.vllm_engine import Sample, export_adapter, to_rollout
from rlnotes.notes.tis import truncated_is_weights


def test_truncated_is_weights_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))  # ratios 2, 0.5, 3
    w = truncated_is_weights(logp.requires_grad_(), sampler, cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5]]))
    assert not w.requires_grad
    assert truncated_is_weights(torch.tensor([50.0]), torch.tensor([-50.0]), 2.0).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="cap=0.5 must be at least 1"):
        truncated_is_weights(logp, sampler, 0.5)


def test_vllm_outputs_become_a_rollout():
    from rlnotes.engine.model.loading import tiny_tokenizer

    tok = tiny_tokenizer()
    a, b = tok("ab")["input_ids"], tok("b")["input_ids"]
    samples = [[Sample(a + [tok.eos_token_id], [-0.1, -0.2, -0.3], False), Sample(a, [-1.0, -2.0], True)],
               [Sample(b + [tok.eos_token_id], [-0.5, -0.6], False), Sample(b, [-0.7], True)]]
    r = to_rollout([[5, 6, 7], [8]], samples, tok.pad_token_id, tok, torch.device("cpu"))
    assert r.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]]
    assert r.prompt_mask.tolist() == [[1, 1, 1]] * 2 + [[0, 0, 1]] * 2  # left-padded, each prompt G times
    assert r.texts == ["ab", "ab", "b", "b"] and r.truncated.tolist() == [False, True, False, True]
    torch.testing.assert_close(r.sampler_logprobs[1], torch.tensor([-1.0, -2.0, 0.0]))
    assert r.sampler_logprobs is not r.logprobs and torch.equal(r.sampler_logprobs, r.logprobs)
    torch.testing.assert_close(r.select(torch.tensor([3])).sampler_logprobs, torch.tensor([[-0.7]]))


def test_only_the_adapter_is_exported(tmp_path, monkeypatch):
    """Each sync writes the adapter alone, and never asks the hub about the base model's name."""
    import peft.utils.save_and_load
    from peft import PeftModel

    from rlnotes.engine.model.loading import load_base
    from rlnotes.engine.policy.policy import Policy
    from tests.conftest import compose

    def no_hub(*args, **kwargs):
        raise AssertionError(f"hub lookup while exporting: {args}")

    monkeypatch.setattr(peft.utils.save_and_load, "check_file_exists_on_hf_hub", no_hub)
    cfg = compose()
    policy = Policy.from_config(cfg.model, torch.device("cpu"))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    first = export_adapter(policy, tmp_path, 0)
    out = export_adapter(policy, tmp_path, 1)
    assert not first.exists() and sorted(f.name for f in out.iterdir()) == ["README.md", "adapter_config.json",
                                                                           "adapter_model.safetensors"]
    base, _ = load_base(cfg.model)
    loaded = PeftModel.from_pretrained(base, out)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(loaded(ids).logits, policy.model(ids).logits)


@pytest.mark.parametrize("overrides, gpu, message", [
    (("rollout.engine=vllm",), False, "rollout.engine=vllm runs on a GPU and torch sees none here"),
    (("rollout.engine=vllm", "hardware=cuda"), True, "needs the vllm package; install it with: pip install "
     "'rlnotes[vllm]'"),
    (("rollout.tis_cap=2",), False, "rollout.tis_cap corrects for vLLM's sampling log-probs"),
    (("rollout.engine=fast",), False, "rollout.engine='fast' is not valid; choose one of: hf, vllm"),
])
def test_vllm_settings_that_cannot_work_fail_in_one_line(monkeypatch, capsys, overrides, gpu, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlnotes: error: ") and message in err and "\n" not in err, err


@pytest.mark.parametrize("overrides, message", [
    (("model.lora=null", "model=smollm2-135m"), "sends the LoRA adapter to vLLM each step"),
    ((), "model=tiny is built in code"),
])
def test_vllm_needs_a_lora_policy_it_can_load(monkeypatch, capsys, overrides, message):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert main(["train", "rollout.engine=vllm", "hardware=cuda", *overrides]) == 2
    assert message in capsys.readouterr().err


class StandIn:
    """vLLM's place in a run on CPU: samples with the policy itself and reports log-probs `offset`
    below the true ones, as a sampler with other numerics would."""
    offset = 0.05

    def __init__(self, cfg, tokenizer, stops):
        self.cfg, self.synced = cfg, []

    def sync(self, policy, step):
        self.policy = policy
        self.synced.append(step)

    def generate(self, prompts, group_size, seeds, device):
        from rlnotes.engine.sampling.generate import generate
        from rlnotes.engine.sampling.settings import SamplingSettings

        r, c = self.policy, self.cfg.rollout
        rollout = generate(r.model, r.tokenizer, prompts, group_size, SamplingSettings.of(c),
                           torch.Generator().manual_seed(seeds[0] if seeds else 0))
        rollout.sampler_logprobs = (rollout.logprobs - self.offset) * rollout.completion_mask
        return rollout

    def close(self):
        pass


def test_a_run_with_another_sampler_logs_the_mismatch_and_corrects_for_it(tmp_path, monkeypatch):
    from rich.console import Console

    from rlnotes.commands.train import train
    from tests.conftest import compose

    monkeypatch.setattr("rlnotes.engine.sampling.vllm_engine.VLLMEngine", StandIn)
    rows = {}
    for tis_cap in (None, 1.02):
        cfg = compose("trainer.steps=2", "trainer.batch_size=4", "logging.progress=false")
        with open_dict(cfg):
            cfg.rollout.engine, cfg.rollout.tis_cap = "vllm", tis_cap  # past the GPU check, as on a GPU machine
        train(cfg, tmp_path / str(tis_cap), Console(quiet=True))
        rows[tis_cap] = [json.loads(line) for line in (tmp_path / str(tis_cap) / "metrics.jsonl").open()]
    plain, capped = rows[None][0], rows[1.02][0]
    assert plain["sampler/mismatch"] == pytest.approx(StandIn.offset, abs=1e-5)
    assert plain["sampler/logprob_trainer"] - plain["sampler/logprob_vllm"] == pytest.approx(StandIn.offset, abs=1e-5)
    assert "time/old_logprobs_s" in plain and "sampler/tis_clip_frac" not in plain
    # Every token's weight is exp(0.05) > 1.02: all capped, so the policy-gradient term is 1.02 x the plain one.
    assert capped["sampler/tis_clip_frac"] == 1.0
    assert capped["reward/mean"] == plain["reward/mean"]  # the same samples
    assert capped["optim/grad_norm"] != pytest.approx(plain["optim/grad_norm"], rel=1e-3)
    assert math.isfinite(capped["loss"])


class FakeLLM:
    """vLLM's LLM.generate on CPU: each request sampled by the policy itself (rlnotes' generate),
    answered in vLLM's output shapes. Records every request's token ids."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.requests = model, tokenizer, []

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        from types import SimpleNamespace as NS

        from rlnotes.engine.sampling.generate import generate
        from rlnotes.engine.sampling.settings import SamplingSettings

        outs = []
        for prompt, p in zip(prompts, params):
            self.requests.append(list(prompt["prompt_token_ids"]))
            r = generate(self.model, self.tokenizer, [prompt["prompt_token_ids"]], p["n"],
                         SamplingSettings(p["max_tokens"], p["temperature"], p["top_p"]),
                         torch.Generator().manual_seed(p["seed"] or 0), eos_ids=p["stop_token_ids"])
            completions = []
            for k, ids in enumerate(r.token_lists()):
                logps = [{t: NS(logprob=float(lp))} for t, lp in zip(ids, r.logprobs[k].tolist())]
                completions.append(NS(token_ids=ids, logprobs=logps,
                                      finish_reason="length" if bool(r.truncated[k]) else "stop"))
            outs.append(NS(outputs=completions))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    """The two names of the vllm package that building requests needs, as plain dicts."""
    import sys
    from types import ModuleType

    vllm, inputs = ModuleType("vllm"), ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kw: kw
    inputs.TokensPrompt = lambda **kw: kw
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def test_vllm_stops_at_the_policys_stop_ids(fake_vllm):
    """vLLM is asked to stop at every stop id of the policy (generate.stop_ids), and a turn that
    ends at one that is not the tokenizer's EOS is not taken for a cut one."""
    from types import SimpleNamespace as NS

    from omegaconf import OmegaConf

    from rlnotes.core.schema import RolloutConfig
    from rlnotes.engine.model.loading import tiny_tokenizer
    from rlnotes.engine.sampling.settings import EpisodeLimits
    from rlnotes.engine.sampling.vllm_engine import VLLMEngine

    tok = tiny_tokenizer()
    asked = []

    def answer(prompts, params, lora_request=None, use_tqdm=False):  # every request ends at id 7
        asked.extend(params)
        return [NS(outputs=[NS(token_ids=[5, 7], logprobs=[{5: NS(logprob=-1.0)}, {7: NS(logprob=-0.5)}],
                               finish_reason="stop")]) for _ in prompts]

    engine = object.__new__(VLLMEngine)
    engine.llm, engine.tokenizer, engine.request, engine.stops = NS(generate=answer), tok, None, [tok.eos_token_id, 7]
    engine.cfg = OmegaConf.create({"rollout": OmegaConf.structured(RolloutConfig(max_new_tokens=6))})
    r = engine.generate_episodes([[10, 11]], 2, lambda rows, turns, last: [None] * len(rows), EpisodeLimits(2, 40),
                                 None, torch.device("cpu"))
    assert all(p["stop_token_ids"] == [tok.eos_token_id, 7] for p in asked)
    assert not r.truncated.any()


def test_vllm_samples_multi_turn_episodes_through_its_prefix_cache(fake_vllm):
    from omegaconf import OmegaConf

    from rlnotes.core.schema import RolloutConfig, TinyModelConfig
    from rlnotes.engine.model.loading import tiny_model, tiny_tokenizer
    from rlnotes.engine.policy.passes import sequence_logprobs
    from rlnotes.engine.prompts import encode_prompts
    from rlnotes.engine.sampling.generate import completion_seeds
    from rlnotes.engine.sampling.settings import EpisodeLimits
    from rlnotes.engine.sampling.vllm_engine import VLLMEngine

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = tiny_model(OmegaConf.structured(TinyModelConfig()), len(tok)).eval()
    with torch.no_grad():  # turns that end: EOS as likely as a common character, thrice over
        model.lm_head.weight[tok.eos_token_id] = 3 * model.lm_head.weight[75]
    engine = object.__new__(VLLMEngine)
    engine.llm, engine.tokenizer, engine.request, engine.stops = FakeLLM(model, tok), tok, None, [tok.eos_token_id]
    engine.cfg = OmegaConf.create({"rollout": OmegaConf.structured(RolloutConfig(max_new_tokens=6))})
    observation = tok("\nuser: go on\nassistant:", add_special_tokens=False)["input_ids"]
    told = []

    def respond(rows, turns, last):
        told.extend(zip(rows, turns))
        return [observation for _ in rows]

    prompts = encode_prompts(tok, ["Write the letter a:", "Hi"], chat_template=False)
    seeds = completion_seeds(0, (0, 0), torch.arange(2), 3)
    r = engine.generate_episodes(prompts, 3, respond, EpisodeLimits(3, 40), seeds, torch.device("cpu"))
    model_tokens, real = r.completion_mask.bool(), r.completion_attn.bool()
    assert (real & ~model_tokens).any() and int(real.sum(-1).max()) <= 40
    # each request is the episode's whole sequence so far: the prompt, its turns and observations
    for request in engine.llm.requests:
        assert any(request[:len(p)] == p for p in prompts)
    # vLLM's log-probs are those of the tokens it sampled; the trainer's forward agrees with them
    again = sequence_logprobs(model, r.input_ids, r.attention_mask, r.completion_ids.shape[1])
    torch.testing.assert_close(again * r.completion_mask, r.sampler_logprobs, atol=2e-5, rtol=0)
    assert (r.sampler_logprobs[real & ~model_tokens] == 0).all()
    assert len(told) > 6  # several rounds: turns that ended were answered
    # single turn through the same requests: G samples of each prompt, vLLM's log-probs kept aside
    one = engine.generate(prompts, 3, [5, 6], torch.device("cpu"))
    assert len(one) == 6 and one.sampler_logprobs is not None
    again = sequence_logprobs(model, one.input_ids, one.attention_mask, one.completion_ids.shape[1])
    torch.testing.assert_close(again * one.completion_mask, one.sampler_logprobs, atol=2e-5, rtol=0)


def test_a_multi_turn_run_samples_with_vllm(tmp_path, monkeypatch, fake_vllm):
    from rich.console import Console

    from rlnotes.commands.train import train
    from rlnotes.engine.sampling import vllm_engine
    from tests.conftest import compose

    class Engine(vllm_engine.VLLMEngine):
        def __init__(self, cfg, tokenizer, stops):
            self.cfg, self.tokenizer, self.stops, self.request, self.step = cfg, tokenizer, stops, None, None

        def sync(self, policy, step):
            self.llm = FakeLLM(policy.model, self.tokenizer)

        def close(self):
            pass

    monkeypatch.setattr("rlnotes.engine.sampling.vllm_engine.VLLMEngine", Engine)
    cfg = compose("trainer.steps=2", "trainer.batch_size=4", "logging.progress=false", "rollout=multi_turn",
                  "rollout.env=letters", "rollout.max_turns=2", "rollout.max_new_tokens=6",
                  "rollout.max_episode_tokens=64", "reward=env")
    with open_dict(cfg):
        cfg.rollout.engine = "vllm"  # past the GPU check, as on a GPU machine
    train(cfg, tmp_path, Console(quiet=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert len(rows) == 2 and all("episode/turns" in r for r in rows)
    assert rows[0]["sampler/mismatch"] == pytest.approx(0.0, abs=1e-5)  # the stand-in samples with the policy
