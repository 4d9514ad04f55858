"""Save the demo model once as a safetensors repo (the transformers backend's native format).

The demo GGUF (SmolLM2-135M-Instruct, Q4_1) is dequantized by transformers' GGUF loader and saved
with its tokenizer under the cache directory; later runs find it there and do nothing. Tests and
benchmarks of the transformers backend load this directory, so nothing comes from a hub.

    python scripts/provide_demo_safetensors.py GGUF_PATH OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> None:
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; a plain model with its weights does not.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # all or nothing: a cut run leaves no half repo behind


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
