"""Services send serving tasks by name (`serving.services.outbox.send`); each name they send is a task there."""

from __future__ import annotations

import ast
from pathlib import Path

from celery import Task

from serving import tasks

SERVICES = Path(__file__).resolve().parents[2] / "serving" / "services"


def _names_sent() -> dict[str, str]:
    """Each task name passed to `outbox.send(...)` in the services, with where."""
    sent = {}
    for path in sorted(SERVICES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "send"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "outbox"
            ):
                (name, *_) = node.args
                assert isinstance(name, ast.Constant), f"{path.name}:{node.lineno}: a task named by a literal"
                sent[name.value] = f"{path.name}:{node.lineno}"
    return sent


def test_every_task_the_services_send_is_a_serving_task():
    sent = _names_sent()
    assert {"alias_converge", "placement_prewarm", "placement_unload", "evaluation_cases"} <= set(sent)
    missing = [f"{where}: {name}" for name, where in sent.items() if not isinstance(getattr(tasks, name, None), Task)]
    assert not missing, "sent but not a task of serving.tasks:\n" + "\n".join(missing)
    assert all(getattr(tasks, name).name == f"serving.tasks.{name}" for name in sent)
