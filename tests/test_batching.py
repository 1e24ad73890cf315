"""StepBatcher: coalescing, exact splitting, grouping by seq len, error fan-out (no Ray)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from service.config.builder_args import BatchPolicy
from service.gang.batching import StepBatcher
from tests.helpers import eventually_async

pytestmark = pytest.mark.unit


class RecordingStep:
    """A stand-in *step function* (not the gang): doubles its input and records batch shapes."""

    def __init__(self, delay_s: float = 0.01, fail: bool = False) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.delay_s, self.fail = delay_s, fail

    async def __call__(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                       deadline: float | None = None) -> np.ndarray:
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
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=64, wait_s=0.0))
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
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=4, wait_s=0.01, max_padding_fraction=0.0))
        inputs = [_x(2, 3, 0), _x(2, 7, 1), _x(2, 3, 2), _x(2, 3, 3), _x(2, 7, 4)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        for x, out in zip(inputs, outs):
            np.testing.assert_array_equal(out, x * 2)
        return step

    step = asyncio.run(scenario())
    assert all(shape[0] <= 4 for shape in step.shapes)
    assert {shape[1] for shape in step.shapes} == {3, 7}
    assert sum(shape[0] for shape in step.shapes) == 10


def test_a_lone_request_never_waits_for_company_and_concurrent_ones_still_gather() -> None:
    """batch_wait_timeout_s of 30 s: a request that finds the batcher idle runs its step at once
    (bounded here far below the linger); the requests that arrive while that step runs share the
    next step, after lingering for company behind it."""
    async def scenario() -> tuple[RecordingStep, StepBatcher, list[np.ndarray], list[np.ndarray]]:
        step = RecordingStep(delay_s=0.2)
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=3, wait_s=30.0))
        alone = _x(1, 2, 0)
        np.testing.assert_array_equal(await asyncio.wait_for(batcher.submit(alone), 10), alone * 2)
        assert batcher.stats()["inline_steps"] == 1 and step.shapes == [(1, 2, 4)]
        first = asyncio.ensure_future(batcher.submit(_x(1, 2, 1)))  # idle again: runs at once
        await eventually_async(lambda: len(step.shapes) == 2, 5, "the second lone request's step running")
        behind = [_x(1, 2, 2 + i) for i in range(2)]
        # Queued behind the running step: 2 rows < max_batch_size 3, so they would linger 30 s
        # for a third; a third row arrives, fills the step, and the linger ends at once.
        outs = await asyncio.wait_for(asyncio.gather(first, *(batcher.submit(x) for x in behind),
                                                     batcher.submit(_x(1, 2, 9))), 10)
        return step, batcher, [_x(1, 2, 1), *behind, _x(1, 2, 9)], outs

    step, batcher, inputs, outs = asyncio.run(scenario())
    for x, out in zip(inputs, outs):
        np.testing.assert_array_equal(out, x * 2)
    assert step.shapes == [(1, 2, 4), (1, 2, 4), (3, 2, 4)]  # two lone steps, then the three together
    assert batcher.stats()["inline_steps"] == 2


def test_a_failed_step_fails_every_request_in_it_and_the_next_step_runs() -> None:
    async def scenario() -> None:
        step = RecordingStep(fail=True)
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=8, wait_s=0.01))
        results = await asyncio.gather(*(batcher.submit(_x(1, 2, i)) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        step.fail = False
        out = await batcher.submit(_x(1, 2, 9))
        np.testing.assert_array_equal(out, _x(1, 2, 9) * 2)

    asyncio.run(scenario())


def test_a_cancelled_request_is_dropped_before_it_runs() -> None:
    async def scenario() -> RecordingStep:
        step = RecordingStep(delay_s=0.05)
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=1, wait_s=0.0))
        first = asyncio.ensure_future(batcher.submit(_x(1, 2, 0)))
        second = asyncio.ensure_future(batcher.submit(_x(1, 2, 1)))
        await eventually_async(lambda: len(step.shapes) == 1, 5, "the first request's step running")
        second.cancel()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second
        await asyncio.sleep(0.1)  # by design: room for a step the cancelled request must not get
        return step

    assert len(asyncio.run(scenario()).shapes) == 1


class ConcurrencyProbe(RecordingStep):
    """A step function that also records how many of its calls overlap."""

    def __init__(self, delay_s: float = 0.02) -> None:
        super().__init__(delay_s)
        self.running = self.peak = 0

    async def __call__(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                       deadline: float | None = None) -> np.ndarray:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            return await super().__call__(x, mask, causal)
        finally:
            self.running -= 1


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_steps_in_flight_never_exceed_the_limit_and_rows_stay_exact(max_in_flight: int) -> None:
    async def scenario() -> tuple[list, list, ConcurrencyProbe, StepBatcher]:
        step = ConcurrencyProbe()
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=3, wait_s=0.0, max_in_flight=max_in_flight))
        inputs = [_x(1, 5, i) for i in range(20)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        return inputs, outs, step, batcher

    inputs, outs, step, batcher = asyncio.run(scenario())
    for x, out in zip(inputs, outs):
        np.testing.assert_array_equal(out, x * 2)
    assert step.peak == max_in_flight  # 20 requests of <= 3 rows each keep every slot busy
    assert batcher.requests == 20 and batcher.steps == len(step.shapes)


class MixingStep:
    """A stand-in step that mixes positions like attention does, within a row only:
    out[b, i] = x[b, i] + (mean of x[b, j] over the keys j query i may see), 0 at padded
    queries. A padded key changing any real output would show up here."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], bool, bool | None]] = []

    async def __call__(self, x: np.ndarray, mask: np.ndarray | None = None, causal: bool | None = None,
                       deadline: float | None = None) -> np.ndarray:
        self.calls.append((x.shape, mask is not None, causal))
        await asyncio.sleep(0.01)
        return mixing(x, mask, bool(causal))


