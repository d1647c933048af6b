"""The HTTP plumbing of rank 0: a request-body size cap, and uvicorn in a thread.

uvicorn runs its own event loop in a daemon thread, so the engine loop keeps rank 0's
main thread; the two meet only in the Scheduler (a lock) and in each request's
asyncio queue (loop.call_soon_threadsafe).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

__all__ = ["BodyLimit", "bind", "start_http"]


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before any route runs.

    The body is read here (up to the limit) and replayed to the app; later receive()
    calls go to the server, so a client's disconnect is still seen downstream.
    """

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._too_large(send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        message = f"request body is over the server's limit of {self.limit} bytes"
        payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": 413}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); OSError when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def start_http(app, sock: socket.socket, *, startup_s: float = 60.0):
    """Serve `app` on `sock` from a daemon thread; returns (thread, uvicorn server) once it accepts."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    return thread, server
