"""A run's monitor: `/metrics` (Prometheus text), `/dashboard` (a live page) and `/events`
(server-sent events), all read from one EventLog.

The coordinator serves it beside its run (`monitor_port`); `fedrl dashboard RUN_DIR` serves
the same app for a run that is going on elsewhere or is over, by following its events.jsonl.
The page is one self-contained HTML file: no CDN, no external script.
"""

from __future__ import annotations

import asyncio
import json
import threading
from importlib import resources
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from fedrl.background_app import BackgroundApp
from fedrl.run_events import EventLog, follow
from fedrl.run_metrics import RunMetrics

PUSH_EVERY_S = 0.25  # how often a dashboard's stream is given the new events
KEEPALIVE_S = 10.0


def dashboard_html() -> bytes:
    return resources.files("fedrl").joinpath("dashboard.html").read_bytes()


def make_monitor_app(log: EventLog, metrics: RunMetrics) -> web.Application:
    routes = web.RouteTableDef()
    closing: dict[str, asyncio.Event] = {}
    page = dashboard_html()

    @routes.get("/")
    async def index(request):
        raise web.HTTPFound("/dashboard")

    @routes.get("/dashboard")
    async def dashboard(request):
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    @routes.get("/metrics")
    async def prometheus(request):
        return web.Response(body=metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.get("/api/events")
    async def events(request):
        try:
            since = max(0, int(request.query.get("since", "0")))
        except ValueError:
            raise web.HTTPBadRequest(
                text="since must be an integer (an index into the run's events)"
            ) from None
        return web.json_response({"run": log.run_id, "events": log.since(since)})

    @routes.get("/events")
    async def stream(request):
        """Every event so far, then the new ones as they come, in JSON batches. A browser's
        EventSource reconnects by itself; each connection starts with a `hello` and the whole
        history, so the page rebuilds its state from scratch (a new run on the same port too)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(f"event: hello\ndata: {json.dumps({'run': log.run_id})}\n\n".encode())
        cursor, quiet = 0, 0.0
        stop = closing["event"]
        while True:
            batch = log.since(cursor)
            if batch:
                cursor += len(batch)
                quiet = 0.0
                await resp.write(f"data: {json.dumps(batch, default=str)}\n\n".encode())
            elif quiet >= KEEPALIVE_S:  # a comment line: proxies keep the stream open
                quiet = 0.0
                await resp.write(b": keepalive\n\n")
            if stop.is_set():  # the run is over: its last events (the final metric) went out above
                break
            try:
                await asyncio.wait_for(stop.wait(), PUSH_EVERY_S)
            except TimeoutError:
                quiet += PUSH_EVERY_S
        return resp

    async def on_startup(app):
        closing["event"] = asyncio.Event()

    async def on_shutdown(app):
        closing["event"].set()

    app = web.Application()
    app.add_routes(routes)
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app


class MonitorServer(BackgroundApp):
    """The monitor on its own event loop in a background thread (inside the ServerApp)."""

    def __init__(self, log: EventLog, metrics: RunMetrics, host: str = "127.0.0.1", port: int = 0):
        super().__init__(lambda: make_monitor_app(log, metrics), "monitor", host, port)

    def urls(self) -> dict:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        base = f"http://{host}:{self.port}"
        return {"dashboard": f"{base}/dashboard", "metrics": f"{base}/metrics", "events": f"{base}/events"}


def serve_run_dir(run_dir: Path, host: str = "127.0.0.1", port: int = 8787) -> None:
    """`fedrl dashboard RUN_DIR`: follow RUN_DIR/events.jsonl and serve the monitor until Ctrl-C."""
    path = Path(run_dir) / "events.jsonl"
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a folder (give a run's output folder, with events.jsonl)")
    log, metrics = EventLog(Path(run_dir).name), RunMetrics()
    log.listeners.append(metrics.observe)
    stop = threading.Event()
    follower = threading.Thread(target=follow, args=(path, log, stop), name="follow-events", daemon=True)
    follower.start()
    line = f"dashboard for {run_dir}: http://{host}:{port}/dashboard  (metrics: /metrics; Ctrl-C to stop)"
    try:  # aiohttp calls `print` once it listens: no URL is shown for a port it could not take
        web.run_app(
            make_monitor_app(log, metrics),
            host=host,
            port=port,
            print=lambda _: print(line, flush=True),
            shutdown_timeout=3.0,
        )
    finally:
        stop.set()
        follower.join(5)
