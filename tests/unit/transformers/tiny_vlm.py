"""A tiny random image-text-to-text model (Llava: a 2-layer CLIP vision tower and a 2-layer
Llama), saved as a Hugging Face repo with its processor, built in-process (no downloads).

Its chat template renders each image part as `<image>`, which the processor expands to the
tower's 16 patch tokens (32x32 pixels, 8x8 patches): a prompt with an image is 16 tokens longer
than the same prompt without it, and two different images give different logits.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from tests.unit.transformers.conftest import build_tokenizer

IMAGE_TOKENS = 16
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_vlm(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=32, patch_size=8,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    images = CLIPImageProcessorPil(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default",
                               chat_template=CHAT_TEMPLATE, image_token="<image>",
                               num_additional_image_tokens=1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def png_base64(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    """A plain-coloured PNG, base64-encoded (Ollama's `images` item; a data URL's payload)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def data_url(color: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + png_base64(color)
