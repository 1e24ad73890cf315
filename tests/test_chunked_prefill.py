"""Chunked prefill (issue 52, item 3): the session batcher and registry over a real rank model and
KV pool (one rank, no Ray): a long append is computed a chunk per step, its answer is unchanged
by the chunking (against the dense causal reference, torch's own nn.MultiheadAttention), and
other sessions' one-row appends complete while it is still in progress. Ordering and progress
are asserted through the steps' composition and the tasks' states, never wall-clock time.
"""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from service.parallel import ParallelGroup, TensorParallelAttention
from service.parallel.kv_cache import PagedKVPool
from service.parallel.weights import random_weights, shard_dense
from service.sessions.batcher import AppendBatcher
from service.sessions.registry import Limits, Session, SessionRegistry, StepItem
from tests.reference import reference, relative_error

pytestmark = pytest.mark.unit

E, HEADS, BLOCK = 64, 4, 4
TOL = 1e-5


class LocalGang:
    """A one-rank gang's session step, as Gang.session_step runs it: plan on the registry, the
    model's append over the pool, commit. Records which sessions (and how many rows) each step held."""

    def __init__(self, registry: SessionRegistry, weights: dict[str, torch.Tensor]) -> None:
        self.registry = registry
        self.model = TensorParallelAttention(E, HEADS, ParallelGroup.single())
        self.model.load_shard(shard_dense(weights, 0, 1))
        lim = registry.limits
        self.pool = PagedKVPool(lim.num_blocks, lim.block_size, HEADS, E // HEADS, torch.float32, torch.device("cpu"))
        self.steps: list[dict[str, int]] = []  # per step: session id -> rows it computed
        self.generation = 1

    async def run_step(self, items: list[StepItem], deadline: float | None) -> list[tuple[Any, Any]]:
        await asyncio.sleep(0)  # a real step leaves the loop: appends submitted meanwhile queue up
        step = self.registry.plan(items, generation=self.generation, version=1)
        if not step.plan.sessions:
            return step.commit(np.zeros((0, E), np.float32))
        with torch.inference_mode():
            out = self.model.append(torch.from_numpy(np.ascontiguousarray(step.x)), step.plan, self.pool).numpy()
        self.steps.append({item.session.id: item.rows for item in step.live})
        return step.commit(out)


class TimedGang(LocalGang):
    """A LocalGang whose steps take as long as a real stack's would, in shape: a fixed part
    (FIXED_S: the weights read, what a step of one-row appends costs) plus ROW_S for every row of
    a several-row item (a chunk's compute), slept after the step is computed."""

    FIXED_S, ROW_S = 0.1, 0.01

    async def run_step(self, items: list[StepItem], deadline: float | None) -> list[tuple[Any, Any]]:
        answers = await super().run_step(items, deadline)
        await asyncio.sleep(self.FIXED_S + self.ROW_S * sum(n for n in self.steps[-1].values() if n > 1))
        return answers


def setup(chunk: int, num_blocks: int = 64, chunk_linger_s: float = 0.0, step_ratio: float = 0.0,
          gang_type: type[LocalGang] = LocalGang) -> tuple[SessionRegistry, LocalGang, AppendBatcher]:
    registry = SessionRegistry(Limits(num_blocks=num_blocks, block_size=BLOCK, max_sessions=16, max_session_tokens=512,
                                      idle_timeout_s=600, bytes_per_token=8), owner="gangA")
    gang = gang_type(registry, random_weights(E, 3))
    batcher = AppendBatcher(gang.run_step, max_sessions_per_step=8, max_rows_per_step=4096,
                            num_blocks=num_blocks, blocks_for=registry.limits.blocks_for, chunk_rows=chunk,
                            chunk_linger_s=chunk_linger_s, chunk_step_ratio=step_ratio, abandon=registry.abandon)
    return registry, gang, batcher


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, E), dtype=np.float32)


