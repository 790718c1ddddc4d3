"""`python -m devtools.tiny_models`: generate the tiny local models and register them as base models.

Random weights and a locally trained tokenizer (devtools.tiny; no downloads), registered as
`tiny-llama` and `tiny-qwen3-moe` through the adapters app's own service. `make run` runs it
before it starts anything; a model directory that already holds weights is kept unless --force.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devtools.django_setup import setup_django
from devtools.tiny import DEFAULT_NAMES, KINDS, has_weights, make_tiny_model, parameter_count


def make_and_register(
    *,
    kinds: tuple[str, ...] = KINDS,
    dest: Path | None = None,
    force: bool = False,
    max_lora_rank: int = 16,
    seed: int = 0,
) -> list[str]:
    """Generate (when missing or forced) and register each kind; one `name<TAB>path<TAB>n parameters` line each.

    ValueError when a directory cannot hold a model or the model cannot be registered.
    """
    # Here, not at the top: `python -m devtools.tiny_models` imports this module before Django is set up.
    from django.conf import settings

    from adapters.base_models import base_model_upsert
    from tenants.access import Actor

    dest = Path(dest) if dest is not None else Path(settings.VAR_DIR) / "models"
    lines = []
    for kind in kinds:
        name = DEFAULT_NAMES[kind]
        model_dir = dest / name
        if force or not has_weights(model_dir):
            make_tiny_model(kind, model_dir, seed=seed)
        base_model = base_model_upsert(name=name, path=model_dir, max_lora_rank=max_lora_rank, by=Actor.system())
        lines.append(f"{name}\t{base_model.path}\t{parameter_count(model_dir):,} parameters")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.tiny_models", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=[*KINDS, "all"], default="all")
    parser.add_argument("--dest", type=Path, default=None, help="Parent directory (default: VAR_DIR/models).")
    parser.add_argument("--force", action="store_true", help="Regenerate even when the model directory exists.")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setup_django()
    kinds = KINDS if args.kind == "all" else (args.kind,)
    try:
        lines = make_and_register(
            kinds=kinds, dest=args.dest, force=args.force, max_lora_rank=args.max_lora_rank, seed=args.seed
        )
    except ValueError as exc:
        parser.exit(1, f"error: {exc}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
