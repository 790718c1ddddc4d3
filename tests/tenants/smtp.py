"""A real SMTP server for tests (aiosmtpd, on a free loopback port, in a thread): mail the site sends
through Django's SMTP backend arrives here, and tests read it and follow its links."""

from __future__ import annotations

import email
import email.policy
import re
import threading
import time
from dataclasses import dataclass, field
from email.message import EmailMessage

import pytest
from aiosmtpd.controller import Controller

from devtools.supervisor import free_port

LINK = re.compile(r"https?://[^\s<>\"]+")


@dataclass
class Inbox:
    """What the SMTP server received, in order."""

    messages: list[EmailMessage] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def handle_DATA(self, server, session, envelope) -> str:  # aiosmtpd's handler hook
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self._lock:
            self.messages.append(message)
        return "250 Message accepted for delivery"

    def wait_for(self, to: str, *, count: int = 1, timeout: float = 10.0) -> EmailMessage:
        """The `count`-th message to `to` (waiting up to `timeout` seconds: another process may be sending it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [m for m in self.messages if to.lower() in str(m["To"]).lower()]
            if len(found) >= count:
                return found[count - 1]
            time.sleep(0.05)
        raise AssertionError(
            f"no mail #{count} to {to} within {timeout} s; received: {[m['To'] for m in self.messages]}"
        )

    @staticmethod
    def links(message: EmailMessage) -> list[str]:
        return LINK.findall(message.get_body(preferencelist=("plain",)).get_content())


class SmtpServer:
    def __init__(self) -> None:
        self.inbox = Inbox()
        self.host, self.port = "127.0.0.1", free_port()
        self.controller = Controller(self.inbox, hostname=self.host, port=self.port)
        self.controller.start()

    def env(self) -> dict[str, str]:
        """Settings for a site process (the ASGI server) to send here."""
        return {"MINT_EMAIL": "smtp", "EMAIL_HOST": self.host, "EMAIL_PORT": str(self.port)}

    def stop(self) -> None:
        self.controller.stop()


@pytest.fixture
def smtp_server(settings):
    """A real SMTP server, and this process's Django sending to it (Django's SMTP backend)."""
    server = SmtpServer()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = server.host, server.port, 5
    yield server
    server.stop()
