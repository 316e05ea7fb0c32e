"""The patch store's own Prometheus metrics: requests by route and status, bytes in and out,
latency, and what it holds. One registry per app, so stores in one process do not mix."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)


class StoreMetrics:
    def __init__(self, objects, held_bytes):
        """`objects()` and `held_bytes()` say what the store holds at scrape time."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fedrl_store_requests",
            "Requests by method, route and status",
            ["method", "route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "fedrl_store_request_seconds",
            "Request handling time",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transferred = Counter(
            "fedrl_store_transferred_bytes", "Body bytes by direction", ["direction"], registry=r
        )
        Gauge("fedrl_store_objects", "Objects held", registry=r).set_function(objects)
        Gauge("fedrl_store_bytes", "Bytes held", registry=r).set_function(held_bytes)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        start, status, response = time.perf_counter(), 500, None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as err:
            status = err.status
            raise
        finally:
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            self.requests.labels(request.method, route, str(status)).inc()
            self.latency.labels(request.method, route).observe(time.perf_counter() - start)
            self.transferred.labels("in").inc(request.content.total_bytes)  # chunked bodies too
            body = getattr(response, "body", None)
            if isinstance(body, bytes | bytearray):
                self.transferred.labels("out").inc(len(body))

    def text(self) -> bytes:
        return generate_latest(self.registry)
