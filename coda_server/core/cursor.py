"""The prompt cursor: which prompts of each data source and epoch a Dispatch has admitted, kept by the server.

Prompt sources hand prompts out in (epoch, index) order, several workers at once, so what was admitted is
nearly a prefix: per (data source, epoch) the cursor keeps a low-water mark (every index below it was
admitted) and the indices admitted above it, so its size stays that of the gaps, not of the run. A prompt
whose ref carries no index is placed by the LoongSage form of its id (`epoch{E}_..._prompt{N}`); one with
neither is not tracked (remembering every id would grow every snapshot with the run). The cursor is in every journal
snapshot and every trainer checkpoint; a Restore puts back the checkpoint's, less the prompts that were in
flight then, so those and every prompt admitted after the checkpoint are offered again.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from .prompt_ids import LOONGSAGE_PROMPT_ID, loongsage_order
from .types import PromptRef


class PromptCursor:
    """The prompts admitted so far, per (ds_index, epoch), as a low-water mark plus the indices above it."""

    def __init__(self) -> None:
        self._marks: dict[tuple[int, int], list] = {}  # (ds_index, epoch) -> [below, set of indices >= below]
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @staticmethod
    def _key(ds_index: int, epoch: Optional[int], index: Optional[int], prompt_id: str) -> Optional[tuple]:
        """(ds_index, epoch, index) of a prompt, or None when it has no index (nor a LoongSage-form id)."""
        if index is None:
            order = loongsage_order(prompt_id)
            if order is None:
                return None
            epoch, index = order
        return ds_index, 0 if epoch is None else epoch, index

    def mark(self, ds_index: int, epoch: Optional[int], index: Optional[int], prompt_id: str) -> None:
        """The prompt was admitted."""
        self.mark_all((PromptRef(prompt_id, ds_index, epoch, index),))

    def mark_all(self, refs: Iterable[PromptRef]) -> None:
        """These prompts were admitted. Every admission runs this: one call per Dispatch, each prompt's key
        worked out in place (as `_key` does)."""
        marks = self._marks
        for ref in refs:
            epoch, index = ref.epoch, ref.index
            if index is None:
                order = LOONGSAGE_PROMPT_ID.fullmatch(ref.prompt_id)
                if order is None:  # not tracked
                    continue
                epoch, index = int(order.group(1)), int(order.group(2))
            elif epoch is None:
                epoch = 0
            mark = marks.get((ref.ds_index, epoch))
            if mark is None:
                mark = marks[(ref.ds_index, epoch)] = [0, set()]
            if index < mark[0] or index in mark[1]:
                continue
            self._count += 1
            if index != mark[0]:
                mark[1].add(index)
                continue
            below, above = index + 1, mark[1]
            while below in above:  # the admitted indices now reach further: fold them into the mark
                above.discard(below)
                below += 1
            mark[0] = below

    def unmark(self, ds_index: int, epoch: Optional[int], index: Optional[int], prompt_id: str) -> None:
        """The prompt is to be offered again (it was in flight at a checkpoint)."""
        key = self._key(ds_index, epoch, index, prompt_id)
        if key is None:
            return
        mark = self._marks.get(key[:2])
        index = key[2]
        if mark is None or not (index < mark[0] or index in mark[1]):
            return
        self._count -= 1
        if index in mark[1]:
            mark[1].discard(index)
            return
        mark[1].update(range(index + 1, mark[0]))  # below the mark: the mark drops to it, the rest stays admitted
        mark[0] = index

    def admitted(self, ds_index: int, epoch: Optional[int], index: Optional[int], prompt_id: str) -> bool:
        key = self._key(ds_index, epoch, index, prompt_id)
        if key is None:
            return False
        mark = self._marks.get(key[:2])
        return mark is not None and (key[2] < mark[0] or key[2] in mark[1])

    def export(self) -> dict[str, Any]:
        """Plain data (for snapshots, checkpoints and the wire): marks as (ds_index, epoch, below, above)."""
        return {"marks": [(ds, epoch, below, sorted(above))
                          for (ds, epoch), (below, above) in sorted(self._marks.items())]}

    @classmethod
    def restored(cls, exported: Optional[dict[str, Any]]) -> "PromptCursor":
        cursor = cls()
        cursor.restore(exported)
        return cursor

    def restore(self, exported: Optional[dict[str, Any]]) -> None:
        """Become the cursor `export()` described (a snapshot's, a checkpoint's); None: nothing admitted."""
        self._marks, self._count = {}, 0
        for ds_index, epoch, below, above in (exported or {}).get("marks", ()):
            self._marks[(ds_index, epoch)] = [below, set(above)]
            self._count += below + len(above)

    def copy_without(self, prompts: Iterable[tuple[int, Optional[int], Optional[int], str]]) -> "PromptCursor":
        """A copy with these (ds_index, epoch, index, prompt_id) unmarked."""
        copy = PromptCursor.restored(self.export())
        for prompt in prompts:
            copy.unmark(*prompt)
        return copy
