"""The status app served over real sockets for its end-to-end tests: the real aiohttp server on
127.0.0.1:<free port> or on a unix socket in a short directory, with State filled in as a running
daemon's and `actions` recording what the operator asked for; fixtures for each, and a JSON GET.

Test modules import the fixtures by name (`from ... import tcp as tcp`) for pytest to find them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from rigs.harness import free_port
from rigs.status_state import RecordingActions, running_state
from supervisor.settings import Settings, StatusSettings
from supervisor.state import State
from supervisor.status.listener import StatusListener
from supervisor.status.routes import build_app

TOKEN = "t0ken-for-tests"


async def start_status_server(app: web.Application, listen: str, limits: StatusSettings | None = None) -> web.AppRunner:
    """Serve `app` on `host:port` or `unix:/path` as the daemon does. Stop it with `await runner.cleanup()`."""
    listener = StatusListener(app, listen, limits or StatusSettings())
    await listener.open()
    return listener.runner
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Served:
    base: str
    state: State
    actions: RecordingActions
    socket_path: Path | None = None

    def session(self) -> aiohttp.ClientSession:
        connector = aiohttp.UnixConnector(path=str(self.socket_path)) if self.socket_path else None
        return aiohttp.ClientSession(self.base, connector=connector, timeout=aiohttp.ClientTimeout(total=10))


@dataclass
class Server:
    """Start the status app on a real listener; stop it in `stop`."""

    listen: str
    token_file: Path | None
    reload_result: str | None = "ok"

    async def start(self) -> Served:
        self.state = running_state()
        self.actions = RecordingActions(self.state, self.reload_result)  # type: ignore[arg-type]
        settings = Settings(status=StatusSettings(listen=self.listen, token_file=self.token_file))
        self.runner = await start_status_server(build_app(self.state, settings, self.actions), self.listen)
        if self.listen.startswith("unix:"):
            return Served("http://localhost", self.state, self.actions, Path(self.listen[5:]))
        return Served(f"http://{self.listen}", self.state, self.actions)

    async def stop(self) -> None:
        await self.runner.cleanup()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
async def tcp(token_file: Path) -> AsyncIterator[Served]:
    server = Server(f"127.0.0.1:{free_port()}", token_file)
    served = await server.start()
    try:
        yield served
    finally:
        await server.stop()


@pytest.fixture
async def unix(rundir: Path) -> AsyncIterator[Served]:
    server = Server(f"unix:{rundir / 'status.sock'}", None)
    served = await server.start()
    try:
        yield served
    finally:
        await server.stop()


async def get_json(session: aiohttp.ClientSession, method: str, path: str, **kwargs) -> tuple[int, dict]:
    async with session.request(method, path, **kwargs) as response:
        assert response.content_type == "application/json", (response.status, await response.text())
        return response.status, await response.json()
