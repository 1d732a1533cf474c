"""Bounding what a sender chose before it goes into a log line or an error
message: a name, a subject or a whole error text is cut to a fixed length,
with an ellipsis to show it was cut. Replies are bounded by the wire
(``MAX_TEXT_LEN``); log lines only by this, so every value a principal
controls passes through it on its way to either."""

from __future__ import annotations

#: Names: arguments, fields, verbs, message types, subjects' tokens.
MAX_NAME_CHARS = 128
#: A subject or a reply subject, as logged.
MAX_SUBJECT_CHARS = 256
#: A whole error message, as logged.
MAX_MESSAGE_CHARS = 1024

ELLIPSIS = "…"


def clip(value: object, limit: int = MAX_NAME_CHARS) -> str:
    """``str(value)``, cut to at most ``limit`` characters (the last one an
    ellipsis when it was cut)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return text[: max(limit - 1, 0)] + ELLIPSIS


def clip_repr(value: object, limit: int = MAX_NAME_CHARS) -> str:
    """``repr`` of the clipped text, for messages that quote a name."""
    return repr(clip(value, limit))