def want(seq: np.ndarray) -> torch.Tensor:
    return reference(seq, causal=True, weights=random_weights(E, 3), num_heads=HEADS)


def test_a_chunked_prefill_and_later_appends_equal_the_dense_causal_reference() -> None:
    """A 23-row prefill in chunks of 5 (5 steps), then 1 row, then 12 rows (3 chunks): every
    answer equals causal MHA over the whole sequence; the same with chunking off."""
    for chunk in (5, 0):
        registry, gang, batcher = setup(chunk)

        async def run() -> None:
            s = registry.open()
            seq = np.zeros((0, E), np.float32)
            for n, seed in ((23, 1), (1, 2), (12, 3)):
                x = rows(n, seed)
                out, info = await batcher.submit(s, x, None)
                seq = np.concatenate([seq, x])
                assert out.shape == (n, E) and info["length"] == len(seq)
                assert relative_error(torch.from_numpy(out), want(seq)[-n:]) <= TOL, (chunk, n)

        asyncio.run(run())
        chunks = [step[next(iter(step))] for step in gang.steps]
        assert chunks == ([5, 5, 5, 5, 3, 1, 5, 5, 2] if chunk else [23, 1, 12]), chunks
        assert batcher.stats().prefill_chunks == (6 if chunk else 0)


def test_a_recompute_is_chunked_too_and_stays_exact() -> None:
    """A session evicted (its K/V gone) recomputes its 30 kept rows plus its new 2 in chunks
    of 8: its answer is still the reference's, and the recompute is counted once."""
    registry, gang, batcher = setup(8, num_blocks=12)  # 48 tokens: two 30-token sessions do not fit

    async def run() -> None:
        a, b = registry.open(), registry.open()
        xa, xb = rows(30, 11), rows(30, 12)
        await batcher.submit(a, xa, None)
        await batcher.submit(b, xb, None)  # evicts a
        assert a.cached == 0 and registry.evictions >= 1
        x = rows(2, 13)
        out, info = await batcher.submit(a, x, None)
        assert info["recomputed_tokens_this_append"] == 30 and registry.recomputed_tokens >= 30
        assert relative_error(torch.from_numpy(out), want(np.concatenate([xa, x]))[-2:]) <= TOL

    asyncio.run(run())
    assert [list(step.values())[0] for step in gang.steps[-4:]] == [8, 8, 8, 8]  # 32 rows: 30 kept + 2


def test_one_row_appends_of_another_session_complete_while_a_long_prefill_is_in_progress() -> None:
    """Session A prefills 64 rows in chunks of 8; session B appends one row at a time meanwhile.
    Each of B's appends shares a step with one of A's chunks and is answered before A is; A's
    answer is still the reference's, and B's too."""
    registry, gang, batcher = setup(8)

    async def run() -> str:
        a, b = registry.open(), registry.open()
        xa = rows(64, 21)
        prefill = asyncio.create_task(batcher.submit(a, xa, None))
        seq_b = rows(2, 22)
        await batcher.submit(b, seq_b, None)
        answered_while_prefilling = 0
        for i in range(4):
            x = rows(1, 30 + i)
            out, _ = await batcher.submit(b, x, None)
            seq_b = np.concatenate([seq_b, x])
            assert relative_error(torch.from_numpy(out), want(seq_b)[-1:]) <= TOL
            answered_while_prefilling += not prefill.done()
        assert answered_while_prefilling == 4  # every one-row append answered before the prefill
        out, info = await prefill
        assert info["length"] == 64
        assert relative_error(torch.from_numpy(out), want(xa)) <= TOL
        return a.id

    a_id = asyncio.run(run())
    shared = [step for step in gang.steps if len(step) == 2]
    assert len(shared) >= 5, gang.steps  # B's five appends each rode with one of A's chunks
    assert all(max(step.values()) <= 8 for step in gang.steps)  # no step computed more than a chunk
    assert [step[a_id] for step in gang.steps if a_id in step] == [8] * 8


