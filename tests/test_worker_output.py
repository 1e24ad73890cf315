"""Capturing a training worker's stdout/stderr for the job's logs (service.training.worker_output)."""
from __future__ import annotations

import sys

import pytest

from service.training.worker_output import OutputCapture
from service.config.tunables import TrainingTunables

pytestmark = pytest.mark.unit


def test_lines_are_teed_captured_and_restored(capsys: pytest.CaptureFixture[str]) -> None:
    capture = OutputCapture()
    before = sys.stdout, sys.stderr
    with capture.installed():
        print("epoch 1/2: loss 0.5")
        print("a warning", file=sys.stderr)
        sys.stdout.write("partial ")
        sys.stdout.write("line\nunterminated")
        assert sys.stdout.encoding  # the tee still looks like the stream it wraps
    assert (sys.stdout, sys.stderr) == before
    out = capsys.readouterr()
    assert out.out == "epoch 1/2: loss 0.5\npartial line\nunterminated" and out.err == "a warning\n"
    assert capture.drain() == [("stdout", "epoch 1/2: loss 0.5"), ("stderr", "a warning"), ("stdout", "partial line")]
    assert capture.drain(final=True) == [("stdout", "unterminated")]
    assert capture.drain(final=True) == [] and not capture.pending()


def test_the_ring_is_bounded_and_says_what_it_dropped() -> None:
    capture = OutputCapture(TrainingTunables(output_ring_lines=3, output_line_chars=10))
    capture.write("stdout", "".join(f"line {i}\n" for i in range(5)))
    capture.write("stdout", "\x1b[31mred\x1b[0m\n\n   \nprogress 1%\rprogress 100%\n")
    capture.write("stderr", "x" * 25)  # no newline: cut into max_chars pieces, the rest waits
    assert capture.pending()
    lines = capture.drain()
    assert lines[0] == ("note", "(6 earlier output line(s) dropped: over 3 between reports)")
    assert lines[1:] == [("stdout", "progress 1"), ("stderr", "x" * 10), ("stderr", "x" * 10)]
    assert capture.drain(final=True) == [("stderr", "x" * 5)]


def test_the_same_line_on_both_streams_is_kept_on_each() -> None:
    capture = OutputCapture()
    # What a program writes is its own, whatever it repeats: nothing is taken for a duplicate.
    capture.write("stdout", "epoch 1/2: loss 0.5\n")
    capture.write("stderr", "epoch 1/2: loss 0.5\n")
    capture.write("stderr", "epoch 1/2: loss 0.5\n")
    assert capture.drain() == [("stdout", "epoch 1/2: loss 0.5"), ("stderr", "epoch 1/2: loss 0.5"),
                               ("stderr", "epoch 1/2: loss 0.5")]
