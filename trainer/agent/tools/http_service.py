"""One JSON POST with verl's retry rules, for the tools that call a service (search,
SandboxFusion). Standard library only (`urllib`), run in a thread so the event loop goes on."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["RetryRule", "post_json", "post_json_blocking"]


@dataclass(frozen=True)
class RetryRule:
    """When a call is tried again, as verl's `requests` loops decide."""

    attempts: int
    """Tries in all."""
    statuses: tuple[int, ...]
    """HTTP statuses tried again (another error status ends the call)."""
    on_connection_error: bool
    """Whether a refused connection or a timeout is tried again (else it ends the call)."""
    delay: float = 1.0
    """Seconds before try k+1: `delay * k` (verl's linear `INITIAL_RETRY_DELAY * (attempt + 1)`)."""


def post_json_blocking(url: str, payload: Any, timeout: float, rule: RetryRule) -> tuple[Any | None, str | None]:
    """:func:`post_json` in the calling thread (a reward scorer's worker threads)."""
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last = None
    for attempt in range(rule.attempts):
        retry = False
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read().decode()), None
        except urllib.error.HTTPError as e:
            last = f"API Request Error: HTTP {e.code} ({e.reason}) on attempt {attempt + 1}/{rule.attempts}"
            retry = e.code in rule.statuses
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            last = f"Connection Error: {getattr(e, 'reason', e)}"
            retry = rule.on_connection_error
        except ValueError as e:  # the body was not JSON
            last = f"API Response JSON Decode Error: {e}"
        if not retry:
            break
        if attempt < rule.attempts - 1:
            time.sleep(rule.delay * (attempt + 1))
    return None, f"API Call Failed: {last}"


async def post_json(url: str, payload: Any, timeout: float, rule: RetryRule) -> tuple[Any | None, str | None]:
    """`(the response's JSON, None)`, or `(None, what failed)` after `rule`'s tries."""
    return await asyncio.to_thread(post_json_blocking, url, payload, timeout, rule)
