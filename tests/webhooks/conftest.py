from __future__ import annotations

import pytest

from tests.webhooks.receiver import Receiver


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def allow_loopback(settings):
    """The local receiver is on loopback: allowed here, as an operator of a closed network would."""
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = True
    settings.MINT_WEBHOOK_BACKOFF_S = 0
    settings.MINT_WEBHOOK_TIMEOUT_S = 5.0
    return settings
