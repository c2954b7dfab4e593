"""verl's ``AsyncTokenBucket``: an asyncio token bucket with variable-size acquisitions.

The bucket holds at most ``max_tokens`` (default ``rate_limit``) and refills at ``rate_limit`` tokens per
second; it starts full. ``acquire(n)`` takes ``n`` tokens, sleeping until they have refilled. A request
larger than the bucket takes what there is, lets the balance go negative and sleeps for the shortfall
(``(n - tokens) / rate_limit``), so the long-run rate holds for any request size: over a window of ``T``
seconds at most ``max_tokens + rate_limit · T`` tokens are handed out.
"""

from __future__ import annotations

import asyncio


class AsyncTokenBucket:
    """``rate_limit``: tokens per second (> 0); ``max_tokens``: the burst (default ``rate_limit``)."""

    def __init__(self, rate_limit: float, max_tokens: float | None = None) -> None:
        if not rate_limit or rate_limit <= 0:
            raise ValueError(f"AsyncTokenBucket: rate_limit must be > 0 tokens/s, got {rate_limit!r}")
        self.rate_limit = float(rate_limit)
        self.max_tokens = float(max_tokens or rate_limit)
        self.tokens = self.max_tokens
        self.last_update: float | None = None
        self.lock = asyncio.Lock()

    def _refill(self, now: float) -> None:
        if self.last_update is None:
            self.last_update = now
        self.tokens = min(self.max_tokens, self.tokens + (now - self.last_update) * self.rate_limit)
        self.last_update = now

    async def acquire(self, num_tokens: float = 1.0) -> None:
        """Take ``num_tokens``, waiting (``asyncio.sleep``, the lock released) until they are there."""
        if num_tokens > self.max_tokens:  # never fits: go into debt and wait the shortfall out
            async with self.lock:
                self._refill(asyncio.get_running_loop().time())
                wait_s = max(num_tokens - self.tokens, 0.0) / self.rate_limit
                self.tokens -= num_tokens
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            return
        while True:
            async with self.lock:
                self._refill(asyncio.get_running_loop().time())
                if self.tokens >= num_tokens:
                    self.tokens -= num_tokens
                    return
                wait_s = (num_tokens - self.tokens) / self.rate_limit
            await asyncio.sleep(wait_s)
