"""`python -m devtools.demo_adapter --out DIR`: a random-weight LoRA adapter (PEFT layout) for a base model.

To try registration without a trainer (README, "The whole loop in five minutes").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devtools.django_setup import setup_django
from devtools.tiny import make_tiny_lora


def write_demo_adapter(*, base_model: str, out: Path, rank: int = 8, seed: int = 0) -> list[Path]:
    """Write the adapter for the registered base model `base_model`; the files written. LookupError if unknown."""
    from adapters.models import BaseModel  # after setup_django(), as in devtools.tiny_models

    base = BaseModel.objects.filter(name=base_model).first()
    if base is None:
        raise LookupError(f"No base model {base_model!r}; run python -m devtools.tiny_models first.")
    make_tiny_lora(base.spec, out, rank=rank, seed=seed)
    return sorted(out.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.demo_adapter", description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="tiny-llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="Different seeds give different adapters.")
    args = parser.parse_args(argv)
    setup_django()
    try:
        files = write_demo_adapter(base_model=args.base_model, out=args.out, rank=args.rank, seed=args.seed)
    except LookupError as exc:
        parser.exit(1, f"error: {exc.args[0]}\n")
    print("\n".join(map(str, files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
