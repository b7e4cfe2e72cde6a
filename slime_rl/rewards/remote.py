"""`remote_rm`: score samples with a reward model served over HTTP (`--rm-url`).

Protocol: one POST per sample to the URL with the JSON body
`{"prompt": str, "response": str, "label": any, "metadata": dict}`; the answer is a JSON number
or an object holding the score under the `--reward-key` name (default "score") plus, optionally,
other numeric keys, which are logged as metrics.

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff
(`backoff_s * 2**k`, capped at `max_backoff_s`), at most `max_retries` times after the first try;
after the last one a `RewardError` names the URL, the number of tries and the last error. Other
4xx answers and bodies that are not JSON fail at once (retrying would not change them).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

import httpx

from slime_rl.data import Sample


class RemoteRewardError(RuntimeError):
    """The reward model at --rm-url did not give a usable answer; the message names the URL."""


_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RemoteRewardModel:
    """A callable reward: `await rm(sample)` -> float or dict, as the server answered.

    One `httpx.AsyncClient` per event loop is kept (connections are reused across samples; a
    client cannot move between loops). `max_connections` bounds concurrent requests per loop.
    """

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, max_connections: int = 256) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--rm-url {url!r}: expected an http:// or https:// URL")
        if max_retries < 0 or timeout_s <= 0:
            raise ValueError(f"--rm-url {url}: need max_retries >= 0 and timeout_s > 0")
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_connections = max_connections
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary())
        self.__name__ = f"remote_rm({url})"

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            limits = httpx.Limits(max_connections=self.max_connections)
            client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close the client of the running loop (others go with their loops)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    @staticmethod
    def payload(sample: Sample) -> dict[str, Any]:
        return {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
                "metadata": sample.metadata}

    async def __call__(self, sample: Sample) -> float | dict[str, Any]:
        body = self.payload(sample)
        tries = self.max_retries + 1
        last_error = ""
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                resp = await self._client().post(self.url, json=body)
            except httpx.TransportError as exc:  # connect/read errors and timeouts
                last_error = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code in _RETRY_STATUS:
                last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise RemoteRewardError(f"--rm-url {self.url}: HTTP {resp.status_code} (not retried): "
                                        f"{resp.text[:200]}")
            return self._parse(resp)
        raise RemoteRewardError(f"--rm-url {self.url}: no answer after {tries} tries "
                                f"(timeout {self.timeout_s}s each); last error: {last_error}")

    def _parse(self, resp: httpx.Response) -> float | dict[str, Any]:
        try:
            value = resp.json()
        except json.JSONDecodeError as exc:
            raise RemoteRewardError(f"--rm-url {self.url}: answer is not JSON: {resp.text[:200]!r}") from exc
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise RemoteRewardError(f"--rm-url {self.url}: expected a number or an object with a score, "
                                    f"got {value!r:.200}")
        return value
