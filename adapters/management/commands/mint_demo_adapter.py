from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from adapters.models import BaseModel
from adapters.tiny import make_tiny_lora


class Command(BaseCommand):
    help = "Write a random-weight LoRA adapter (PEFT layout) for a base model, to try registration without a trainer."

    def add_arguments(self, parser):
        parser.add_argument("--base-model", default="tiny-llama")
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--rank", type=int, default=8)
        parser.add_argument("--seed", type=int, default=0, help="Different seeds give different adapters.")

    def handle(self, *args, base_model: str, out: Path, rank: int, seed: int, **options):
        base = BaseModel.objects.filter(name=base_model).first()
        if base is None:
            raise CommandError(f"No base model {base_model!r}; run manage.py mint_make_tiny_model first.")
        make_tiny_lora(base.spec, out, rank=rank, seed=seed)
        for path in sorted(out.iterdir()):
            self.stdout.write(str(path))
