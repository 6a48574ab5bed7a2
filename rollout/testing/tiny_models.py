"""Tiny random-weight chat models built at test time, so a real vLLM server can run offline.

A byte-level BPE tokenizer is trained with ``tokenizers`` on a few lines and saved with a
chat template; the model is a 2-layer Qwen2 (head_dim 64) saved with ``save_pretrained``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Thought: I should click the start button to open the menu.",
    "Action: click(start_box='(120,340)')",
    "Action: type(content='hello world')",
    "Action: hotkey(key='ctrl s')",
    "Action: scroll(start_box='(500,500)', direction='down')",
    "Action: finished(content='done')",
    "You are a GUI agent. You are given a task and your action history, with screenshots.",
    "Open the text editor, write a note and save it in the home folder.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
VOCAB_SIZE = 512          # byte alphabet (256) + merges + special tokens
MAX_POSITIONS = 2048      # the model's context; vLLM's --max-model-len may be lower


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer on ``CORPUS`` and save it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    # transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build_tiny_model(out_dir: Path, *, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """Write a tiny random Qwen2 chat model to ``out_dir`` and return it.

    ``tokenizer_from`` copies that model's tokenizer files (checkpoints of one run share
    their tokenizer, which is what an in-place weight reload assumes); else one is trained.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is None:
        build_tokenizer(out_dir)
    else:
        for f in Path(tokenizer_from).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (out_dir / f.name).write_bytes(f.read_bytes())
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    eos_id = vocab["<|im_end|>"]
    pad_id = vocab["<|endoftext|>"]
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,        # head_dim 64: the smallest vLLM's CPU attention takes
        num_key_value_heads=1,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = pad_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str]) -> int:
    """``python tests/tiny_model.py DIR [DIR ...]``: one model per directory (seeds 0, 1, ...),
    all with the first one's tokenizer."""
    if not argv:
        print("usage: python tests/tiny_model.py DIR [DIR ...]", file=sys.stderr)
        return 2
    first = build_tiny_model(Path(argv[0]), seed=0)
    for seed, out in enumerate(argv[1:], start=1):
        build_tiny_model(Path(out), seed=seed, tokenizer_from=first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
