"""One request's time limit (relay/sinks/webhook/deadline.py): as asyncio.timeout, the time
running out is a TimeoutError and cancels what was awaited; a cancellation from elsewhere
stays one, even when the time ran out as well; and nothing is left pending on the task."""

from __future__ import annotations

import asyncio

import pytest

from relay.sinks.webhook.deadline import within


async def test_an_answer_in_time_is_returned_and_leaves_no_timer() -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()
    loop.call_later(0.01, fut.set_result, 7)
    assert await within(5.0, fut) == 7
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.05)  # no late cancellation lands on the task
    assert task.cancelling() == 0


async def test_time_running_out_is_a_timeout_error_and_cancels_the_request() -> None:
    cancelled = asyncio.Event()

    async def request() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1

    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await within(0.05, request())
    assert 0.04 <= asyncio.get_running_loop().time() - started < 1.0
    assert cancelled.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the task goes on as if uncancelled
    await asyncio.sleep(0)  # and is not cancelled at its next wait


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def caller() -> None:
        await within(10.0, asyncio.sleep(10))

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stop_that_lands_with_the_time_running_out_is_not_a_timeout() -> None:
    seen: list[BaseException] = []

    async def request() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            # The time ran out; the relay's stop cancels the task in the same turn.
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            raise

    async def caller() -> None:
        try:
            await within(0.02, request())
        except BaseException as exc:
            seen.append(exc)
            raise

    task = asyncio.create_task(caller())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seen) == 1 and type(seen[0]) is asyncio.CancelledError


async def test_an_error_of_the_request_comes_out_as_it_is() -> None:
    async def request() -> None:
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError, match="reset"):
        await within(5.0, request())


async def test_a_request_that_swallows_the_cancellation_leaves_none_pending() -> None:
    async def stubborn() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return 5  # a request that ends its own way when cancelled
        return 0

    assert await within(0.02, stubborn()) == 5
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.01)  # not cancelled at its next wait
