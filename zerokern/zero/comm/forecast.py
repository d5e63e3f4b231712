"""Which collectives come next, read off the ones every rank agreed to so far ([Note: planned
collectives] in check.py).

Pure and deterministic: every rank feeds it the same agreed sequence and so forecasts the same
collectives, which is what lets the ranks agree on a forecast in one round. A training loop
repeats itself (each step gathers the same units and reduces the same buckets), so the forecast
copies what followed the last time the latest CONTEXT collectives were seen, the way LZ77
copies a match: a cycle shorter than the forecast repeats.
"""

CONTEXT = 3  # collectives of context: a unit gathered in forward and again in backward is told apart by its neighbours
KEEP = 4096  # agreed collectives remembered (a few steps of the largest models' collectives)


class Forecast:
    def __init__(self):
        self.codes = []  # the agreed collectives' checksums, in order (the last KEEP to 2 KEEP)
        self.start = 0  # the sequence number before codes[0]
        self._last = {}  # context -> index in codes where it last ended
        self._before = {}  # context -> index where it ended the time before that

    @property
    def end(self) -> int:
        """The sequence number of the last agreed collective."""
        return self.start + len(self.codes)

    def append(self, code: int) -> None:
        self.codes.append(code)
        if len(self.codes) >= CONTEXT:
            self._index(len(self.codes) - 1)
        if len(self.codes) > 2 * KEEP:
            self.start += len(self.codes) - KEEP
            self._rebuild(self.codes[-KEEP:])

    def truncate(self, seq: int) -> None:
        """Forget what was agreed after `seq` (every rank left the forecast there alike)."""
        if seq < self.end:
            self._rebuild(self.codes[:max(0, seq - self.start)])

    def ahead(self, extra, n: int):
        """The next n checksums after the agreed ones followed by `extra` (this rank's
        collectives not agreed yet), or fewer where nothing like the latest context was seen."""
        extra = list(extra)
        known = len(self.codes) + len(extra)
        if known < CONTEXT:
            return []

        def at(i):
            return self.codes[i] if i < len(self.codes) else extra[i - len(self.codes)]
        context = tuple(at(i) for i in range(known - CONTEXT, known))
        found = self._last.get(context)
        if found is not None and found >= known - 1:  # that is the context we stand at: take the one before
            found = self._before.get(context)
        if found is None:
            return []
        out = []
        for i in range(n):
            src = found + 1 + i
            out.append(at(src) if src < known else out[src - known])
        return out

    def _index(self, i: int) -> None:
        context = tuple(self.codes[i - CONTEXT + 1:i + 1])
        if context in self._last:
            self._before[context] = self._last[context]
        self._last[context] = i

    def _rebuild(self, codes) -> None:
        self.codes, self._last, self._before = list(codes), {}, {}
        for i in range(CONTEXT - 1, len(self.codes)):
            self._index(i)
