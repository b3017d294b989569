"""The real controller server on loopback, running its own event loop in a background thread, for
tests whose main thread is busy with something synchronous (a vLLM engine, the plugin's link).

The core may only be touched from the server's loop: use ``call`` to run a function there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings

T = TypeVar("T")


class ControllerThread:
    def __init__(self, **settings: Any) -> None:
        self._settings = load_settings(**{"grpc_port": 0, "http_port": 0, **settings})
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="controller-under-test")
        self._thread.start()
        self.server: RunningServer = self._run(start_server(self._settings))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    @property
    def port(self) -> int:
        return self.server.grpc_port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, fn: Callable[[ControllerCore], T]) -> T:
        """Run ``fn(core)`` on the server's loop and return its result."""

        async def run() -> T:
            return fn(self.server.core)

        result: T = self._run(run())
        return result

    def wait_for(self, predicate: Callable[[ControllerCore], bool], timeout: float = 20.0,
                 what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call(predicate):
                return
            time.sleep(0.05)
        raise AssertionError(f"controller: timed out after {timeout} s waiting for {what}")

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.server.stop(grace_seconds=0.1))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
