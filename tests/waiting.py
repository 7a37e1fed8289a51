"""Waiting for a state in tests: a bounded number of looks, never a clock assertion."""

import asyncio
import time


def until(predicate, what: str, tries: int = 1000, every: float = 0.01):
    """Look at ``predicate()`` up to ``tries`` times, ``every`` s apart; its first true value,
    or AssertionError naming ``what`` (``what`` may be a callable: called for the message)."""
    for _ in range(tries):
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"never happened: {what() if callable(what) else what}")


async def until_async(predicate, what: str, tries: int = 2000, every: float = 0.005):
    """``until`` inside an event loop (the loop runs between looks)."""
    for _ in range(tries):
        value = predicate()
        if value:
            return value
        await asyncio.sleep(every)
    raise AssertionError(f"never happened: {what() if callable(what) else what}")
