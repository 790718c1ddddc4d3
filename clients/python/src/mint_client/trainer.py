"""Training-loop integration (the `trainer` extra): register every saved checkpoint as a MinT revision.

    from mint_client import Client
    from mint_client.trainer import MintCallback
    trainer = Trainer(model=peft_model, args=args, ..., callbacks=[MintCallback(Client(), "support-bot")])

Each `on_save` registers `<output_dir>/checkpoint-<global_step>/` (its adapter_config.json and
.safetensors only; the optimizer and RNG state stay local) with `training_step=global_step` and
`parent=` the revision registered before, and by default waits for validation: a checkpoint MinT refuses
raises `RevisionFailed` with the server's reason, so a run producing a broken adapter stops loudly.
For other loops, `register_checkpoint(client, adapter, path, step)` does the same for one directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from mint_client.client import Client
from mint_client.models import Revision

log = logging.getLogger(__name__)


def register_checkpoint(
    client: Client,
    adapter: str,
    path: str | os.PathLike,
    step: int | None,
    parent: int | str | None = None,
    wait: bool = True,
    *,
    state: str = "exported",
    timeout: float = 1800.0,
) -> Revision:
    """Register one checkpoint directory (or archive) as a revision of `adapter`; with `wait`, wait until it
    is `state` (exported by default) and raise `RevisionFailed` if validation refuses it."""
    revision = client.register(adapter, path, training_step=step, parent=parent)
    log.info("MinT: registered %s %s (step %s)", adapter, revision.label, step)
    if wait:
        revision = client.wait_for(adapter, revision.number, state, timeout=timeout)
        log.info("MinT: %s %s is %s", adapter, revision.label, revision.state)
    return revision


class MintCallback(TrainerCallback):
    """Registers each checkpoint the Trainer saves; `revisions` lists what it registered, in order.

    Only the main process registers (`state.is_world_process_zero`). `parent` starts the chain at a revision
    registered before this run (e.g. the one it resumes from).
    """

    def __init__(
        self,
        client: Client,
        adapter: str,
        wait: bool = True,
        *,
        parent: int | str | None = None,
        state: str = "exported",
        timeout: float = 1800.0,
    ) -> None:
        self.client = client
        self.adapter = adapter
        self.wait = wait
        self.parent = parent
        self.state = state
        self.timeout = timeout
        self.revisions: list[Revision] = []

    def checkpoint_dir(self, args: TrainingArguments, state: TrainerState) -> Path:
        return Path(args.output_dir) / f"checkpoint-{state.global_step}"

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs) -> None:
        if not state.is_world_process_zero:
            return
        path = self.checkpoint_dir(args, state)
        parent = self.revisions[-1].number if self.revisions else self.parent
        revision = register_checkpoint(
            self.client,
            self.adapter,
            path,
            state.global_step,
            parent=parent,
            wait=self.wait,
            state=self.state,
            timeout=self.timeout,
        )
        self.revisions.append(revision)
