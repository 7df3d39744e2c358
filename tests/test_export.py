"""`rlnotes export`: a LoRA adapter merged into its base (or a fully fine-tuned model) saved as a plain
Hugging Face dir that transformers loads alone, with the same log-probs as the policy it came from."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rlnotes.commands.cli import main
from rlnotes.commands.export import export
from rlnotes.core.errors import ConfigError
from rlnotes.engine.policy.passes import sequence_logprobs
from rlnotes.engine.policy.policy import Policy
from tests.conftest import compose

TEXTS = ["Write the letter a.\naaa", "Write b: bb", "What is 3+4?\n7"]


def _trained_run(tmp_path: Path, *overrides: str) -> tuple[Path, Policy]:
    """A run dir as `rlnotes train` leaves it (config.yaml, final/), with weights moved away from
    their initial values so that a merge that dropped the adapter would be caught."""
    cfg = compose(*overrides)
    policy = Policy.from_config(cfg.model, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    policy.save(run / "final")
    return run, policy


def _logprobs(model, tokenizer) -> torch.Tensor:
    """Per-token log-probs of the last 4 tokens of TEXTS, left-padded as a batch."""
    tokenizer.padding_side = "left"
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return sequence_logprobs(model.eval(), batch.input_ids, batch.attention_mask, 4)


@pytest.mark.parametrize("overrides", [(), ("model.lora=null",)], ids=["lora", "full"])
def test_export_reloads_with_transformers_alone_and_same_logprobs(tmp_path, overrides):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, policy = _trained_run(tmp_path, *overrides)
    out = export(run / "final", tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "adapter_config.json" not in names and "rlnotes_config.yaml" in names

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert tokenizer(TEXTS[0]).input_ids == policy.tokenizer(TEXTS[0]).input_ids
    expected = _logprobs(policy.model, policy.tokenizer)
    torch.testing.assert_close(_logprobs(model, tokenizer), expected, atol=1e-5, rtol=0)
    if not overrides:  # the adapter changed the model: the base alone gives other log-probs
        with policy.model.disable_adapter():
            base = _logprobs(policy.model, policy.tokenizer)
        assert (base - expected).abs().max() > 1e-3


def test_export_keeps_the_chat_template(tmp_path):
    from transformers import AutoTokenizer

    run, policy = _trained_run(tmp_path)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    policy.tokenizer.chat_template = template
    policy.tokenizer.save_pretrained(run / "final")
    out = export(run / "final", tmp_path / "hf", dtype="bfloat16")
    reloaded = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == "<user>hi\n"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_export_errors_are_one_line(tmp_path, capsys):
    run, _ = _trained_run(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="already exists and is not an empty dir"):
        export(run / "final", tmp_path / "full")
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert main(["export", str(run / "final")]) == 2
    (run / "config.yaml").unlink()  # and an adapter that names no base (as older ones of the tiny model)
    adapter = run / "final" / "adapter_config.json"
    adapter.write_text(adapter.read_text().replace('"base_model_name_or_path": "tiny"',
                                                   '"base_model_name_or_path": null'))
    assert main(["export", str(run / "final"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("rlnotes: error: ") for line in err)
    assert "is not a directory" in err[0] and "required: OUT_DIR" in err[1] and "no config.yaml" in err[2]
    assert not (tmp_path / "out").exists()


def test_saved_and_exported_files_have_the_usual_modes(tmp_path):
    """safetensors writes 0600 and a temporary dir is 0700; a saved policy and an export are 0644/0755."""
    import os

    old = os.umask(0o022)
    try:
        run, _ = _trained_run(tmp_path)
        out = export(run / "final", tmp_path / "hf")
    finally:
        os.umask(old)
    for root in (run / "final", out):
        assert root.stat().st_mode & 0o777 == 0o755, root
        for f in root.iterdir():
            assert f.stat().st_mode & 0o777 == 0o644, f


def test_a_tiny_adapter_names_its_base_and_exports_without_its_run(tmp_path, monkeypatch):
    """adapter_config.json names the base as rlnotes loads it (model.name_or_path=tiny), so an adapter
    dir copied away from its run's config.yaml still exports; saving never asks the hub about "tiny"."""
    import json
    import shutil

    import peft.utils.save_and_load

    def no_hub(*args, **kwargs):
        raise AssertionError(f"hub lookup while saving: {args}")

    monkeypatch.setattr(peft.utils.save_and_load, "check_file_exists_on_hf_hub", no_hub)
    run, policy = _trained_run(tmp_path)
    assert json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
    alone = shutil.copytree(run / "final", tmp_path / "elsewhere" / "adapter")
    out = export(alone, tmp_path / "hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    expected = _logprobs(policy.model, policy.tokenizer)
    torch.testing.assert_close(_logprobs(model, AutoTokenizer.from_pretrained(out)), expected, atol=1e-5, rtol=0)


def _hashes(root: Path) -> dict:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("inside", ["final/merged", "checkpoints/merged", "interrupted/m", "eval/m"])
def test_an_export_into_a_policy_dir_or_a_runs_folders_is_refused(tmp_path, capsys, inside):
    """Before: `rlnotes export RUN/final RUN/final/merged` was accepted, and the next resume of the
    run deleted the export with final/ (checkpoints/ is pruned, interrupted/ replaced the same way)."""
    run, _ = _trained_run(tmp_path)
    before = _hashes(run)
    assert main(["export", str(run / "final"), str(run / inside)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlnotes: error: OUT_DIR {run / inside} is inside "), err
    assert err[0].endswith("and would go with it; choose an OUT_DIR outside it")
    assert _hashes(run) == before and not (run / inside).exists()


def test_exporting_a_run_dir_names_the_policy_to_pass(tmp_path, capsys):
    """Before: a traceback from the tokenizer loader, ending in advice to install sentencepiece."""
    run, _ = _trained_run(tmp_path)
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rlnotes: error: POLICY_DIR={run} is a run's dir, not a policy it saved; give {run / 'final'}"]
    assert not (tmp_path / "out").exists()


def test_export_says_where_it_wrote_on_one_line_when_piped(tmp_path, capsys):
    """stderr captured (not a terminal, where rich wraps at 80 columns): the line naming a long
    OUT_DIR keeps the path whole, so a log or CI output greps for it."""
    run, _ = _trained_run(tmp_path)
    out = tmp_path / ("an_output_dir_with_a_long_name_" * 4) / "model"
    assert main(["export", str(run / "final"), str(out)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith(f"exported {run / 'final'} ") and line.endswith(f"-> {out}") for line in lines), lines
    assert main(["export", str(run / "final"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    said = capsys.readouterr().err  # the merge is checked in float32: the line says so, not of the bf16 weights
    assert "merged log-probs match the adapter's to" in said and "before the weights were cast to bfloat16)" in said