def test_with_a_step_ratio_a_shared_chunk_shrinks_to_fit_beside_the_decoders_and_the_prefill_stays_exact() -> None:
    """tunables.gang.session_prefill_step_ratio = 2.5 over steps shaped as a real stack's
    (TimedGang: 100 ms fixed, 10 ms a chunk row): two sessions decode (their first step alone
    teaches the budget a decode step's time) while a third prefills 300 rows in chunks of at
    most 128. Its first chunk beside them is a probe of 128 / 16 = 8 rows (no row cost known
    yet: sized blind, it would be their slowest step); from the second on, a chunk beside them
    computes about (2.5 - 1) x 100 ms / 10 ms = 15 rows, never the 128 a fixed chunk would; a
    chunk alone keeps 128. Every answer is the dense reference's."""
    registry, gang, batcher = setup(128, num_blocks=128, step_ratio=2.5, gang_type=TimedGang)

    async def run() -> str:
        a, b, p = registry.open(), registry.open(), registry.open()
        seqs = {a.id: rows(1, 41), b.id: rows(1, 42)}
        await asyncio.gather(batcher.submit(a, seqs[a.id], None), batcher.submit(b, seqs[b.id], None))
        xp = rows(300, 43)
        prefill = asyncio.create_task(batcher.submit(p, xp, None))

        async def decode(s: Session, seed: int) -> None:
            while not prefill.done():
                x = rows(1, seed)
                seed += 2
                out, _ = await batcher.submit(s, x, None)
                seqs[s.id] = np.concatenate([seqs[s.id], x])
                assert relative_error(torch.from_numpy(out), want(seqs[s.id])[-1:]) <= TOL

        await asyncio.gather(decode(a, 100), decode(b, 101))
        out, info = await prefill
        assert info["length"] == 300 and relative_error(torch.from_numpy(out), want(xp)) <= TOL
        return p.id

    p_id = asyncio.run(run())
    shared = [step[p_id] for step in gang.steps if p_id in step and len(step) > 1]
    alone = [step[p_id] for step in gang.steps if p_id in step and len(step) == 1]
    assert shared[0] == 8 and len(shared) >= 4, gang.steps
    # The rule gives 15. A busy machine delays the slept steps: a delay of the decode step the
    # budget learnt from adds room (at 0.5 s, 90 rows; a niced unit run beside the Ray tests saw
    # one of over a second: [8, 128, 73, 51, 40]), one of a chunk's step takes it away (down to
    # the floor, 128 / 16): the fixed 128 at most once, and about 15 on most (the median below).
    assert all(8 <= n <= 128 for n in shared[1:-1]) and shared[1:-1].count(128) <= 1, shared
    assert sorted(shared[1:-1])[len(shared[1:-1]) // 2] <= 40, shared
    assert all(n == 128 for n in alone[:-1]), alone  # the last chunk of either kind is what is left


def test_a_chunk_waits_for_the_sessions_of_the_step_before_and_no_longer_than_its_bound() -> None:
    """Sessions B and C decode (one row each, their next append a client round trip after the
    answer) while A prefills 64 rows in chunks of 8. With the chunk linger, every chunk after
    the first shares its step with both; without it, chunks also run steps alone (what the
    appends then wait behind). A chunk whose sessions do not come back runs alone once its
    linger's bound passes, and the prefill completes."""
    round_trip_s = 0.005
    for linger in (30.0, 0.0):
        registry, gang, batcher = setup(8, chunk_linger_s=linger)

        async def decode(s: Session, seed: int) -> None:
            await batcher.submit(s, rows(1, seed), None)
            await asyncio.sleep(round_trip_s)

        async def run() -> str:
            a, b, c = registry.open(), registry.open(), registry.open()
            await asyncio.gather(batcher.submit(b, rows(2, 60), None), batcher.submit(c, rows(2, 61), None))
            prefill = asyncio.create_task(batcher.submit(a, rows(64, 62), None))
            seed = 100
            while not prefill.done():
                await asyncio.gather(decode(b, seed), decode(c, seed + 1))
                seed += 2
            _, info = await prefill
            assert info["length"] == 64
            return a.id

        a_id = asyncio.run(run())
        chunk_steps = [step for step in gang.steps if a_id in step]
        assert [step[a_id] for step in chunk_steps] == [8] * 8
        alone = sum(1 for step in chunk_steps[1:] if len(step) == 1)
        if linger:
            assert alone == 0, gang.steps
        else:
            assert alone >= 3, gang.steps  # what the linger is for: chunks alone between the decoders' steps

    registry, gang, batcher = setup(8, chunk_linger_s=0.2)

    async def stops() -> str:
        b, d = registry.open(), registry.open()
        prefill = asyncio.create_task(batcher.submit(d, rows(24, 70), None))
        await asyncio.sleep(0)
        await batcher.submit(b, rows(1, 71), None)  # shares a step with a chunk, then B stops
        _, info = await prefill
        assert info["length"] == 24
        return d.id

    d_id = asyncio.run(stops())
    assert [step for step in gang.steps if d_id in step][-1] == {d_id: 8}, gang.steps

    # Only a chunk waits: one-row appends with no prefill in progress never linger for the
    # sessions of the step before (the 30 s bound would show as the 10 s guard's timeout).
    registry, gang, batcher = setup(8, chunk_linger_s=30.0)

    async def decoders() -> None:
        b, c = registry.open(), registry.open()
        await asyncio.gather(batcher.submit(b, rows(1, 80), None), batcher.submit(c, rows(1, 81), None))
        for seed in range(3):  # C stopped: B's appends go on alone
            await asyncio.wait_for(batcher.submit(b, rows(1, 90 + seed), None), 10)

    asyncio.run(decoders())


def test_a_session_s_next_append_waits_for_its_chunked_one() -> None:
    """Two appends of one session queued together: the second is planned only after the first's
    last chunk (a session's appends stay in order), and both answers are right."""
    registry, gang, batcher = setup(4)

    async def run() -> None:
        s = registry.open()
        x1, x2 = rows(10, 41), rows(1, 42)
        first = asyncio.create_task(batcher.submit(s, x1, None))
        await asyncio.sleep(0)
        second = asyncio.create_task(batcher.submit(s, x2, None))
        (o1, _), (o2, info) = await first, await second
        assert info["length"] == 11
        ref = want(np.concatenate([x1, x2]))
        assert relative_error(torch.from_numpy(o1), ref[:10]) <= TOL
        assert relative_error(torch.from_numpy(o2), ref[10:]) <= TOL

    asyncio.run(run())
    assert [list(step.values())[0] for step in gang.steps] == [4, 4, 2, 1]


def test_an_append_abandoned_between_chunks_appends_nothing() -> None:
    """The caller of a chunked append goes away after its first chunk: the session's length
    stays, its claim is settled as not appended, and the next append is right."""
    registry, gang, batcher = setup(4)

    async def run() -> None:
        s: Session = registry.open()
        x0 = rows(3, 50)
        await batcher.submit(s, x0, None)
        admission = registry.admit(s, "k1", b"digest")
        task = asyncio.create_task(batcher.submit(s, rows(12, 51), None, claim=admission.claim))
        while not gang.steps or s.id not in gang.steps[-1] or len(gang.steps) < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        assert s.length == 3 and admission.claim is not None and admission.claim.state.value == "settled"
        assert not admission.claim.appended
        x = rows(1, 52)
        out, info = await batcher.submit(s, x, None)
        assert info["length"] == 4
        assert relative_error(torch.from_numpy(out), want(np.concatenate([x0, x]))[-1:]) <= TOL

    asyncio.run(run())
