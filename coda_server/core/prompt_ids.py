"""LoongSage's prompt-id form, `epoch{E}_..._prompt{N}`, read for the buffer order it implies."""
from __future__ import annotations

from typing import Optional

from coda_client.protocol import LOONGSAGE_PROMPT_ID  # plain data, as the RPC table


def loongsage_order(prompt_id: str) -> Optional[tuple[int, int]]:
    """(epoch, prompt number) of a LoongSage-form prompt id, or None when the id is not in that form."""
    match = LOONGSAGE_PROMPT_ID.fullmatch(prompt_id)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))
