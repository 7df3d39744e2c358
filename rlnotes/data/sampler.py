"""The training prompts in batches: epoch-wise shuffled, deterministic in the seed, resumable."""

from __future__ import annotations

import random
from typing import Dict, List

from rlnotes.data.tasks import Row


class PromptSampler:
    """Epoch-wise shuffled batches of rows, deterministic in the seed; its position is its state."""

    def __init__(self, rows: List[Row], batch_size: int, seed: int):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> List[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def state_dict(self) -> Dict[str, int]:
        """The data position: the epoch (its shuffle is seeded by seed and epoch) and the row within it."""
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "rows": len(self.rows)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()

    def epochs_drawn(self) -> float:
        """Epochs of rows drawn so far: the epoch, and the share of it drawn."""
        return self.epoch + self.pos / max(len(self.rows), 1)

    def next_batch(self) -> List[Row]:
        if self.pos + self.batch_size > len(self.rows):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return [self.rows[i] for i in idx]
