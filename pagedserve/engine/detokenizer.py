"""Incremental detokenization and stop-string handling for one request.

Text is produced token by token without re-decoding the whole output each step: only a
short window of recent ids is decoded, and text is released only once it no longer ends
in an incomplete UTF-8 sequence. Stop strings are searched across token boundaries; the
text is cut just before the first match (just after it with ``include_stop``). While a
request runs, the last ``max(len(stop)) - 1`` characters are held back, because they might
be the start of a stop string: so streamed pieces always concatenate to the final text.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT = 6  # ids decoded before the new ones, so merges and leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all finalized output text (stop string cut off once found)
        self.num_emitted = 0  # characters already handed out by ``take_new_text``
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def append(self, token_id: int, check_stop: bool = True) -> bool:
        """Add one generated token; returns True if a stop string was found (searched only
        with ``check_stop``, in text from this token on)."""
        if self.stopped_on is not None:
            return True
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return False  # an incomplete character (or nothing yet): wait for more ids
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold_back)
        self.text += new
        return check_stop and self._find_stop(start)

    def _find_stop(self, start: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        index, s = min(hits)
        self.text = self.text[:index + len(s) if self.include_stop else index]
        self.stopped_on = s
        return True

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back a possible stop-string prefix."""
        end = len(self.text) if finished or not self.stop else max(
            self.num_emitted, len(self.text) - self.hold_back)
        piece = self.text[self.num_emitted:end]
        self.num_emitted = end
        return piece
