"""How many rows a prefill chunk computes in a step it shares with other sessions' appends
(chunked prefill, service.sessions.batcher).

Why not a fixed count: a chunk's cost grows with its position (its rows attend every position
before them), so a fixed count sized for the first chunks of a long prefill makes its last ones
the slowest steps, and the decoding sessions that share them wait longest exactly there. Measured
(bench/NOTES.md, 8 one-row appends beside a 4,096-row prefill, 12 layers E=768, one 2-core rank):
fixed 256-row chunks: the steps' p99 955 ms against 267 ms for the appends' step alone (3.5x);
fixed 96: 2.7x, and the prefill 1.7x slower because its early chunks were needlessly small.

The rule: a step that carries a chunk should take at most `step_ratio` times the step of the
other appends alone. With d the seconds of a recent step of as many one-row appends alone (an
average of such steps; `decode_estimate` when no step of that many was seen) and r the seconds one chunk row added to the latest steps that carried at least
`min_rows` rows of chunks (an average leaning on the latest: (that step - d) / its chunk rows; d
is taken off a chunk alone too, as most of a step's fixed part),

    rows = clamp(floor((step_ratio - 1) * d / r), min_rows, max_rows)

for a chunk that shares its step with other appends; a chunk alone computes `max_rows`
(tunables.gang.session_prefill_chunk_tokens). The first chunk that shares a step before any
chunk's cost was seen (d known, r not) is a probe of `min_rows`: sized blind at `max_rows`,
that one step took 3.5x the decoders' step alone in one bench run (bench/NOTES.md), and its
appends were the p99. With d not known either, a chunk computes `max_rows` (a probe could not
be told apart from its decoders' share, and nothing would ever size the chunks up again).
`step_ratio` 0 turns the rule off (every chunk `max_rows`). Each step corrects the estimate
the next one uses, so the chunks shrink as the prefill moves on, and on a device where a chunk
row is cheap against a decode step (a GPU's decode step reads memory, a chunk computes) they
stay at `max_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_EWMA = 0.5  # weight of the newest observation (a chunk's cost moves with its position: follow it)


@dataclass
class ChunkBudget:
    """The rule above, fed every step's duration (`observe`), asked before every step (`rows`)."""

    max_rows: int
    step_ratio: float
    min_rows: int = 16
    # d by the number of one-row appends in the step (moving averages): a step of 8 costs more
    # than one of 4, and a chunk's step must be held against its own decoders' step alone
    decode_s: dict[int, float] = field(default_factory=dict)
    row_s: float | None = None  # r: one chunk row's added seconds, at the latest chunks

    def __post_init__(self) -> None:
        if self.max_rows < 1 or not (self.step_ratio == 0 or self.step_ratio > 1) or self.min_rows < 1:
            raise ValueError(f"chunked prefill needs tunables.gang.session_prefill_step_ratio 0 (off) or above 1 "
                             f"(got {self.step_ratio}), at least 1 row per chunk (got {self.max_rows}) and "
                             f"min_rows >= 1 (got {self.min_rows})")
        self.min_rows = min(self.min_rows, self.max_rows)

    def decode_estimate(self, others: int) -> float | None:
        """d for a step of `others` one-row appends: measured, else from the nearest count measured,
        k, as d(k) x max(1, others / k). d grows with the count and has a fixed part (the weights
        read), so that is never below the true d: too much room for a chunk, never too little
        (an underestimate would starve the prefill). None: no step of one-row appends seen yet."""
        if others in self.decode_s:
            return self.decode_s[others]
        if not self.decode_s:
            return None
        k = min(self.decode_s, key=lambda known: (abs(known - others), -known))
        return self.decode_s[k] * max(1.0, others / k)

    def rows(self, others: int) -> int:
        """Rows for the next chunk, whose step holds `others` one-row appends of other sessions."""
        decode_s = self.decode_estimate(others) if others else None
        if self.step_ratio == 0 or decode_s is None:
            return self.max_rows
        if self.row_s is None:
            return self.min_rows  # a probe: its step teaches r at the cost of a few rows
        room = (self.step_ratio - 1) * decode_s
        return max(self.min_rows, min(self.max_rows, int(room / self.row_s)))

    def observe(self, chunk_rows: int, others: int, seconds: float) -> None:
        """A step ended: `chunk_rows` rows of several-row items (chunks; 0: none) beside `others`
        one-row appends, in `seconds` (the step as its appends waited for it)."""
        if chunk_rows == 0:
            if others:
                last = self.decode_s.get(others)
                self.decode_s[others] = seconds if last is None else _EWMA * seconds + (1 - _EWMA) * last
            return
        # Beside others, their step alone is the rest; alone, a step's fixed part (reading the
        # weights, the hand-offs) is still most of a one-row step's, so it is taken off too.
        base = self.decode_estimate(max(others, 1))
        if chunk_rows < self.min_rows or (others and base is None):
            return  # a few rows' step is mostly its fixed part; or nothing tells the chunk's part apart
        added = max(seconds - (base or 0.0), 1e-6) / chunk_rows
        self.row_s = added if self.row_s is None else _EWMA * added + (1 - _EWMA) * self.row_s
