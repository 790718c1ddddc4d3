import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from adapters.models import BaseModel
from mint_site.errors import MintError
from serving.models import ServingNode
from serving.services import nodes
from tenants.access import Actor


class Command(BaseCommand):
    help = "Register, list, drain and undrain serving nodes (a vLLM server plus its node agent)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="Register a node, or update the one with this name.")
        add.add_argument("--name", required=True)
        add.add_argument("--url", required=True, help="vLLM OpenAI server URL, e.g. http://10.0.0.5:8000")
        add.add_argument("--base-model", required=True)
        add.add_argument("--gpu-slots", type=int, required=True, help="vLLM --max-loras")
        add.add_argument("--cpu-slots", type=int, required=True, help="vLLM --max-cpu-loras")
        add.add_argument("--max-lora-rank", type=int, default=16, help="vLLM --max-lora-rank")
        add.add_argument("--served-model-name", default=None, help="Base model name in vLLM (default: --base-model)")
        add.add_argument(
            "--cache-dir", default=None, help="Node-local adapter directory (default: var/node-cache/NAME)"
        )
        add.add_argument(
            "--engine-flag",
            action="append",
            default=[],
            help="A vLLM flag the node runs with, or a MinT capability such as mint:moe-expert-major/1 (repeatable)",
        )
        sub.add_parser("list", help="List nodes.")
        drain = sub.add_parser(
            "drain",
            help="Move a node's revisions to other nodes (each stays served here until ready elsewhere), then "
            "unload them here.",
        )
        drain.add_argument("name")
        drain.add_argument(
            "--force", action="store_true", help="Unload everything now (its aliases answer 503 until ready elsewhere)."
        )
        drain.add_argument("--wait", type=float, default=0, help="Seconds to wait for the node to empty (0: do not).")
        undrain = sub.add_parser("undrain", help="Take a draining node back into service.")
        undrain.add_argument("name")

    def handle(self, *args, action: str, **options):
        if action == "list":
            for node in ServingNode.objects.select_related("base_model"):
                self.stdout.write(
                    f"{node.name}\t{node.state}\t{node.base_model.name}\t{node.url}\t"
                    f"gpu={node.gpu_slots} cpu={node.cpu_slots}\t{node.placements.count()} placements"
                )
            return
        if action in ("drain", "undrain"):
            node = ServingNode.objects.filter(name=options["name"]).first()
            if node is None:
                raise CommandError(f"No node {options['name']!r}.")
            if action == "undrain":
                try:
                    nodes.node_undrain(node=node, by=Actor.system())
                except MintError as exc:
                    raise CommandError(str(exc)) from None
                back = "down; it comes back into service when its engine answers" if node.state == "down" else "up"
                self.stdout.write(f"{node.name} is {back}")
                return
            self._drain(node, force=options["force"], wait=options["wait"])
            return
        base = BaseModel.objects.filter(name=options["base_model"]).first()
        if base is None:
            raise CommandError(f"No base model {options['base_model']!r}; see manage.py mint_base_model list.")
        cache_dir = options["cache_dir"] or str(Path(settings.VAR_DIR) / "node-cache" / options["name"])
        try:
            node = nodes.node_register(
                name=options["name"],
                base_model=base,
                url=options["url"],
                served_model_name=options["served_model_name"] or base.name,
                gpu_slots=options["gpu_slots"],
                cpu_slots=options["cpu_slots"],
                max_lora_rank=options["max_lora_rank"],
                cache_dir=cache_dir,
                engine_flags=options["engine_flag"],
                by=Actor.system(),
            )
        except MintError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(f"{node.name}\t{node.url}\t{node.state}\tqueue {node.queue}")

    def _drain(self, node: ServingNode, *, force: bool, wait: float) -> None:
        """Drain, then report each step until the node is empty or `wait` runs out (the heartbeat goes on)."""
        try:
            progress = nodes.node_drain(node=node, by=Actor.system(), force=force)
        except MintError as exc:
            raise CommandError(str(exc)) from None
        deadline = time.monotonic() + wait
        while True:
            self.stdout.write(f"{node.name} is draining: {progress['left']} placements left")
            for reason in progress["waiting"]:
                self.stdout.write(f"  waiting: {reason}")
            if not progress["left"] or time.monotonic() >= deadline:
                break
            time.sleep(1)
            node.refresh_from_db()
            progress = nodes.drain_step(node=node, force=force)
        if not progress["left"]:
            self.stdout.write(f"{node.name} is empty")
