"""KV cache layers: which layouts rows can be selected from and passes added to, and a layer that
decoding writes into in place.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A KV cache layer whose keys and values are views of buffers with room for more positions, so
    a decoding step writes its one new position in place instead of copying the whole cache (what
    DynamicLayer's torch.cat does, every layer, every step). The buffers grow by `room` positions
    when full. Rows are selected or repeated as in DynamicLayer; other cache operations (crop,
    reorder) are not kept in step with the buffers. For sampling without gradients: the writes are
    in place."""

    def __init__(self, room: int):
        super().__init__()
        self.room = max(room, 1)
        self.buffers: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used, new = self.get_seq_length(), key_states.shape[-2]
        if self.buffers is None or used + new > self.buffers[0].shape[-2]:  # room for the new positions and more
            grown = [s.new_empty(*s.shape[:2], used + new + self.room, s.shape[-1]) for s in (key_states, value_states)]
            for buffer, old in zip(grown, (self.keys, self.values) if used else ()):
                buffer[:, :, :used] = old
            self.buffers = tuple(grown)
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[:, :, used:used + new] = states
        self._view(used + new)
        return self.keys, self.values

    def _view(self, used: int) -> None:
        self.keys, self.values = (b[:, :, :used] for b in self.buffers)

    def _rows(self, take) -> None:
        """The buffers' rows as `take` (a function of a buffer) picks them, room included."""
        used = self.get_seq_length()
        if used:
            self.buffers = tuple(take(b) for b in self.buffers)
            self._view(used)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda b: b.index_select(0, indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda b: b.repeat_interleave(repeats, dim=0))


def plain_layers(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` keeps each row's keys and values whole (no sliding windows): the
    layout that rows can be selected from and passes added to."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep `rows` [R] of every layer of `cache` (plain_layers), in that order, a row any number of
    times. By index_select, whose gradient adds the copies' up with index_add: DynamicLayer's own
    batch_select_indices indexes, whose gradient accumulates through index_put, ~9x slower on a CPU
    (0.54 against 0.06 ms a layer's keys for a DPO micro-batch of SmolLM2)."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        else:
            layer.batch_select_indices(rows)
