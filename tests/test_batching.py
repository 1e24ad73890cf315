"""StepBatcher: coalescing, exact splitting, grouping by seq len, error fan-out (no Ray)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.batching import StepBatcher

pytestmark = pytest.mark.unit


class RecordingStep:
    """A stand-in *step function* (not the gang): doubles its input and records batch shapes."""

    def __init__(self, delay_s: float = 0.01, fail: bool = False) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.delay_s, self.fail = delay_s, fail

    async def __call__(self, x: np.ndarray) -> np.ndarray:
        self.shapes.append(x.shape)
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("step failed")
        return x * 2


def _x(batch: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, 4)).astype(np.float32)


def test_concurrent_requests_share_steps_and_get_their_own_rows() -> None:
    async def scenario() -> tuple[list, list, RecordingStep, StepBatcher]:
        step = RecordingStep()
        batcher = StepBatcher(step, max_batch_size=64, wait_s=0.0)
        inputs = [_x(1 + i % 3, 5, i) for i in range(12)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        return inputs, outs, step, batcher

    inputs, outs, step, batcher = asyncio.run(scenario())
    for x, out in zip(inputs, outs):
        np.testing.assert_array_equal(out, x * 2)
    assert batcher.requests == 12 and batcher.steps == len(step.shapes) < 12


def test_only_equal_seq_lens_are_coalesced_and_max_rows_is_respected() -> None:
    async def scenario() -> RecordingStep:
        step = RecordingStep()
        batcher = StepBatcher(step, max_batch_size=4, wait_s=0.01)
        inputs = [_x(2, 3, 0), _x(2, 7, 1), _x(2, 3, 2), _x(2, 3, 3), _x(2, 7, 4)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        for x, out in zip(inputs, outs):
            np.testing.assert_array_equal(out, x * 2)
        return step

    step = asyncio.run(scenario())
    assert all(shape[0] <= 4 for shape in step.shapes)
    assert {shape[1] for shape in step.shapes} == {3, 7}
    assert sum(shape[0] for shape in step.shapes) == 10


def test_a_failed_step_fails_every_request_in_it_and_the_next_step_runs() -> None:
    async def scenario() -> None:
        step = RecordingStep(fail=True)
        batcher = StepBatcher(step, max_batch_size=8, wait_s=0.01)
        results = await asyncio.gather(*(batcher.submit(_x(1, 2, i)) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        step.fail = False
        out = await batcher.submit(_x(1, 2, 9))
        np.testing.assert_array_equal(out, _x(1, 2, 9) * 2)

    asyncio.run(scenario())


def test_a_cancelled_request_is_dropped_before_it_runs() -> None:
    async def scenario() -> RecordingStep:
        step = RecordingStep(delay_s=0.05)
        batcher = StepBatcher(step, max_batch_size=1, wait_s=0.0)
        first = asyncio.ensure_future(batcher.submit(_x(1, 2, 0)))
        second = asyncio.ensure_future(batcher.submit(_x(1, 2, 1)))
        await asyncio.sleep(0.01)
        second.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        await asyncio.sleep(0.1)
        return step

    assert len(asyncio.run(scenario()).shapes) == 1


class ConcurrencyProbe(RecordingStep):
    """A step function that also records how many of its calls overlap."""

    def __init__(self, delay_s: float = 0.02) -> None:
        super().__init__(delay_s)
        self.running = self.peak = 0

    async def __call__(self, x: np.ndarray) -> np.ndarray:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().__call__(x)
        finally:
            self.running -= 1


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_steps_in_flight_never_exceed_the_limit_and_rows_stay_exact(max_in_flight: int) -> None:
    async def scenario() -> tuple[list, list, ConcurrencyProbe, StepBatcher]:
        step = ConcurrencyProbe()
        batcher = StepBatcher(step, max_batch_size=3, wait_s=0.0, max_in_flight=max_in_flight)
        inputs = [_x(1, 5, i) for i in range(20)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        return inputs, outs, step, batcher

    inputs, outs, step, batcher = asyncio.run(scenario())
    for x, out in zip(inputs, outs):
        np.testing.assert_array_equal(out, x * 2)
    assert step.peak == max_in_flight  # 20 requests of <= 3 rows each keep every slot busy
    assert batcher.requests == 20 and batcher.steps == len(step.shapes)
