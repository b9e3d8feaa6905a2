"""A tiny HTTP server on 127.0.0.1 for tests of clients that poll a server (``bcg plan --from URL``,
``deployments/cli/local.py`` ``wait_captured``): every GET is answered with a JSON body, the same one or the next of
a sequence."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    """Answers every GET with ``body`` (bytes, or a callable giving the next answer's bytes) and ``status``; records
    the paths asked for in :attr:`paths`. A context manager: serving inside the ``with`` block, at :attr:`url`."""

    def __init__(self, body: bytes | Callable[[], bytes], status: int = 200):
        paths = self.paths = []
        answer = body if callable(body) else (lambda: body)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                paths.append(self.path)
                data = answer()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
