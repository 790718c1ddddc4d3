"""Serving tasks recorded instead of sent. Services send every task by name through `serving.services.outbox.send`,
so one patch sees them all; the tasks not named are sent as usual (the suite runs them at once)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

from serving.services import outbox

NODE_TASKS = ("placement_prewarm", "placement_unload", "node_admit")  # what admission and eviction hand to agents


@contextmanager
def recorded(*names: str) -> Iterator[mock.Mock]:
    """Record the tasks named: each call is `(name, **its keyword arguments and options)`."""
    calls = mock.Mock()
    send = outbox.send

    def instead(task: str, **kwargs) -> None:
        (calls if task in names else send)(task, **kwargs)

    with mock.patch("serving.services.outbox.send", side_effect=instead):
        yield calls


def sent_of(calls: mock.Mock, name: str) -> list[dict]:
    """The keyword arguments (and options) of each recorded call of the task `name`, in order."""
    return [call.kwargs for call in calls.call_args_list if call.args == (name,)]