def mixing(x: np.ndarray, mask: np.ndarray | None, causal: bool) -> np.ndarray:
    b, s, _ = x.shape
    keys = np.ones((b, s), dtype=bool) if mask is None else mask
    out = np.zeros_like(x, dtype=np.float64)
    for r in range(b):
        for i in range(s):
            if not keys[r, i]:
                continue
            seen = [j for j in range(s) if keys[r, j] and (not causal or j <= i)]
            out[r, i] = x[r, i] + x[r, seen].mean(axis=0)
    return out


def test_mixed_lengths_share_a_step_and_each_gets_what_it_would_alone() -> None:
    lengths = [5, 7, 6, 5, 8, 3, 7, 6]

    async def scenario() -> tuple[list, list, MixingStep, StepBatcher]:
        step = MixingStep()
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=64, wait_s=0.02, max_padding_fraction=0.3))
        inputs = [_x(1 + i % 2, n, i) for i, n in enumerate(lengths)]
        masks = [None] * len(inputs)
        masks[2] = np.array([[1, 1, 1, 1, 0, 0]] * inputs[2].shape[0], dtype=bool)  # its own padding too
        causal = [i % 3 == 0 for i in range(len(inputs))]
        outs = await asyncio.gather(*(batcher.submit(x, m, c) for x, m, c in zip(inputs, masks, causal)))
        for x, m, c, out in zip(inputs, masks, causal, outs):
            np.testing.assert_allclose(out, mixing(x, m, c), rtol=1e-6, atol=1e-6)
        return inputs, outs, step, batcher

    inputs, outs, step, batcher = asyncio.run(scenario())
    assert all(out.shape == x.shape for x, out in zip(inputs, outs))
    assert batcher.steps < len(lengths) and batcher.mixed_steps >= 1
    stats = batcher.stats()
    assert 0 < stats["padded_token_share"] <= 0.3 and stats["padded_tokens"] > 0
    for shape, masked, causal in step.calls:  # causal and bidirectional never share a step
        assert causal is not None


def test_padding_stays_within_max_padding_fraction() -> None:
    async def scenario() -> MixingStep:
        step = MixingStep()
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=64, wait_s=0.02, max_padding_fraction=0.25))
        inputs = [_x(1, n, n) for n in (1, 2, 8, 8, 7, 16, 15, 2, 1, 9)]
        outs = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        for x, out in zip(inputs, outs):
            np.testing.assert_allclose(out, mixing(x, None, False), rtol=1e-6, atol=1e-6)
        return step

    step = asyncio.run(scenario())
    assert len(step.calls) < 10


def test_pad_group_keeps_the_fast_path_for_equal_lengths() -> None:
    from service.gang.batching import pad_group

    a, b = _x(2, 4, 0), _x(1, 4, 1)
    x, mask, padded = pad_group([(a, None), (b, None)])
    assert mask is None and padded == 0 and x.shape == (3, 4, 4)
    x, mask, padded = pad_group([(a, None), (_x(1, 6, 2), None)])
    assert x.shape == (3, 6, 4) and padded == 2 * 2
    assert mask is not None and mask[:2, 4:].sum() == 0 and mask[:2, :4].all() and mask[2].all()
    assert (x[:2, 4:] == 0).all()


