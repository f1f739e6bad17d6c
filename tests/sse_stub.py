"""A stub of an OpenAI-style completions server that streams known events, for the tests of
the benchmarks' streaming client (benchmarks/stream_probe.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    """An OpenAI-style ``/v1/completions`` stream on 127.0.0.1: per request ``texts`` as events
    (an empty text is an event without text, as a held-back token's), then the usage with
    ``tokens`` completion tokens and ``[DONE]``; a prompt ``"refuse"`` gets an HTTP 400. Each
    request's body lands in ``bodies``."""

    def __init__(self, texts=("a", "", "b", "c"), tokens=4):
        stub = self
        self.bodies: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.bodies.append(body)
                if body["prompt"] == "refuse":
                    self.send_response(400)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"no")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for text in texts:
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"completion_tokens": tokens}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
