"""Shared fixtures: the tiny model and configs built in code, so no test touches a hub."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The console script beside this Python: found whether or not its venv's bin/ is on PATH.
RLNOTES = str(Path(sys.executable).with_name("rlnotes"))


def pytest_collection_modifyitems(items):
    """The tests marked `long` (seconds each: most start processes) go first, so that the workers
    of `make test` (pytest-xdist, --dist worksteal) end together on short tests, not with one
    worker idle while the other runs a long test collected last."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


def pytest_collection_finish(session):
    """Everything collection imported (torch, transformers, every test module: ~0.5 M objects)
    leaves the garbage collector's view: a full collection walks it all, ~0.3 s each, and the
    suite's hundreds of composed configs set one off every ten commands or so."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are far faster on one thread; tests never depend on the thread count."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _float32_packs(monkeypatch):
    """oneDNN's float32 packs in use on every CPU (not on Intel's by default: packed.float32_packs),
    so the tests multiply the same way everywhere; test_packed checks the rule itself."""
    from rlnotes.engine.policy import packed

    monkeypatch.setattr(packed, "float32_packs", lambda: True)


@pytest.fixture
def bf16_cpu(monkeypatch):
    """hardware.precision=bf16 accepted on this CPU: on one without bf16 units (where a run refuses
    it) the same roundings run emulated, only slower (a matmul may sum in another order)."""
    from rlnotes.engine.hardware import devices

    if devices.bf16_units(torch.device("cpu")) is None:
        monkeypatch.setattr(devices, "bf16_units", lambda device: "emulated")


def compose(*overrides: str):
    """The composed, validated train config for `overrides`, as `rlnotes train` would build it."""
    from rlnotes.commands.check import check, loader
    from rlnotes.commands.hydra import compose as compose_config

    check(list(overrides), multirun=False, config_dir=None)
    from omegaconf import open_dict

    cfg = compose_config(loader(None), list(overrides))
    from rlnotes.commands.validate import resolve_auto

    with open_dict(cfg):
        del cfg["hydra"]  # as a Hydra job sees it
    resolve_auto(cfg)
    return cfg


def set_step(name: str, fn) -> None:
    """Make the algorithm `name` run `fn` as its train_step (for tests that stop a run inside a
    step); `set_step(name, module.train_step)` puts the real one back."""
    import dataclasses

    from rlnotes.algos.registry import REGISTRY

    REGISTRY[name] = dataclasses.replace(REGISTRY[name], train_step=fn)


def record_forwards(monkeypatch) -> list:
    """The [rows, tokens] of every forward pass from here on (rlnotes.engine.policy.passes.states: the
    model's forward or rlnotes' own pass), or of each level of a pass of several (LlamaLayers.tree),
    appended to the list returned."""
    from rlnotes.engine.policy import passes
    from rlnotes.engine.policy.llama import LlamaLayers

    seen, states, tree = [], passes.states, LlamaLayers.tree

    def spy(model, input_ids, *args, **kwargs):
        seen.append(tuple(input_ids.shape))
        return states(model, input_ids, *args, **kwargs)

    def tree_spy(self, levels):
        seen.extend(tuple(level.ids.shape) for level in levels)
        return tree(self, levels)

    monkeypatch.setattr(passes, "states", spy)
    monkeypatch.setattr(LlamaLayers, "tree", tree_spy)
    return seen


def record_passes(monkeypatch) -> list:
    """The sizes of every cut the token budget makes from here on (lists of chunk sizes, one per
    batch or minibatch cut), recorded around rlnotes.training.batching.micro_batches."""
    from rlnotes.training import batching, offline

    cuts, real = [], batching.micro_batches

    def recorded(n, size, budget=None, tokens=None, most=None):
        chunks = real(n, size, budget, tokens, most)
        if budget is not None and not size:
            cuts.append([len(c) for c in chunks])
        return chunks

    monkeypatch.setattr(batching, "micro_batches", recorded)
    monkeypatch.setattr(offline, "micro_batches", recorded)
    return cuts
