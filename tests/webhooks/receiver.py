"""A real HTTP receiver on a free local port, for webhook deliveries: it records what arrives and answers
with what the test queued (a status, a redirect, a huge body, a trickle)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Answer:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    huge_bytes: int = 0  # send this many bytes of body after the headers (a receiver that floods)
    trickle_s: float = 0  # send the status line one byte per this many seconds, for ever (a receiver that stalls)


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up (the sender closes after its answer, or at its deadline)


class Receiver:
    """Answers requests in the order queued by `answer(...)`; once the queue is empty, `default`."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.answers: list[Answer] = []
        self.default = Answer()
        self.flood_written = 0
        self.lock = threading.Lock()
        self.closed = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with receiver.lock:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    answer = receiver.answers.pop(0) if receiver.answers else receiver.default
                receiver.respond(self, answer)

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def respond(self, handler: BaseHTTPRequestHandler, answer: Answer) -> None:
        try:
            if answer.trickle_s:
                for byte in b"HTTP/1.1 200 OK\r\n" * 1000:
                    if self.closed.is_set():
                        return
                    handler.wfile.write(bytes([byte]))
                    handler.wfile.flush()
                    time.sleep(answer.trickle_s)
                return
            handler.send_response(answer.status)
            for name, value in answer.headers.items():
                handler.send_header(name, value)
            size = answer.huge_bytes or len(answer.body)
            handler.send_header("Content-Length", str(size))
            handler.end_headers()
            if answer.huge_bytes:
                chunk = b"x" * 65536
                while self.flood_written < answer.huge_bytes:
                    handler.wfile.write(chunk)
                    self.flood_written += len(chunk)
            else:
                handler.wfile.write(answer.body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def answer(self, *answers: Answer) -> None:
        with self.lock:
            self.answers.extend(answers)

    def url(self, path: str = "/hook", host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
