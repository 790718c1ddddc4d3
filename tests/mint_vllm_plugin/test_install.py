"""A serving node installs the vLLM plugin without Django: MinT's wheel, --no-deps, into a bare virtual environment.

The environment is a plain `python -m venv` (no system site packages), so it holds neither Django
nor numpy nor torch nor vLLM: the plugin's entry point, its detection of the expert-major layout
and the file-layout contract (adapters.artifacts) must load from the standard library alone. The
part that runs inside vLLM (mint_vllm_plugin.loader) needs vLLM and torch, which a node has; it
is tested against vLLM in test_loader.py.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from adapters.artifacts import packing
from adapters.artifacts.export import write_engine_layout
from adapters.artifacts.validate import validate_adapter_dir
from devtools.supervisor import BASE_DIR
from tests.adapters.corpus import TINY_MOE, lora_config, lora_tensors, write_adapter_files

EXPERTS = ("gate_proj", "up_proj", "down_proj")
IN_THE_NODE = """
import importlib.metadata, json, sys
plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
(entry,) = [e for e in plugins if e.name == "mint_moe_expert_major"]
entry.load()()  # no vLLM here: the plugin stays dormant
from mint_vllm_plugin.detect import adapter_description
described = {path: adapter_description(path) for path in sys.argv[1:]}
try:
    import django
except ImportError:
    django = None
print(json.dumps({
    "entry_point": entry.value,
    "described": described,
    "django": django is not None,
    "loaded": sorted(m for m in ("django", "numpy", "torch", "safetensors", "vllm") if m in sys.modules),
}))
"""


@pytest.fixture(scope="module")
def node_python(tmp_path_factory) -> Path:
    """The interpreter of a bare virtual environment with MinT's wheel installed without its dependencies."""
    root = tmp_path_factory.mktemp("node")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(BASE_DIR / name, source / name)
    pyproject = tomllib.loads((BASE_DIR / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        shutil.copytree(BASE_DIR / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "dist", source])
    (wheel,) = (root / "dist").glob("mint-*.whl")
    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"])
    python = root / "venv" / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    return python


def run(argv: list) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd="/", timeout=300)
    assert result.returncode == 0, f"{argv}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_plugin_installs_and_detects_expert_major_files_without_django(node_python, tmp_path):
    spec = TINY_MOE
    tensors = lora_tensors(spec, rank=2, targets=("q_proj",), expert_targets=EXPERTS, dtype=torch.bfloat16)
    source = write_adapter_files(tmp_path / "per-expert", lora_config(rank=2, targets=("q_proj", *EXPERTS)), tensors)
    packed = tmp_path / "expert-major"
    write_engine_layout(validate_adapter_dir(source, spec), packed, spec=spec, moe_layout=packing.EXPERT_MAJOR)

    report = json.loads(run([node_python, "-c", IN_THE_NODE, packed, source, tmp_path / "missing"]))

    assert report["entry_point"] == "mint_vllm_plugin:register"
    assert report["django"] is False and report["loaded"] == []
    described = report["described"]
    assert described[str(packed)]["layout"] == packing.EXPERT_MAJOR
    assert described[str(packed)]["num_experts"] == spec.num_experts
    assert described[str(source)] is None and described[str(tmp_path / "missing")] is None


def test_the_artifacts_package_and_the_plugin_import_no_django_and_nothing_of_the_control_plane():
    allowed = ("adapters.artifacts", "mint_vllm_plugin")
    control_plane = ("django", "rest_framework", "celery", "channels", "mint_site", "tenants", "serving", "frontend")
    found = []
    for path in [*(BASE_DIR / "adapters" / "artifacts").glob("*.py"), *(BASE_DIR / "mint_vllm_plugin").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in control_plane or (top == "adapters" and not name.startswith(allowed)):
                    found.append(f"{path.relative_to(BASE_DIR)}: {name}")
    for init in ("adapters/__init__.py", "adapters/artifacts/__init__.py"):
        tree = ast.parse((BASE_DIR / init).read_text())
        found += [f"{init}: {ast.dump(n)}" for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert found == []
