"""A training worker's own stdout/stderr, captured for the job's logs.

Training workers run in their own processes, possibly on other nodes; the job's logs
(`GET /train/{id}/logs`) must still show what they print. Inside the train loop,
`OutputCapture.installed()` replaces `sys.stdout` and `sys.stderr` with tees: every write
still reaches the original stream (so Ray's own worker logs are unchanged), and each
complete line is also kept in a bounded ring. The loop `drain()`s the ring and sends the
lines to the job's run actor (`TrainRun.worker_output`), which tags them with the rank.
Nothing here reads Ray's log files.

Bounded everywhere: at most `max_lines` lines wait between two drains (older ones are
dropped and counted, the count reported as one line), a line is cut at `max_chars`, and a
partial line longer than that is emitted as a line of its own.
"""
from __future__ import annotations

import collections
import contextlib
import re
import sys
import threading
from typing import Any, Iterator, TextIO

from service.config.tunables import TrainingTunables

# Terminal escapes (colours, cursor moves) mean nothing in a JSON log.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


class OutputCapture:
    """Complete lines written to the installed tees, the newest training.output_ring_lines
    kept, each cut at training.output_line_chars (the run actor cuts at the same value);
    thread-safe. `training`: default, the training tunables' defaults."""

    def __init__(self, training: TrainingTunables | None = None) -> None:
        t = training or TrainingTunables()
        max_lines, self._max_chars = t.output_ring_lines, t.output_line_chars
        self._lock = threading.Lock()
        self._lines: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_lines)
        self._dropped = 0
        self._partial: dict[str, str] = {"stdout": "", "stderr": ""}

    def write(self, stream: str, text: str) -> None:
        with self._lock:
            buf = self._partial[stream] + text
            *complete, rest = buf.split("\n")
            for line in complete:
                self._add(stream, line)
            while len(rest) > self._max_chars:  # a runaway line without newline
                self._add(stream, rest[: self._max_chars])
                rest = rest[self._max_chars:]
            self._partial[stream] = rest

    def _add(self, stream: str, line: str) -> None:
        line = _ANSI.sub("", line).rstrip("\r")
        if "\r" in line:  # progress bars redraw with \r: keep the last state
            line = line.rsplit("\r", 1)[-1]
        if not line.strip():
            return
        if len(self._lines) == self._lines.maxlen:
            self._dropped += 1
        self._lines.append((stream, line[: self._max_chars]))

    def drain(self, final: bool = False) -> list[tuple[str, str]]:
        """The lines captured since the last drain, oldest first, as (stream, line); a
        leading ('note', ...) line says how many were dropped. `final` also takes the
        unterminated last line of each stream."""
        with self._lock:
            if final:
                for stream, rest in self._partial.items():
                    if rest:
                        self._add(stream, rest)
                    self._partial[stream] = ""
            lines = list(self._lines)
            self._lines.clear()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            lines.insert(0, ("note", f"({dropped} earlier output line(s) dropped: over {self._lines.maxlen} between reports)"))
        return lines

    def pending(self) -> bool:
        with self._lock:
            return bool(self._lines) or self._dropped > 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[OutputCapture]:
        """sys.stdout and sys.stderr tee into this capture until the block ends."""
        saved = sys.stdout, sys.stderr
        tees = _Tee(self, "stdout", sys.stdout), _Tee(self, "stderr", sys.stderr)
        sys.stdout, sys.stderr = tees
        try:
            yield self
        finally:
            for tee in tees:
                with contextlib.suppress(Exception):
                    tee.flush()
            # Put back only what is still ours (something else may have wrapped us since).
            if sys.stdout is tees[0]:
                sys.stdout = saved[0]
            if sys.stderr is tees[1]:
                sys.stderr = saved[1]


class _Tee:
    """A text stream: writes go to the original stream and to the capture."""

    def __init__(self, capture: OutputCapture, name: str, original: TextIO) -> None:
        self._capture = capture
        self._name = name
        self._original = original

    def write(self, text: str) -> int:
        try:
            self._capture.write(self._name, str(text))
        except Exception:  # noqa: BLE001 - capturing must never break the training loop
            pass
        return self._original.write(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, ...
        return getattr(self._original, name)
