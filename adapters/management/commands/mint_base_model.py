from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from adapters.artifacts import packing
from adapters.base_models import base_model_upsert
from adapters.models import BaseModel
from tenants.access import Actor


class Command(BaseCommand):
    help = "Register (or update) and list base models from local Hugging Face model directories."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="Register a model directory (its config.json) as a base model.")
        add.add_argument("--name", required=True)
        add.add_argument("--path", required=True, type=Path)
        add.add_argument("--max-lora-rank", type=int, default=64)
        add.add_argument(
            "--moe-lora-layout",
            choices=packing.LAYOUTS,
            default=None,
            help="How MoE adapters of this model are exported: peft_3d_moe (plain vLLM 0.32 nodes with "
            "--enable-mixed-moe-lora-format) or mint_expert_major (nodes running MinT's vLLM plugin, "
            "registered with --engine-flag mint:moe-expert-major/1). Default: keep the current choice.",
        )
        sub.add_parser("list", help="List base models.")

    def handle(self, *args, action: str, **options):
        if action == "add":
            self._add(
                name=options["name"],
                path=options["path"],
                max_lora_rank=options["max_lora_rank"],
                moe_lora_layout=options["moe_lora_layout"],
            )
        else:
            self._list()

    def _add(self, *, name: str, path: Path, max_lora_rank: int, moe_lora_layout: str | None):
        try:
            base_model = base_model_upsert(
                name=name, path=path, max_lora_rank=max_lora_rank, moe_lora_layout=moe_lora_layout, by=Actor.system()
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        spec = base_model.spec
        self.stdout.write(
            f"{base_model.name}\t{base_model.architecture}\t{spec.num_layers} layers\t"
            f"{spec.num_experts} experts\tmax rank {base_model.max_lora_rank}\t{base_model.path}"
        )

    def _list(self):
        self.stdout.write("name\tarchitecture\tlayers\texperts\tmax_rank\tpath")
        for base_model in BaseModel.objects.order_by("name"):
            config = base_model.config or {}
            self.stdout.write(
                f"{base_model.name}\t{base_model.architecture}\t{config.get('num_layers', '?')}\t"
                f"{config.get('num_experts', 0)}\t{base_model.max_lora_rank}\t{base_model.path or '-'}"
            )
