"""The data cursor of an asynchronous run: it counts only prompts whose samples were trained on.

The rollouter hands prompts out ahead of the trainer and they finish out of order, so the
prompts trained on are not a prefix of the data order. At a stop, what is queued or in flight is
**dropped** and its prompts are given out again after the resume (the policy chosen: a sample
kept across a requeue would come back older than the staleness bound allows, since its weights'
version is behind the checkpoint's by the time the job runs again, and verl saves neither its
queue nor the prompts in flight either). The cursor saves the prompts trained on, as the lowest
prompt not yet trained plus those trained above it; a resumed run hands out every other prompt
of the epoch, lowest first, so each is trained as often as in an unbroken run.

The cursor works on positions in the epoch's prompt order (what `PromptLoader` yields); it
holds no data.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PromptCursor"]


class PromptCursor:
    """Prompts `0 .. size - 1` of one epoch: handed out, trained on, given back."""

    def __init__(self, size: int, done_below: int = 0, done_above: tuple[int, ...] = ()) -> None:
        self.size = size
        self.done_below = done_below
        """Every prompt below it was trained on."""
        self.done_above = set(done_above)
        """Prompts at or above `done_below` trained on."""
        self.out: set[int] = set()
        """Prompts handed out and not trained on (queued or in flight)."""
        self._next = done_below

    def next_free(self) -> bool:
        """Whether a prompt is left to hand out."""
        while self._next < self.size and (self._next in self.done_above or self._next in self.out):
            self._next += 1
        return self._next < self.size

    def next(self) -> int | None:
        """The lowest prompt neither trained on nor out, or None when none is left."""
        if not self.next_free():
            return None
        prompt, self._next = self._next, self._next + 1
        self.out.add(prompt)
        return prompt

    def trained(self, prompt: int) -> None:
        """`prompt`'s samples were trained on."""
        if prompt not in self.out:
            raise ValueError(f"prompt {prompt} was trained on without being handed out (or twice)")
        self.out.remove(prompt)
        self.done_above.add(prompt)
        while self.done_below in self.done_above:
            self.done_above.remove(self.done_below)
            self.done_below += 1

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the prompts trained on, and nothing of those out."""
        return {"size": self.size, "done_below": self.done_below, "done_above": sorted(self.done_above)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptCursor:
        """The cursor a resumed run starts with: every prompt not trained on is handed out again."""
        return cls(int(state["size"]), int(state["done_below"]), tuple(state["done_above"]))

    @property
    def finished(self) -> bool:
        return self.done_below >= self.size