def test_a_request_whose_deadline_passes_while_queued_is_answered_then_and_never_computed() -> None:
    """Issue 23: a queued request past its deadline is dropped (504 deadline_exceeded at the
    deadline, not when the step ahead of it ends), and no step ever carries its rows;
    a request already computing gets its error at its deadline too; the others are exact."""
    from service.contract.errors import DeadlineExceeded, DeadlineExceededBeforeStep

    drops: list[tuple[str, int]] = []

    async def scenario() -> tuple[list, float, float, RecordingStep, StepBatcher]:
        step = RecordingStep(delay_s=0.5)  # a slow step: what follows it queues
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=1, wait_s=0.0), on_drop=lambda r, n: drops.append((r, n)))
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        first = loop.create_task(batcher.submit(_x(1, 2, 0)))  # runs inline, 0.5 s
        await asyncio.sleep(0)
        late = loop.create_task(batcher.submit(_x(1, 3, 1), deadline=now + 0.1))  # queued behind it
        kept = loop.create_task(batcher.submit(_x(1, 4, 2), deadline=now + 5.0))
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceededBeforeStep):
            await late
        late_s = time.monotonic() - t0
        running = loop.create_task(batcher.submit(_x(1, 5, 3), deadline=time.monotonic() + 0.2))
        t1 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await running  # taken into the step after `kept`... or queued: either way at its deadline
        running_s = time.monotonic() - t1
        outs = [await first, await kept]
        return outs, late_s, running_s, step, batcher

    outs, late_s, running_s, step, batcher = asyncio.run(scenario())
    print(f"queued request answered {late_s:.3f}s after its deadline was set for 0.1s; running one {running_s:.3f}s for 0.2s")
    assert late_s < 0.4 and running_s < 0.45  # at the deadline, not when the 0.5 s step ends (loose: load)
    assert [s[1] for s in step.shapes if s[1] == 3] == [], "the expired request's rows were computed"
    assert len(outs) == 2 and batcher.stats()["expired_queued"] >= 1 and ("deadline", 1) in drops
    assert batcher.idle


def test_a_request_past_its_deadline_on_arrival_never_reaches_a_step() -> None:
    from service.contract.errors import DeadlineExceededBeforeStep

    async def scenario() -> RecordingStep:
        step = RecordingStep()
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=4, wait_s=0.0))
        with pytest.raises(DeadlineExceededBeforeStep) as info:
            await batcher.submit(_x(1, 2, 0), deadline=time.monotonic() - 0.001)
        assert info.value.status == 504 and info.value.code == "deadline_exceeded"
        return step

    assert asyncio.run(scenario()).shapes == []


def test_cancelled_queued_request_is_dropped_and_counted() -> None:
    drops: list[tuple[str, int]] = []

    async def scenario() -> RecordingStep:
        step = RecordingStep(delay_s=0.2)
        batcher = StepBatcher(step, BatchPolicy(max_batch_size=1, wait_s=0.0), on_drop=lambda r, n: drops.append((r, n)))
        first = asyncio.ensure_future(batcher.submit(_x(1, 2, 0)))
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(batcher.submit(_x(1, 7, 1)))
        await eventually_async(lambda: len(step.shapes) == 1, 5, "the first request's step running")
        await asyncio.sleep(0)  # `gone` reaches the queue behind it
        gone.cancel()  # the client disconnected
        await first
        await asyncio.sleep(0.3)  # by design: longer than a step (0.2 s), room for one it must not get
        return step

    step = asyncio.run(scenario())
    assert all(s[1] != 7 for s in step.shapes) and drops == [("cancelled", 1)]


def test_a_bounded_call_given_up_leaves_no_unretrieved_exception() -> None:
    """A Serve response cancelled at the bound ends its task with its own error
    (RequestCancelledError), not CancelledError; `bounded` reads it, so the loop never logs
    "Task exception was never retrieved" (seen in the GangServer's logs under faults)."""
    import gc
    import time

    from service.contract.deadlines import bounded

    class Cancelled(Exception):
        """What a cancelled call raises instead of CancelledError (as Serve's response does)."""

    async def call() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise Cancelled("cancelled") from None

    async def scenario() -> list[dict]:
        loop = asyncio.get_running_loop()
        reported: list[dict] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        with pytest.raises(TimeoutError):
            await bounded(call(), until=time.monotonic() + 0.05, timed_out=lambda: TimeoutError("bound"))
        await asyncio.sleep(0.05)  # by design: the cancelled task ends on the next loop turns
        gc.collect()  # an unretrieved task exception is reported when the task is freed
        return reported

    reported = asyncio.run(scenario())
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported


