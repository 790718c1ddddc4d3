"""The apps' dependencies run one way: tenants ← adapters ← serving ← (gateway, frontend).

Import graphs are checked by import-linter's contracts in pyproject.toml (also `make lint`). A module
reached by name in a string (`import_module("serving.tasks")`, `send_task("serving.tasks.x")`,
`mock.patch` targets aside) is invisible to an import graph, so app code is also searched for
string literals that name a module of an app it must not depend on.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import private_imports

ROOT = Path(__file__).resolve().parent.parent
# For each app: the apps its code must not name, in imports or in strings.
MUST_NOT_NAME = {
    "tenants": ("adapters", "serving", "webhooks", "frontend", "devtools"),
    "adapters": ("serving", "webhooks", "frontend", "devtools", "mint_vllm_plugin"),
    "serving": ("frontend", "devtools", "webhooks"),
    "webhooks": ("adapters", "serving", "frontend", "devtools"),
}


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"Contracts: [1-9][0-9]* kept, 0 broken", result.stdout), result.stdout[-2000:]


def _string_names(source: str, where: str, apps: tuple[str, ...]) -> list[str]:
    """String literals in `source` that are dotted module paths into one of `apps`."""
    named = re.compile(rf"^({'|'.join(apps)})(\.[a-z_][a-z0-9_]*)+$")
    return [
        f"{where}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(source, filename=where))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and named.match(node.value)
    ]


@pytest.mark.parametrize("app", sorted(MUST_NOT_NAME))
def test_no_app_reaches_a_higher_one_by_name(app):
    found = [
        hit
        for path in sorted((ROOT / app).rglob("*.py"))
        if "migrations" not in path.parts
        for hit in _string_names(path.read_text(), str(path.relative_to(ROOT)), MUST_NOT_NAME[app])
    ]
    assert not found, "modules of a higher layer named in strings:\n" + "\n".join(found)


def test_the_string_check_sees_a_name():
    """The check above would catch what adapters once did to reach serving."""
    source = 'from importlib import import_module\n\nimport_module("serving.tasks").alias_converge.delay()\n'
    assert _string_names(source, "probe.py", MUST_NOT_NAME["adapters"]) == ["probe.py:3: 'serving.tasks'"]
    assert _string_names('x = "serving is up"\n', "probe.py", MUST_NOT_NAME["adapters"]) == []


def test_no_module_imports_another_modules_private_name():
    assert not private_imports.scan(ROOT), "\n".join(private_imports.scan(ROOT))


def test_the_private_import_check_sees_one():
    """What serving's canary once did to dodge an import circle, and what stays allowed."""
    source = (
        "from serving.services.aliases import _withdraw_placements\n"
        "from tenants.management.commands._util import get_or_create_user\n"
        "from serving import _own_module\n"
        "from serving.services import __all__\n"
    )
    found = list(private_imports.offences(source, "probe.py", "serving", lambda dotted: dotted.endswith("_module")))
    assert found == [
        "probe.py:1: serving.services.aliases._withdraw_placements",
        "probe.py:2: tenants.management.commands._util (a private module of another package)",
    ]
