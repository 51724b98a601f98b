"""The ready callback: tell the pool manager this worker accepts jobs."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("llorch.callback")


async def send_ready(url: str, payload: dict[str, object], deadline_s: float, first_delay_s: float = 0.25) -> bool:
    """POST `payload` to `url` until a 2xx answer, with exponential backoff for at most `deadline_s`."""
    import httpx  # here, not at start-up: a worker told of no callback never needs it (~50 ms of imports)

    give_up = time.monotonic() + deadline_s
    delay = first_delay_s
    attempt = 0
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            attempt += 1
            try:
                response = await client.post(url, json=payload)
                if response.is_success:
                    log.info("ready callback accepted", extra={"url": url, "attempt": attempt})
                    return True
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            remaining = give_up - time.monotonic()
            log.warning("ready callback failed", extra={"url": url, "attempt": attempt, "error": problem})
            if remaining <= 0:
                return False
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 5.0)
