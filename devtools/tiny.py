"""Tiny Hugging Face models made on the spot: random weights and a locally trained tokenizer, no downloads.

They let `make run`, the test suite and the local vLLM CPU node serve real LoRA adapters without a
model hub. The text they generate is noise; their shapes, files and tokenizer are real.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from pathlib import Path

KINDS = ("dense", "moe")
DEFAULT_NAMES = {"dense": "tiny-llama", "moe": "tiny-qwen3-moe"}

VOCAB_SIZE = 2000
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0..3, in this order

# `role: content` lines, then `assistant:` for the reply: enough for vLLM's chat completions.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# The corpus the tokenizer learns from is made of these words (in this order: the seed picks by index).
_WORDS = (Path(__file__).parent / "tiny_words.txt").read_text().split()
_PUNCTUATION = [".", ",", "!", "?", ";", ":"]


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic English-like sentences: the words of tiny_words.txt, numbers and punctuation."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        parts = []
        for _ in range(rng.randint(4, 14)):
            roll = rng.random()
            if roll < 0.08:
                parts.append(str(rng.randint(0, 9999)))
            else:
                parts.append(rng.choice(_WORDS))
        sentence = " ".join(parts)
        sentence = sentence[0].upper() + sentence[1:]
        if rng.random() < 0.3:
            cut = rng.randrange(1, len(parts))
            sentence = " ".join(parts[:cut]) + ", " + " ".join(parts[cut:])
            sentence = sentence[0].upper() + sentence[1:]
        out.append(sentence + rng.choice(_PUNCTUATION))
    return out


def _train_tokenizer(seed: int):
    """A byte-level BPE (every byte is in the alphabet, so no text is unknown) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Llama-style: a completion prompt starts with <s>; the chat template writes it itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _model_config(kind: str, tokenizer):
    from transformers import LlamaConfig, Qwen3MoeConfig

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if kind == "dense":
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
    else:
        config = Qwen3MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def make_tiny_model(kind: str, dest: Path, *, seed: int = 0) -> Path:
    """Write a complete model directory of `kind` ("dense": Llama, "moe": Qwen3-MoE) at `dest`; return `dest`.

    Config, bfloat16 safetensors weights (random, from `seed`), generation config and a byte-level
    BPE tokenizer with a chat template. The same seed gives the same files. The directory is built
    next to `dest` and renamed into place, so a crash never leaves a half-written model; an existing
    `dest` is replaced only when it is empty or already holds a model (a config.json).
    """
    if kind not in KINDS:
        raise ValueError(f"Unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}.")
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / "config.json").is_file())):
        raise ValueError(f"{dest} exists and is not a model directory; refusing to replace it.")

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    tokenizer = _train_tokenizer(seed)
    config = _model_config(kind, tokenizer)
    torch.manual_seed(seed)
    # Initialise in float32 (the CPU kernels are deterministic there), then store bfloat16.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_length=2048,
    )

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(staging, safe_serialization=True)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(staging)
        _write_compatible_tokenizer_files(staging)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _write_compatible_tokenizer_files(model_dir: Path) -> None:
    """Make the tokenizer readable by transformers 4 as well as 5 (a serving node may pin either).

    transformers 5 names the class `TokenizersBackend`, keeps the chat template in
    chat_template.jinja and no longer writes special_tokens_map.json; 4.x expects
    `PreTrainedTokenizerFast`, may read the template only from tokenizer_config.json,
    and looks for the map. 5 reads all of these too.
    """
    config_file = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    special_map = model_dir / "special_tokens_map.json"
    if not special_map.exists():
        special_map.write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2) + "\n"
        )


def has_weights(model_dir: Path) -> bool:
    """Whether `model_dir` holds a config.json and safetensors weights."""
    model_dir = Path(model_dir)
    return (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))


def parameter_count(model_dir: Path) -> int:
    """The number of parameters in a directory's safetensors files, read from their headers only."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                count = 1
                for dim in f.get_slice(key).get_shape():
                    count *= dim
                total += count
    return total


def make_tiny_lora(
    spec,
    dest: Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> Path:
    """A PEFT-layout LoRA adapter with random weights for a base model of `spec` (a BaseModelSpec).

    For trying the platform without a trainer: `python -m devtools.demo_adapter` writes one.
    """
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in targets:
            in_features, out_features = spec.module_shapes[module]
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / rank
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(dest / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dest
