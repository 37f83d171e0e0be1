"""Generated ids to streamed text: UTF-8-safe incremental detokenization, and stop strings.

Decoding one id at a time is wrong twice over. An id may carry part of a UTF-8 character
(byte-level BPE, or sentencepiece byte fallback like `<0xE4>`), and sentencepiece decoders strip
the leading space of the first token they see, so `decode([▁world])` is "world" where the text
needs " world". IncrementalDetokenizer decodes a short window that starts one chunk back and emits
what the window adds beyond that chunk's own text (the prefix_offset / read_offset scheme of vLLM
and TGI); StopChecker cuts that stream at the first stop string.
"""

from __future__ import annotations

from engine.loading.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what decode shows for bytes that are not (yet) a whole character
# A character is at most 4 bytes and every id adds at least one, so real text ends on a whole
# character within a few ids; this many pending ids means garbage bytes (a model looping on `<0xE4>`),
# emitted as U+FFFD rather than letting the window, and the cost of each decode, grow without bound.
MAX_PENDING_IDS = 32


class IncrementalDetokenizer:
    """Turns generated ids into text deltas whose concatenation is `tokenizer.decode(output_ids)`.

    The window holds `[context | pending]`: context is the last chunk of ids that ended on a whole
    character, pending the ids since. Each `add` decodes the window once and emits the text beyond
    the context's; ids that end inside a character (the decode ends with U+FFFD) stay pending, and
    characters they complete are emitted as soon as they are whole. Committing pending as the next
    context costs one more decode. The window is a few ids long, so a token costs O(window), not
    O(length).

    The prompt is deliberately not used as decoding context: with it, a sentencepiece first token
    `▁Hello` would stream as " Hello" while `decode(output_ids)` (the non-streamed response) says
    "Hello"; streamed and non-streamed text must agree.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        """
        Args:
            tokenizer: the model's tokenizer; its `decode` defines the text.
            prompt_ids: the request's prompt; not decoded (see the class docstring).
            skip_special_tokens: passed to every `decode`, as for the final text.
        """
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._read = 0  # window[:read] is the context, window[read:] is pending
        self._context_text = ""  # decode(window[:read])
        self._early_text = ""  # text already emitted from pending ids (whole characters mid-chunk)

    def add(self, token_id: int) -> str:
        """Add one generated id.

        Returns:
            the text it completes: "" while it ends inside a character, possibly several characters.
        """
        self._window.append(token_id)
        text = self._decode(self._window)
        emitted = self._context_text + self._early_text
        pending = len(self._window) - self._read
        if pending < MAX_PENDING_IDS:
            if text.endswith(REPLACEMENT):
                # Only the trailing U+FFFDs may still change; whole characters before them are final,
                # unless byte fallback turned emitted bytes into U+FFFDs (then wait for the whole chunk).
                whole = text.rstrip(REPLACEMENT)
                if len(whole) <= len(emitted) or not whole.startswith(emitted):
                    return ""
                delta = whole[len(emitted) :]
                self._early_text += delta
                return delta
            if text == emitted:
                # The id adds no text: drop it to keep the window short when that is safe. It is not
                # while nothing has come out: a first "▁" decodes to "", yet decides whose space is stripped.
                if pending == 1 and (self._context_text or self._is_skipped(token_id)):
                    self._window.pop()
                return ""
        # Commit only ids that produced text: the next window must start with a real token, so that
        # the sentencepiece space it strips is one already accounted for.
        self._commit()
        return text[len(emitted) :]

    def flush(self) -> str:
        """End of generation: the held-back text (incomplete characters decode as U+FFFD)."""
        if self._read == len(self._window):
            return ""
        text = self._decode(self._window)
        delta = text[len(self._context_text) + len(self._early_text) :]
        self._commit()
        return delta

    def _commit(self) -> None:
        """Pending ids become the context of the next window."""
        del self._window[: self._read]
        self._read = len(self._window)
        self._context_text = self._decode(self._window)
        self._early_text = ""

    def _is_skipped(self, token_id: int) -> bool:
        """A special token that `skip_special_tokens` removes before decoding, so it can never matter."""
        skipped = self.skip_special_tokens and self._decode([token_id]) == ""
        return skipped and self.tokenizer.decode([token_id], skip_special_tokens=False) != ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopChecker:
    """Cuts streamed text before the first stop string to be completed, which is never emitted.

    A stop string may arrive split across deltas, so the longest end of the text that begins some
    stop string is held back until the next delta settles it: at most max(len(stop)) - 1 chars.
    """

    def __init__(self, stop: tuple[str, ...]):
        """
        Args:
            stop: the request's stop strings; empty strings are ignored.
        """
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self._max_held = max((len(s) for s in self.stop), default=1) - 1
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta.

        Returns:
            the text safe to emit now, and whether a stop string was hit (then nothing more is emitted).
        """
        if self.stopped:
            return "", True
        text = self._held + delta
        # The held part holds no whole stop string, so any match ends in `delta`. The match that ends
        # first wins (longest on a tie): chunking the same text differently must cut it in the same place.
        hits = [(i + len(s), i) for s in self.stop if (i := text.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return text[: min(hits)[1]], True
        keep = self._stop_prefix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Generation ended for another reason: the held-back text."""
        held, self._held = self._held, ""
        return held

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        for n in range(min(self._max_held, len(text)), 0, -1):
            end = text[-n:]
            if any(s.startswith(end) for s in self.stop):
                return n
        return 0
