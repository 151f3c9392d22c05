"""LoongSage's prompt-id form, `epoch{E}_..._prompt{N}`, read for the buffer order it implies."""
from __future__ import annotations

import re
from typing import Optional

# LoongSage names a prompt group e.g. "epoch0_step1_ds0_prompt116" (or "..._ds0_eval_prompt3") and orders
# its pipeline buffer by (epoch, prompt number). Anchored at both ends: an id that merely contains the
# words is not in that form.
_LOONGSAGE_PROMPT_ID = re.compile(r"epoch(\d+)_(?:.*_)?prompt(\d+)")


def loongsage_order(prompt_id: str) -> Optional[tuple[int, int]]:
    """(epoch, prompt number) of a LoongSage-form prompt id, or None when the id is not in that form."""
    match = _LOONGSAGE_PROMPT_ID.fullmatch(prompt_id)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))
