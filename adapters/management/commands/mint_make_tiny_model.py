from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from adapters.base_models import base_model_upsert
from adapters.tiny import DEFAULT_NAMES, KINDS, has_weights, make_tiny_model, parameter_count
from tenants.access import Actor


class Command(BaseCommand):
    help = (
        "Generate the tiny local models (random weights, locally trained tokenizer; no downloads) "
        "and register them as base models tiny-llama and tiny-qwen3-moe."
    )

    def add_arguments(self, parser):
        parser.add_argument("--kind", choices=[*KINDS, "all"], default="all")
        parser.add_argument("--dest", type=Path, default=None, help="Parent directory (default: VAR_DIR/models).")
        parser.add_argument("--force", action="store_true", help="Regenerate even when the model directory exists.")
        parser.add_argument("--max-lora-rank", type=int, default=16)
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, *args, kind: str, dest: Path | None, force: bool, max_lora_rank: int, seed: int, **options):
        dest = Path(dest) if dest is not None else Path(settings.VAR_DIR) / "models"
        for each in KINDS if kind == "all" else (kind,):
            name = DEFAULT_NAMES[each]
            model_dir = dest / name
            try:
                if force or not has_weights(model_dir):
                    make_tiny_model(each, model_dir, seed=seed)
                base_model = base_model_upsert(
                    name=name, path=model_dir, max_lora_rank=max_lora_rank, by=Actor.system()
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"{name}\t{base_model.path}\t{parameter_count(model_dir):,} parameters")
