"""Tags in streamed text: a piece of output may end inside one."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that begins `tag` (a tag still arriving:
    held back until the next piece says what it is)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
