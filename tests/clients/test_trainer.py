"""mint_client.trainer: a real tiny peft model saved twice as a Trainer would, registered by MintCallback's
on_save as r1 and r2 (steps, r2's parent r1), and a checkpoint validation refuses stopping the run loudly."""

from __future__ import annotations

import pytest
import torch
from mint_client import RevisionFailed
from mint_client.trainer import MintCallback, register_checkpoint
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState, TrainingArguments

from tests.clients.conftest import ADAPTER


def tiny_peft_model(seed: int):
    """A LoRA on a 2-layer Llama with the dense test model's shapes (hidden 64, kv 32, intermediate 128)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora)


def save_checkpoint(model, output_dir, step: int):
    """What a Trainer leaves in checkpoint-<step>/ for a peft model: the adapter, and its own state files."""
    checkpoint = output_dir / f"checkpoint-{step}"
    model.save_pretrained(checkpoint)
    torch.save({"step": step}, checkpoint / "optimizer.pt")  # a pickle: MinT would refuse it; never sent
    (checkpoint / "trainer_state.json").write_text("{}")
    return checkpoint


def test_the_callback_registers_each_saved_checkpoint_chained_to_the_one_before(live_mint, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[])
    callback = MintCallback(live_mint.client(), ADAPTER, wait=True)
    model = tiny_peft_model(seed=1)
    for step in (10, 20):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.01 * step)  # training moved the weights: a new revision, not a duplicate
        save_checkpoint(model, tmp_path / "run", step)
        callback.on_save(args, TrainerState(global_step=step), TrainerControl())

    r1, r2 = callback.revisions
    assert (r1.label, r1.training_step, r1.parent, r1.state) == ("r1", 10, None, "exported")
    assert (r2.label, r2.training_step, r2.parent, r2.state) == ("r2", 20, "r1", "exported")
    server = live_mint.client().revision(ADAPTER, 2)
    assert server.parent == "r1" and server.training_step == 20 and server.rank == 4


def test_a_checkpoint_validation_refuses_raises_from_on_save(live_mint, tmp_path):
    checkpoint = save_checkpoint(tiny_peft_model(seed=2), tmp_path / "run", 5)
    weights = checkpoint / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated mid-tensor
    callback = MintCallback(live_mint.client(), ADAPTER)
    with pytest.raises(RevisionFailed) as failed:
        callback.on_save(
            TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[]),
            TrainerState(global_step=5),
            TrainerControl(),
        )
    assert failed.value.failure_code and failed.value.failure_reason
    assert callback.revisions == []


def test_register_checkpoint_for_other_loops(live_mint, tmp_path):
    checkpoint = save_checkpoint(tiny_peft_model(seed=3), tmp_path, 7)
    revision = register_checkpoint(live_mint.client(), ADAPTER, checkpoint, 7, wait=False)
    assert revision.label == "r1" and revision.training_step == 7
