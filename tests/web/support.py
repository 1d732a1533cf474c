"""An HTTP client of the console for the non-browser tests: it signs in like a
browser does (the login form's double-submit token, our own ``Origin``), and
keeps every response it got, headers and body, for the secret scan."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
LOGIN_CSRF = re.compile(r'name="login_csrf" value="([^"]+)"')


@dataclass
class Seen:
    method: str
    url: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def text(self) -> str:
        head = "\n".join(f"{k}: {v}" for k, v in self.headers)
        return f"{self.method} {self.url} {self.status}\n{head}\n\n" + self.body.decode(
            "utf-8", "replace"
        )


@dataclass
class WebUser:
    base_url: str
    seen: list[Seen] = field(default_factory=list)
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.base_url, follow_redirects=False, timeout=30.0
        )

    @property
    def origin(self) -> str:
        return self.base_url.rstrip("/")

    async def close(self) -> None:
        await self.client.aclose()

    def _keep(self, r: httpx.Response) -> httpx.Response:
        request = r.request
        headers = list(r.headers.items())
        self.seen.append(Seen(request.method, str(request.url), r.status_code, headers, r.content))
        return r

    async def get(self, path: str, **kw: Any) -> httpx.Response:
        return self._keep(await self.client.get(path, **kw))

    async def post(
        self, path: str, data: dict[str, str], *, origin: str | None = "", **kw: Any
    ) -> httpx.Response:
        """A form post; ``Origin`` is ours unless given (``None`` sends none)."""
        headers = dict(kw.pop("headers", {}))
        if origin == "":
            headers["Origin"] = self.origin
        elif origin is not None:
            headers["Origin"] = origin
        return self._keep(await self.client.post(path, data=data, headers=headers, **kw))

    async def sign_in(self, user: str, token: str, next_path: str = "/") -> httpx.Response:
        page = await self.get("/login")
        match = LOGIN_CSRF.search(page.text)
        assert match, page.text
        form = {"login_csrf": match.group(1), "user": user, "token": token, "next": next_path}
        return await self.post("/login", form)

    async def csrf(self) -> str:
        page = await self.get("/tasks")
        match = CSRF.search(page.text)
        assert match, (page.status_code, page.text[:500])
        return match.group(1)

    async def events(self, path: str, until: Any, max_events: int = 1000) -> list[dict[str, Any]]:
        """Reads the event stream at ``path`` until ``until(events)`` holds; the
        stream's whole text is kept for the scan."""
        events: list[dict[str, Any]] = []
        raw = bytearray()
        async with self.client.stream("GET", path) as r:
            assert r.status_code == 200, r.status_code
            assert r.headers["content-type"].startswith("text/event-stream")
            name = None
            async for line in r.aiter_lines():
                raw += (line + "\n").encode()
                if line.startswith("event: "):
                    name = line[len("event: ") :]
                elif line.startswith("data: ") and name == "task":
                    events.append(json.loads(line[len("data: ") :]))
                elif line.startswith("data: ") and name == "ready":
                    events.append({"ready": True})
                if until(events) or len(events) >= max_events:
                    break
            self.seen.append(
                Seen("GET", str(r.request.url), r.status_code, list(r.headers.items()), bytes(raw))
            )
        return events