def test_deadline_sources_and_bad_values() -> None:
    from service.contract import deadlines
    from service.contract.errors import InvalidInput

    assert deadlines.header_timeout(None) is None and deadlines.header_timeout(" 0.5 ") == 0.5
    assert deadlines.oip_timeout({"timeout": 250000}) == 0.25 and deadlines.oip_timeout({}) is None
    for bad in ("-1", "0", "nan", "inf", "abc", "", "1e9"):
        with pytest.raises(InvalidInput) as info:
            deadlines.header_timeout(bad)
        assert info.value.status == 422 and info.value.code == "invalid_deadline"
    for bad in (-5, 0, "100", True, float("nan"), [1]):
        with pytest.raises(InvalidInput):
            deadlines.oip_timeout({"timeout": bad})
    # The earliest source wins; without any, request_timeout_s. Behind Serve's Python proxy the
    # header's deadline comes 50 ms + 2% early, at most 0.5 s (the proxy would answer 408 at it).
    assert deadlines.request_deadline(100.0, 120.0, None) == 220.0
    # Behind Serve's Python proxy (no front door): a margin before the proxy's own 408.
    assert deadlines.request_deadline(100.0, 120.0, 1.0, behind_serve_proxy=True) == pytest.approx(101.0 - 0.07)
    assert deadlines.request_deadline(100.0, 120.0, 6.0, behind_serve_proxy=True) == pytest.approx(106.0 - 0.17)
    assert deadlines.request_deadline(100.0, 120.0, 100.0, behind_serve_proxy=True) == pytest.approx(200.0 - 0.5)
    assert deadlines.request_deadline(100.0, 120.0, 1.0, 0.5, behind_serve_proxy=True) == 100.5
    # Behind the front door the ingress alone times the header: exactly what it says.
    assert deadlines.request_deadline(100.0, 120.0, 6.0, behind_serve_proxy=False) == 106.0
    assert deadlines.request_deadline(100.0, 120.0, 6.0, 5.0, behind_serve_proxy=False) == 105.0


def test_session_appends_share_the_core_deadlines_and_one_append_per_session_per_step() -> None:
    """service.sessions.batcher.AppendBatcher on the batching core: appends of distinct
    sessions share a step, a session's second append waits for the next one; a deadline
    that passes while queued drops the append (never run), one that passes while its step
    runs answers 504 at once and the step still completes."""
    from service.contract.errors import DeadlineExceeded, DeadlineExceededBeforeStep
    from service.sessions.batcher import AppendBatcher
    from service.sessions.registry import Session, StepItem

    steps: list[list[str]] = []

    async def run_step(items: list[StepItem], deadline: float | None) -> list[tuple[np.ndarray, dict]]:
        steps.append([item.session.id for item in items])
        await asyncio.sleep(0.2)
        return [(item.x * 2, {"session_id": item.session.id}) for item in items]

    def session(sid: str) -> Session:
        return Session(sid, time.time(), time.monotonic(), time.time())

    async def scenario() -> tuple[list, AppendBatcher]:
        batcher = AppendBatcher(run_step, max_sessions_per_step=8, max_rows_per_step=64, num_blocks=64,
                                blocks_for=lambda n: n, wait_s=0.0)
        a, b, c = session("a"), session("b"), session("c")
        x = np.ones((2, 4), dtype=np.float32)
        now = time.monotonic()
        results = await asyncio.gather(
            batcher.submit(a, x, None), batcher.submit(b, x, None), batcher.submit(a, x * 3, None),
            batcher.submit(c, x, now + 0.1),  # its step runs 0.2 s: 504 while it runs, the step completes
            return_exceptions=True)
        late = await asyncio.gather(batcher.submit(b, x, time.monotonic() - 1), return_exceptions=True)
        return [*results, *late], batcher

    results, batcher = asyncio.run(scenario())
    assert steps == [["a", "b", "c"], ["a"]], steps  # a's second append waits for the next step
    np.testing.assert_array_equal(results[2][0], np.full((2, 4), 6.0, dtype=np.float32))
    assert isinstance(results[3], DeadlineExceeded) and not isinstance(results[3], DeadlineExceededBeforeStep)
    assert isinstance(results[4], DeadlineExceededBeforeStep)  # never queued for a step
    stats = batcher.stats()
    assert (stats.steps, stats.appends, stats.expired_queued, stats.queued) == (2, 4, 1, 0), stats
    assert batcher.idle
