from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigs.daemon import daemons
from rigs.harness import haproxy_binary, short_tmpdir
from tests.support.watchdog import dump_tasks_after

CORPUS = Path(__file__).parent / "corpus"

if os.environ.get("HAPROXY_BIN"):
    # Settings that name `haproxy` (the default), and `haproxy -c` in the tests, find the chosen
    # binary first; `make test-all` runs the suite once per binary this way.
    os.environ["PATH"] = f"{Path(haproxy_binary()).parent}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture(autouse=True)
def _dump_tasks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    timeout = float(request.config.getini("timeout") or 0)
    if timeout <= 0:
        yield
        return
    with dump_tasks_after(max(timeout - 20, timeout * 0.9)):
        yield


@pytest.fixture(scope="session")
def haproxy() -> str:
    return haproxy_binary()


@pytest.fixture
def rundir() -> Iterator[Path]:
    """A short directory for unix sockets, removed after the test."""
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make(rundir: Path):
    """make(rendered, settings) -> a daemon (not started) in its own directory; all stopped after."""
    with daemons(rundir) as factory:
        yield factory


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.cfg"))
