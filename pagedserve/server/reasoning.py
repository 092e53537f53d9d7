"""Qwen3's reasoning (``<think>...</think>``) kept apart from the answer (vLLM's ``qwen3``
reasoning parser).

Qwen3.5's template opens the block itself (the generation prompt ends with ``<think>\\n``),
so the output starts inside it and only ``</think>`` appears; a model whose prompt does not
open it may still start its output with ``<think>``. ``ReasoningParser`` reads the output as
it streams and splits it into reasoning and content:

- The block ends at ``</think>``, or at ``<tool_call>``: Qwen3.5 sometimes calls a tool
  without closing its thinking, and such a call is still a call (the ``<tool_call>`` and
  what follows are content, where the tool parser finds them). The ``</think>`` that
  arrives after such a call closes the interrupted block and is dropped.
- Layout is the template's: newlines just inside the block and just after ``</think>`` are
  not text (``<think>\\nR\\n</think>\\n\\nC`` is reasoning ``R``, content ``C``).

Every decision waits until the text settles it, so the split does not depend on how the
output was cut into pieces: ``feed`` + ``finish`` of the whole text gives the same result.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE, CALL_OPEN = "<think>", "</think>", "<tool_call>"

_START, _REASONING, _CONTENT = range(3)


def _holdback(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) and len(t) > n for t in tags):
            return n
    return 0


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether a prompt leaves its output inside an open ``<think>`` block."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def template_reasons(chat_template: str | None) -> bool:
    """Whether a chat template writes thinking blocks (the parser's default is on then)."""
    return bool(chat_template) and THINK_OPEN in str(chat_template)


class ReasoningParser:
    """Incremental split of one output into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool) -> None:
        self._state = _REASONING if in_reasoning else _START
        self._buf = ""
        self._reasoning_started = False  # leading newlines of the block are dropped
        self._strip_content_newlines = False  # just after </think>
        self._drop_close = False  # a call interrupted the block: drop its late </think>
        self.saw_reasoning = in_reasoning

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            r, c, more = self._step()
            reasoning.append(r)
            content.append(c)
            if not more:
                return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The held-back end: a partial tag is text after all."""
        r, c = self.feed("")
        buf, self._buf = self._buf, ""
        if self._state == _REASONING:
            return r + (buf.rstrip("\n") if self._reasoning_started else buf.strip("\n")), c
        if self._strip_content_newlines:
            buf = buf.lstrip("\n")
        return r, c + buf

    def _step(self) -> tuple[str, str, bool]:
        """(reasoning, content, whether to step again) from the buffer."""
        if self._state == _START:
            return self._step_start()
        if self._state == _REASONING:
            return self._step_reasoning()
        return self._step_content()

    def _step_start(self) -> tuple[str, str, bool]:
        rest = self._buf.lstrip()
        if THINK_OPEN.startswith(rest) and len(rest) < len(THINK_OPEN):
            return "", "", False  # may still become "<think>"
        if rest.startswith(THINK_OPEN):
            self._buf = rest[len(THINK_OPEN):]
            self._state = _REASONING
            self.saw_reasoning = True
        else:
            self._state = _CONTENT
        return "", "", True

    def _step_reasoning(self) -> tuple[str, str, bool]:
        buf = self._buf
        if not self._reasoning_started:
            buf = buf.lstrip("\n")
            if not buf:
                self._buf = ""
                return "", "", False
            self._reasoning_started = True
        ends = [(i, tag) for tag in (THINK_CLOSE, CALL_OPEN) if (i := buf.find(tag)) >= 0]
        if not ends:
            keep = _holdback(buf, (THINK_CLOSE, CALL_OPEN))
            text = buf[:len(buf) - keep]
            body = text.rstrip("\n")  # newlines before a "</think>" are layout
            self._buf = buf[len(body):]
            return body, "", False
        i, tag = min(ends)
        reasoning = buf[:i].rstrip("\n")
        self._state = _CONTENT
        if tag == THINK_CLOSE:
            self._buf = buf[i + len(THINK_CLOSE):]
            self._strip_content_newlines = True
        else:
            self._buf = buf[i:]
            self._drop_close = True
        return reasoning, "", True

    def _step_content(self) -> tuple[str, str, bool]:
        buf = self._buf
        if self._strip_content_newlines:
            buf = buf.lstrip("\n")
            if not buf:
                self._buf = ""
                return "", "", False
            self._strip_content_newlines = False
        if not self._drop_close:
            self._buf = ""
            return "", buf, False
        i = buf.find(THINK_CLOSE)
        if i >= 0:
            self._drop_close = False
            self._buf = buf[i + len(THINK_CLOSE):]
            return "", buf[:i], True
        keep = _holdback(buf, (THINK_CLOSE,))
        self._buf = buf[len(buf) - keep:]
        return "", buf[:len(buf) - keep], False
