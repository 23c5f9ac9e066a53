"""Text for chat webhooks: what a node or the network wrote cannot shape a message.

Slack's incoming webhooks read `<...>` as a mention or a link (`<!channel>`,
`<https://x|label>`) and want `&`, `<` and `>` sent as entities. Mattermost takes the same
Slack syntax (it translates it to Markdown) and renders Markdown besides, where
`@channel` is a mention and `[label](url)` hides a link behind a label. A failing task's
stderr reaches a message (a node's `why`), so every message is made one line with these
neutralised: no part of it can pass for a gpuops line of its own, ping a channel or
disguise a link. gpuops's own messages are one line, so nothing of theirs is lost.
"""

from __future__ import annotations

import re
import unicodedata

# Newlines, tabs and other controls; Unicode's line and paragraph separators; format
# characters (bidi overrides can make text read backwards, zero-widths hide it).
_CONTROL = frozenset({"Cc", "Cf", "Zl", "Zp"})
_SPACES = re.compile(r"\s+")
_ENTITIES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
# A zero-width space splits a mention (`@channel`) or a Markdown link's `](` and shows
# nothing: the text still reads as it was written.
_SPLIT = "\u200b"
# A mention is an `@` that starts a word: Mattermost splits words at anything but letters,
# digits and `.-_:@`. One inside a word (an episode's `rule@node:opened`) is left whole,
# so what people copy from a message still works in their tools.
_MENTION = re.compile(r"(?<![\w.:@-])@(?=\w)")
# Where a message is cut, the rest is in `gpuops status` (nodes and why) or the audit trail.
_CUT = " ... ({:,} more characters: `gpuops status` and the audit trail have the rest)"
_PART_ENTITY = re.compile(r"&[a-z]*$")


def one_line(text: str) -> str:
    """`text` with every control character a space and runs of spaces one."""
    chars = (" " if unicodedata.category(c) in _CONTROL else c for c in text)
    return _SPACES.sub(" ", "".join(chars)).strip()


def clean(text: str) -> str:
    """`text` as a chat message that says only what it reads: one line, Slack's three
    entities escaped, no mention and no Markdown link."""
    text = one_line(text).translate(_ENTITIES)
    text = _MENTION.sub("@" + _SPLIT, text)
    return text.replace("](", "]" + _SPLIT + "(")


def capped(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    # The note's length at the most characters it could name, so the count fits after.
    head = text[: max(0, limit - len(_CUT.format(len(text))))]
    head = _PART_ENTITY.sub("", head)  # never half an entity (`&am`)
    return head + _CUT.format(len(text) - len(head))
