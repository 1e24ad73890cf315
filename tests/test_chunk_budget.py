"""The chunk budget (service.sessions.chunk_budget): how many rows a prefill chunk computes in a
step it shares with other sessions' appends, so that the step takes at most `step_ratio` times
their step alone. The rule is fed step durations; here they are given (the numbers a real step
would take), and the expected rows come from the rule as documented, worked by hand."""
from __future__ import annotations

import pytest

from service.sessions.chunk_budget import ChunkBudget

pytestmark = pytest.mark.unit


def test_off_alone_or_without_estimates_a_chunk_computes_its_most_rows() -> None:
    off = ChunkBudget(256, 0.0)
    off.observe(0, 8, 0.25)
    off.observe(256, 8, 0.95)
    assert off.rows(others=8) == 256
    budget = ChunkBudget(256, 2.5)
    assert budget.rows(others=8) == 256  # nothing measured yet: no decoders' step to hold it to
    budget.observe(256, 8, 0.95)  # ... and that step teaches nothing (no d to take off)
    assert budget.row_s is None and budget.rows(others=8) == 256
    budget.observe(0, 8, 0.25)
    budget.observe(16, 8, 0.25 + 16 * 0.003)  # d and r known now
    assert budget.rows(others=0) == 256  # alone, a chunk delays no one


def test_the_first_chunk_beside_decoders_is_a_probe_of_the_fewest_rows_and_teaches_the_row_cost() -> None:
    """Their step alone known, a chunk's cost not yet: sized blind at the most rows, that step
    would be the decoders' slowest (3.5x their step alone in a bench run); a probe of min_rows
    costs a few rows, and its step sizes the next chunk."""
    budget = ChunkBudget(256, 2.0)
    budget.observe(0, 8, 0.2)  # 8 one-row appends alone: 200 ms
    assert budget.rows(others=8) == 16  # the probe, min_rows
    assert budget.rows(others=0) == 256  # alone it still takes the most
    budget.observe(16, 8, 0.2 + 16 * 0.002)  # the probe's step: 2 ms a row beyond the decoders'
    # room (2 - 1) x 200 ms = 200 ms; 200 / 2 ms = 100 rows
    assert budget.row_s == pytest.approx(0.002) and budget.rows(others=8) == 100


def test_a_shared_chunk_gets_the_rows_that_fit_the_ratio_and_follows_the_growing_cost() -> None:
    budget = ChunkBudget(256, 2.5)
    budget.observe(0, 8, 0.25)  # 8 one-row appends alone: 250 ms
    budget.observe(256, 8, 0.95)  # a 256-row chunk beside them: 700 ms more, 2.734 ms a row
    # room (2.5 - 1) x 250 ms = 375 ms; 375 / 2.734 = 137.1
    assert budget.rows(others=8) == 137
    budget.observe(137, 8, 0.25 + 137 * 0.004)  # later chunks cost 4 ms a row: the average moves halfway
    # row cost 0.5 x 4 + 0.5 x 2.734 = 3.367 ms; 375 / 3.367 = 111.4
    assert budget.rows(others=8) == 111
    for _ in range(20):
        budget.observe(16, 8, 0.25 + 16 * 0.2)  # a pathological 200 ms a row: the floor holds
    assert budget.rows(others=8) == 16  # the floor, min_rows


def test_a_chunk_is_held_against_its_own_decoders_step_and_an_unseen_count_is_never_underestimated() -> None:
    """Alone, 8 decoders' appends may have run as steps of 4 (150 ms) and never as one of 8: the
    chunk beside all 8 must not be held to the step of 4, which would starve the prefill."""
    budget = ChunkBudget(256, 2.5)
    budget.observe(0, 4, 0.15)  # steps of 4 one-row appends: 150 ms
    assert budget.decode_estimate(4) == 0.15
    assert budget.decode_estimate(8) == pytest.approx(0.30)  # 150 ms x 8 / 4: above any true d(8)
    assert budget.decode_estimate(2) == 0.15  # a step of 2 costs at most what one of 4 does
    budget.observe(100, 8, 0.30 + 100 * 0.0031)  # the chunk's rows: 3.1 ms each beyond the estimate
    # room (2.5 - 1) x 300 ms = 450 ms: 145.2 rows; beside 4 decoders (150 ms): 225 ms, 72.6 rows
    assert budget.rows(others=8) == 145 and budget.rows(others=4) == 72
    budget.observe(0, 8, 0.25)  # now a step of all 8 was seen: its own d
    # room 1.5 x 250 ms = 375 ms: 121.0 rows
    assert budget.decode_estimate(8) == 0.25 and budget.rows(others=8) == 120


def test_small_appends_and_chunks_alone_teach_the_row_cost_without_the_step_s_fixed_part() -> None:
    budget = ChunkBudget(256, 2.0)
    budget.observe(3, 0, 0.3)  # a 3-row append alone: under the 16-row floor, its step is mostly fixed cost
    assert budget.row_s is None
    budget.observe(0, 1, 0.1)  # one one-row append: 100 ms
    budget.observe(200, 0, 0.5)  # a chunk alone: 400 ms beyond the fixed part, 2 ms a row
    # room (2 - 1) x 100 ms = 100 ms: 50 rows
    assert budget.rows(others=1) == 50


def test_a_ratio_between_0_and_1_is_refused_with_the_tunable_named() -> None:
    with pytest.raises(ValueError, match="tunables.gang.session_prefill_step_ratio 0 \\(off\\) or above 1 \\(got 0.5\\)"):
        ChunkBudget(256, 0.5)
    assert ChunkBudget(8, 3.0).min_rows == 8  # a floor above the most rows is the most rows
