"""Incremental detokenization with stop strings, as vLLM and TGI do it.

`IncrementalDetokenizer` decodes only a short window of ids each step (prefix/read offsets) and
holds text back while it ends in an incomplete UTF-8 character, so the streamed pieces
concatenate exactly to the full decode. `OutputText` adds stop strings: the text is cut right
before the first stop string, and while streaming the last `len(longest stop) - 1` characters
are held back so a stop string never leaks out in pieces.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # ids before this are already turned into text

    def add(self, token_id: int) -> str:
        """Append one id; return the new text it completes ("" while a character is incomplete)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


class OutputText:
    """The output text of one sequence, cut at stop strings, released in streamable pieces."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.released = 0  # characters already handed out
        self.stopped = False

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Add a token; return True if a stop string appeared (the text is then cut before it).

        With check_stop False (before min_tokens, as in vLLM) stop strings are not looked for.
        """
        before = len(self.text)
        self.text += self.detokenizer.add(token_id)
        if not self.stop or not check_stop or len(self.text) == before:
            return False
        search_from = max(0, before - self.holdback)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        if not self.stopped:
            self.text += self.detokenizer.flush()

    def release(self, final: bool) -> str:
        """Text not handed out yet; while not final, keep back what could start a stop string."""
        end = len(self.text) if final else max(self.released, len(self.text) - self.holdback)
        piece = self.text[self.released:end]
        self.released = end
        return piece
