"""Test configuration shared by the whole suite.

Every asyncio test runs twice, on asyncio with debug mode on and on uvloop (anyio's loop
matrix; asyncpg runs its suite several ways), and fails when the loop's exception handler
fires: an exception in a callback or a task nobody awaited is a bug even when the test's own
assertions pass (uvloop's ``_testbase``).
"""

from __future__ import annotations

import asyncio
import glob
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

import shm

_loop_errors: list[str] = []


def _record(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    _loop_errors.append(f"{context.get('message', '')}: {exc!r}" if exc else str(context.get("message")))
    loop.default_exception_handler(context)


def _asyncio_debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.set_exception_handler(_record)
    return loop


def _uvloop_loop() -> asyncio.AbstractEventLoop:
    loop = uvloop.new_event_loop()
    loop.set_exception_handler(_record)
    return loop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], Any]]:
    return {"asyncio": _asyncio_debug_loop, "uvloop": _uvloop_loop}


def pytest_configure(config: pytest.Config) -> None:
    # pytest-asyncio's runner applies its own debug setting to every loop it creates: keep it
    # on, or it would switch off the debug mode the asyncio factory turned on
    if config.getoption("asyncio_debug", None) is None:
        config.option.asyncio_debug = True


def _check_loop_errors(when: str) -> None:
    if _loop_errors:
        errors = "; ".join(_loop_errors)
        _loop_errors.clear()
        pytest.fail(f"the event loop's exception handler fired {when}: {errors}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _loop_errors.clear()
    result = yield
    _check_loop_errors("during the test")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    _check_loop_errors("while the test's loop was torn down")
    return result


# -- rings ------------------------------------------------------------------------------------------


@pytest.fixture
def no_segment_left() -> Iterator[None]:
    """Every ring a test creates in this process is closed and unlinked by its end (the Hub,
    stream and sync reader modules use it on every test: ``pytestmark = usefixtures(...)``)."""
    created: list[str] = []
    create = shm.Ring.create.__func__  # type: ignore[attr-defined]

    def tracking(cls: type[shm.Ring], *args: Any, **kw: Any) -> shm.Ring:
        r: shm.Ring = create(cls, *args, **kw)
        created.append(r.name)
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shm.Ring, "create", classmethod(tracking))
        yield
    left = [p for name in created for p in glob.glob(os.path.join(shm.SHM_DIR, glob.escape(name) + "*"))]
    for p in left:
        os.unlink(p)
    assert not left, f"files left in /dev/shm: {left}"


@pytest.fixture
def ring() -> Iterator[shm.Ring]:
    """A fresh 1 MiB ring, closed and unlinked at the end."""
    with shm.Ring.create(capacity=1 << 20) as r:
        yield r


@pytest.fixture
def ring2() -> Iterator[shm.Ring]:
    """A second fresh 1 MiB ring."""
    with shm.Ring.create(capacity=1 << 20) as r:
        yield r
