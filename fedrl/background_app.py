"""Serve an aiohttp application on its own event loop in a background thread.

The coordinator runs inside a Flower ServerApp whose main loop is synchronous: the patch
store it embeds and its monitor (metrics, dashboard) each run this way beside it.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable

from aiohttp import web


class BackgroundApp:
    def __init__(
        self,
        make_app: Callable[[], web.Application],
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ):
        self.make_app, self.name, self.host, self.port, self.tls = make_app, name, host, port, tls
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._runner: web.AppRunner | None = None
        self._error: OSError | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def start(self):
        """Listen, or raise at once with the reason (a busy port, say); nothing is left running."""
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"{self.name} on {self.host}:{self.port} did not start within 30 s")
        if self._error is not None:
            self._thread.join()
            raise OSError(
                f"{self.name} could not listen on {self.host}:{self.port}: {self._error}"
            ) from self._error
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def boot():
            # open streams (a dashboard's event stream) end on the app's on_shutdown; what is still
            # running after a few seconds is cut rather than waited for
            self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=3.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.tls)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        try:
            self._loop.run_until_complete(boot())
        except OSError as err:
            self._error = err
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
