"""No module imports another module's private name: `make lint` runs this (and tests/test_architecture.py).

A leading underscore says "not part of this module's interface". Importing such a name from another module ties
the importer to internals that may change without notice; give the name one public home instead. Private modules
(`_http.py`) may be imported inside their own package, which is what the underscore there means.

    python -m devtools.private_imports [ROOT]    # prints each offence as path:line, exits 1 if any
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = (
    "adapters",
    "benchmarks",
    "clients/python/src/mint_client",
    "devtools",
    "frontend",
    "mint_site",
    "mint_vllm_plugin",
    "serving",
    "tenants",
    "webhooks",
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def offences(source: str, where: str, package: str, is_module=lambda dotted: False) -> Iterator[str]:
    """Imports in `source` (of the top-level `package`) of a private name of another module, or of a private
    module of another package. `is_module("a.b._c")`: whether that dotted name is a module, not a name in one."""
    for node in ast.walk(ast.parse(source, filename=where)):
        if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
            continue
        own = node.module.split(".")[0] == package
        if not own and any(_private(part) for part in node.module.split(".")[1:]):
            yield f"{where}:{node.lineno}: {node.module} (a private module of another package)"
            continue
        for alias in node.names:
            dotted = f"{node.module}.{alias.name}"
            if _private(alias.name) and not (own and is_module(dotted)):
                yield f"{where}:{node.lineno}: {dotted}"


def scan(root: Path) -> list[str]:
    def is_module(dotted: str) -> bool:
        for base in (root, root / "clients/python/src"):
            path = base.joinpath(*dotted.split("."))
            if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                return True
        return False

    found = []
    for package in PACKAGES:
        base = root / package
        for path in sorted(base.rglob("*.py")):
            if "migrations" not in path.parts:
                found += offences(path.read_text(), str(path.relative_to(root)), base.name, is_module)
    return found


def main(argv: list[str]) -> int:
    found = scan(Path(argv[0]) if argv else Path.cwd())
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
