"""Stop sequences matched on the decoded text, across token boundaries.

Text that might be the start of a stop sequence is held back until it is known not
to be one, so the text of a stop sequence is never streamed.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add decoded text; return what is safe to emit. After a match, `matched` is set."""
        if self.matched is not None:
            return ""
        self._pending += text
        if not self.stops:
            out, self._pending = self._pending, ""
            return out
        hits = [(self._pending.find(s), s) for s in self.stops if s in self._pending]
        if hits:
            index, stop = min(hits)
            self.matched = stop
            out, self._pending = self._pending[:index], ""
            return out
        hold = self._longest_partial_suffix()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """At the end of generation, held-back text that never became a stop sequence."""
        out, self._pending = ("" if self.matched else self._pending), ""
        return out

    def _longest_partial_suffix(self) -> int:
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:size]):
                    best = size
                    break
        return best
