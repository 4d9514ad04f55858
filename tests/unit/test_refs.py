"""store.refs: parsing model references and choosing what to download, on realistic listings."""

from __future__ import annotations

import pytest

from modelyard.store.refs import (
    DEFAULT_QUANT_PREFERENCE,
    GgufChoice,
    ModelRef,
    PullPlan,
    UnknownQuant,
    available_quants,
    choose_gguf,
    choose_safetensors,
    normalize_quant,
    parse_ref,
    plan_pull,
    pulled_model_id,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SHA = "0cb88a4f764b7a12671c53f0838cd831a0843b95"
VALID_FORMS = "a model reference looks like org/repo"

# --------------------------------------------------------------------------------------------
# Realistic repo listings (as HfApi.list_repo_files returns them)

BARTOWSKI = [
    ".gitattributes",
    "README.md",
    "Llama-3.2-3B-Instruct.imatrix",
    "Llama-3.2-3B-Instruct-IQ3_M.gguf",
    "Llama-3.2-3B-Instruct-IQ4_XS.gguf",
    "Llama-3.2-3B-Instruct-Q3_K_L.gguf",
    "Llama-3.2-3B-Instruct-Q3_K_XL.gguf",
    "Llama-3.2-3B-Instruct-Q4_0.gguf",
    "Llama-3.2-3B-Instruct-Q4_0_4_4.gguf",
    "Llama-3.2-3B-Instruct-Q4_0_4_8.gguf",
    "Llama-3.2-3B-Instruct-Q4_K_L.gguf",
    "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
    "Llama-3.2-3B-Instruct-Q4_K_S.gguf",
    "Llama-3.2-3B-Instruct-Q5_K_M.gguf",
    "Llama-3.2-3B-Instruct-Q6_K.gguf",
    "Llama-3.2-3B-Instruct-Q6_K_L.gguf",
    "Llama-3.2-3B-Instruct-Q8_0.gguf",
    "Llama-3.2-3B-Instruct-f16.gguf",
]

THEBLOKE = [
    ".gitattributes",
    "LICENSE.txt",
    "README.md",
    "USE_POLICY.md",
    "config.json",
    "llama-2-7b-chat.Q2_K.gguf",
    "llama-2-7b-chat.Q3_K_S.gguf",
    "llama-2-7b-chat.Q3_K_M.gguf",
    "llama-2-7b-chat.Q4_0.gguf",
    "llama-2-7b-chat.Q4_K_M.gguf",
    "llama-2-7b-chat.Q5_K_M.gguf",
    "llama-2-7b-chat.Q8_0.gguf",
]

# Qwen's own GGUF repos split every quant, in lower case.
QWEN_SPLIT = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "qwen2.5-7b-instruct-fp16-00004-of-00004.gguf",
    "qwen2.5-7b-instruct-fp16-00001-of-00004.gguf",
    "qwen2.5-7b-instruct-fp16-00003-of-00004.gguf",
    "qwen2.5-7b-instruct-fp16-00002-of-00004.gguf",
    "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf",
    "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf",
    "qwen2.5-7b-instruct-q8_0-00001-of-00003.gguf",
    "qwen2.5-7b-instruct-q8_0-00002-of-00003.gguf",
    "qwen2.5-7b-instruct-q8_0-00003-of-00003.gguf",
]

SPLIT_CAMEL = [
    "Qwen2.5-7B-Instruct-Q4_K_M-00001-of-00002.gguf",
    "Qwen2.5-7B-Instruct-Q4_K_M-00002-of-00002.gguf",
    "Qwen2.5-7B-Instruct-Q6_K.gguf",
]

# unsloth: big quants in per-quant folders, projectors at the root.
UNSLOTH_VISION = [
    ".gitattributes",
    "README.md",
    "gemma-3-27b-it-Q2_K.gguf",
    "gemma-3-27b-it-Q4_K_M.gguf",
    "gemma-3-27b-it-UD-Q4_K_XL.gguf",
    "gemma-3-27b-it-Q8_0.gguf",
    "BF16/gemma-3-27b-it-BF16-00001-of-00002.gguf",
    "BF16/gemma-3-27b-it-BF16-00002-of-00002.gguf",
    "mmproj-F32.gguf",
    "mmproj-F16.gguf",
    "mmproj-BF16.gguf",
]

UNSLOTH_FOLDERS = [
    "README.md",
    "Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00003.gguf",
    "Q4_K_M/DeepSeek-R1-Q4_K_M-00002-of-00003.gguf",
    "Q4_K_M/DeepSeek-R1-Q4_K_M-00003-of-00003.gguf",
    "UD-Q2_K_XL/DeepSeek-R1-UD-Q2_K_XL-00001-of-00002.gguf",
    "UD-Q2_K_XL/DeepSeek-R1-UD-Q2_K_XL-00002-of-00002.gguf",
]

GGML_ORG_VISION = [
    ".gitattributes",
    "README.md",
    "gemma-3-4b-it-Q4_K_M.gguf",
    "gemma-3-4b-it-Q8_0.gguf",
    "gemma-3-4b-it-f16.gguf",
    "mmproj-model-f16.gguf",
]

# Per-folder projectors: the one next to the model wins over a better-precision one elsewhere.
FOLDER_PROJECTORS = [
    "Q4_K_M/model-Q4_K_M.gguf",
    "Q4_K_M/mmproj-model-f16.gguf",
    "Q8_0/model-Q8_0.gguf",
    "mmproj-BF16.gguf",
]

LLAMA_SAFETENSORS = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "USE_POLICY.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
    "model.safetensors.index.json",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
    "onnx/model.onnx",
    "onnx/model.onnx_data",
    "onnx/config.json",
    "training_args.pt",
    "assets/logo.png",
    "figures/benchmark.jpg",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]

LLAMA_SAFETENSORS_WANTED = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
]

# Mistral ships a mistral-inference copy (consolidated.safetensors) beside the HF shards.
MISTRAL = [
    "README.md",
    "config.json",
    "consolidated.safetensors",
    "generation_config.json",
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
    "params.json",
    "tekken.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
]

# A small single-file VLM with the old tokenizer files and a processor.
QWEN_VL = [
    ".gitattributes",
    "README.md",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "pytorch_model.bin",
    "vocab.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "demo.jpeg",
]


# --------------------------------------------------------------------------------------------
# parse_ref: accepted forms


def ref(
    repo: str, revision: str | None = None, quant: str | None = None, filename: str | None = None
) -> ModelRef:
    return ModelRef(repo_id=repo, revision=revision, quant=quant, filename=filename)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", ref("Qwen/Qwen2.5-0.5B-Instruct")),
        ("  Qwen/Qwen2.5-0.5B-Instruct\n", ref("Qwen/Qwen2.5-0.5B-Instruct")),
        ("org/repo/", ref("org/repo")),
        ("my_org/my.model_v2", ref("my_org/my.model_v2")),
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
            ref("bartowski/Llama-3.2-3B-Instruct-GGUF", quant="Q4_K_M"),
        ),
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF:q4_k_m",
            ref("bartowski/Llama-3.2-3B-Instruct-GGUF", quant="Q4_K_M"),
        ),
        ("org/repo:iq4_xs", ref("org/repo", quant="IQ4_XS")),
        ("org/repo:fp16", ref("org/repo", quant="F16")),
        ("org/repo:bf16", ref("org/repo", quant="BF16")),
        ("org/repo:ud-q4_k_xl", ref("org/repo", quant="UD-Q4_K_XL")),
        ("org/repo:latest", ref("org/repo")),
        ("org/repo:LATEST@main", ref("org/repo", revision="main")),
        (
            "TheBloke/Llama-2-7B-Chat-GGUF/llama-2-7b-chat.Q4_K_M.gguf",
            ref("TheBloke/Llama-2-7B-Chat-GGUF", filename="llama-2-7b-chat.Q4_K_M.gguf"),
        ),
        (
            "unsloth/DeepSeek-R1-GGUF/Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00003.gguf",
            ref(
                "unsloth/DeepSeek-R1-GGUF",
                filename="Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00003.gguf",
            ),
        ),
        ("org/repo/Model.GGUF", ref("org/repo", filename="Model.GGUF")),
        (f"org/repo@{SHA}", ref("org/repo", revision=SHA)),
        ("org/repo:Q4_K_M@main", ref("org/repo", revision="main", quant="Q4_K_M")),
        ("org/repo@main:Q4_K_M", ref("org/repo", revision="main", quant="Q4_K_M")),
        ("org/repo@v1.0-rc.1", ref("org/repo", revision="v1.0-rc.1")),
        ("org/repo@refs/pr/12", ref("org/repo", revision="refs/pr/12")),
        ("org/repo@feature/new_tokenizer", ref("org/repo", revision="feature/new_tokenizer")),
        (
            f"org/repo/sub/x-Q8_0.gguf@{SHA}",
            ref("org/repo", revision=SHA, filename="sub/x-Q8_0.gguf"),
        ),
        (
            "hf.co/bartowski/gemma-2-2b-it-GGUF:Q4_K_M",
            ref("bartowski/gemma-2-2b-it-GGUF", None, "Q4_K_M"),
        ),
        ("HF.CO/org/Repo:q8_0", ref("org/Repo", quant="Q8_0")),
        ("hf.co/org/repo:Q4_K_M@dev", ref("org/repo", revision="dev", quant="Q4_K_M")),
        ("huggingface.co/org/repo", ref("org/repo")),
        ("www.huggingface.co/org/repo", ref("org/repo")),
        ("huggingface.co/org/repo/x.gguf", ref("org/repo", filename="x.gguf")),
        ("https://huggingface.co/org/repo", ref("org/repo")),
        ("https://huggingface.co/org/repo/", ref("org/repo")),
        ("http://hf.co/org/repo", ref("org/repo")),
        ("https://huggingface.co/org/repo:Q5_K_M", ref("org/repo", quant="Q5_K_M")),
        ("https://huggingface.co/org/repo?library=transformers", ref("org/repo")),
        ("https://huggingface.co/org/repo/tree/main", ref("org/repo", revision="main")),
        (
            "https://huggingface.co/org/repo/tree/refs%2Fpr%2F3",
            ref("org/repo", revision="refs/pr/3"),
        ),
        (
            "https://huggingface.co/org/repo/blob/main/Q4_K_M/m-Q4_K_M.gguf",
            ref("org/repo", revision="main", filename="Q4_K_M/m-Q4_K_M.gguf"),
        ),
        (
            f"https://huggingface.co/org/repo/resolve/{SHA}/m%20v2-Q4_0.gguf?download=true",
            ref("org/repo", revision=SHA, filename="m v2-Q4_0.gguf"),
        ),
        ("https://huggingface.co/org/repo@dev", ref("org/repo", revision="dev")),
        ("a/" + "b" * 96, ref("a/" + "b" * 96)),
    ],
)
def test_parse_ref_accepts(text: str, expected: ModelRef) -> None:
    assert parse_ref(text) == expected


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("org/Repo", "org/Repo"),
        ("hf.co/org/Repo:q4_k_m", "org/Repo:Q4_K_M"),
        (f"https://huggingface.co/org/repo/tree/{SHA}", f"org/repo@{SHA}"),
        ("org/repo@main:q8_0", "org/repo:Q8_0@main"),
        ("org/repo/sub/m-Q4_0.gguf@refs/pr/1", "org/repo/sub/m-Q4_0.gguf@refs/pr/1"),
        ("https://hf.co/org/repo/blob/dev/m.gguf", "org/repo/m.gguf@dev"),
    ],
)
def test_str_is_canonical_and_round_trips(text: str, canonical: str) -> None:
    parsed = parse_ref(text)
    assert str(parsed) == canonical
    assert parse_ref(str(parsed)) == parsed


# --------------------------------------------------------------------------------------------
# parse_ref: rejected forms


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty reference"),
        ("   ", "empty reference"),
        ("gpt2", "organisation and a name"),
        ("hf.co/gpt2", "organisation and a name"),
        ("https://huggingface.co/gpt2", "organisation and a name"),
        ("hf.co", "organisation and a name"),
        ("/repo", "empty organisation"),
        ("org/", "organisation and a name"),
        ("org//x.gguf", "empty repo name"),
        ("org/re po", "'re po' may only hold"),
        ("org/repo!", "may only hold"),
        ("örg/repo", "may only hold"),
        ("org/re--po", "'--'"),
        ("org/re..po", "'..'"),
        ("org/-repo", "may not start or end"),
        ("org/repo.", "may not start or end"),
        ("org/" + "b" * 97, "longer than 96"),
        ("o" * 97 + "/repo", "longer than 96"),
        ("org/repo:", "empty quant"),
        ("org/repo@main:", "empty quant"),
        ("org/repo:Q4 K", "bad quant"),
        ("org/repo:Q4:K", "bad quant"),
        ("org/repo@", "empty revision"),
        (":Q4_K_M@", "empty revision"),
        ("org/repo@main@dev", "bad revision"),
        ("org/repo@../x", "bad revision"),
        ("org/repo@a b", "bad revision"),
        ("https://huggingface.co/org/repo/tree/", "empty revision"),
        ("https://huggingface.co/org/repo/tree/main@dev", "bad revision"),
        ("https://huggingface.co/org/repo/blob/main/x.gguf@dev", "two revisions"),
        ("https://huggingface.co/org/repo/tree/a%20b", "bad revision"),
        ("org/repo:Q4_K_M@main:Q8_0", "two quants"),
        ("org/repo/model.safetensors", "not a .gguf file"),
        ("org/repo/pytorch_model.bin", "not a .gguf file"),
        ("https://huggingface.co/org/repo/tree/main/Q4_K_M", "not a .gguf file"),
        ("org/repo/sub//x.gguf", "bad file path"),
        ("org/repo/../x.gguf", "bad file path"),
        ("org/repo/x.gguf:Q4_K_M", "either a file or a quant"),
        ("https://example.com/org/repo", "only Hugging Face"),
        ("ftp://huggingface.co/org/repo", "only Hugging Face"),
        ("https://huggingface.co/datasets/org/data", "datasets are not models"),
        ("hf.co/spaces/org/app", "spaces are not models"),
    ],
)
def test_parse_ref_rejects(text: str, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_ref(text)
    message = str(info.value)
    assert fragment in message
    assert VALID_FORMS in message


# --------------------------------------------------------------------------------------------
# model_id


@pytest.mark.parametrize(
    ("text", "model_id"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", "qwen/qwen2.5-0.5b-instruct"),
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M",
            "bartowski/llama-3.2-3b-instruct-gguf:q4_k_m",
        ),
        ("hf.co/org/Repo:q8_0@dev", "org/repo:q8_0"),
        ("org/repo:UD-Q4_K_XL", "org/repo:ud-q4_k_xl"),
        ("TheBloke/X-GGUF/llama-2-7b-chat.Q4_K_M.gguf", "thebloke/x-gguf:q4_k_m"),
        ("org/repo/Q4_K_M/model-00001-of-00002.gguf", "org/repo:q4_k_m"),
        ("org/repo/mmproj-model-f16.gguf", "org/repo:f16"),
        ("org/repo/Sub/Model.gguf", "org/repo/sub/model.gguf"),
        ("org/repo/model-00001-of-00002.gguf", "org/repo/model-00001-of-00002.gguf"),
    ],
)
def test_model_id(text: str, model_id: str) -> None:
    assert parse_ref(text).model_id == model_id


def test_with_quant() -> None:
    parsed = parse_ref("org/Repo/sub/m-Q8_0.gguf@dev")
    assert parsed.with_quant("q4_k_m") == ref("org/Repo", revision="dev", quant="Q4_K_M")
    assert parsed.with_quant("q4_k_m").model_id == "org/repo:q4_k_m"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("q4_k_m", "Q4_K_M"),
        ("FP16", "F16"),
        ("fp32", "F32"),
        ("iq2_xxs", "IQ2_XXS"),
        ("ud-q4_k_xl", "UD-Q4_K_XL"),
        (" Q8_0 ", "Q8_0"),
        ("bf16", "BF16"),
    ],
)
def test_normalize_quant(text: str, expected: str) -> None:
    assert normalize_quant(text) == expected


# --------------------------------------------------------------------------------------------
# choose_gguf


@pytest.mark.parametrize(
    ("files", "quant", "expected"),
    [
        (BARTOWSKI, "Q4_K_M", GgufChoice(["Llama-3.2-3B-Instruct-Q4_K_M.gguf"], None, "Q4_K_M")),
        (BARTOWSKI, "q4_k_m", GgufChoice(["Llama-3.2-3B-Instruct-Q4_K_M.gguf"], None, "Q4_K_M")),
        (BARTOWSKI, "Q4_0", GgufChoice(["Llama-3.2-3B-Instruct-Q4_0.gguf"], None, "Q4_0")),
        (
            BARTOWSKI,
            "q4_0_4_4",
            GgufChoice(["Llama-3.2-3B-Instruct-Q4_0_4_4.gguf"], None, "Q4_0_4_4"),
        ),
        (BARTOWSKI, "F16", GgufChoice(["Llama-3.2-3B-Instruct-f16.gguf"], None, "F16")),
        (BARTOWSKI, "fp16", GgufChoice(["Llama-3.2-3B-Instruct-f16.gguf"], None, "F16")),
        (THEBLOKE, "Q5_K_M", GgufChoice(["llama-2-7b-chat.Q5_K_M.gguf"], None, "Q5_K_M")),
        (
            QWEN_SPLIT,
            "Q8_0",
            GgufChoice(
                [f"qwen2.5-7b-instruct-q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)], None, "Q8_0"
            ),
        ),
        (
            QWEN_SPLIT,
            "F16",
            GgufChoice(
                [f"qwen2.5-7b-instruct-fp16-0000{i}-of-00004.gguf" for i in (1, 2, 3, 4)],
                None,
                "F16",
            ),
        ),
        (
            SPLIT_CAMEL,
            "Q4_K_M",
            GgufChoice(
                [
                    "Qwen2.5-7B-Instruct-Q4_K_M-00001-of-00002.gguf",
                    "Qwen2.5-7B-Instruct-Q4_K_M-00002-of-00002.gguf",
                ],
                None,
                "Q4_K_M",
            ),
        ),
        (
            UNSLOTH_FOLDERS,
            "q4_k_m",
            GgufChoice(
                [f"Q4_K_M/DeepSeek-R1-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)],
                None,
                "Q4_K_M",
            ),
        ),
        (
            UNSLOTH_FOLDERS,
            "UD-Q2_K_XL",
            GgufChoice(
                [f"UD-Q2_K_XL/DeepSeek-R1-UD-Q2_K_XL-0000{i}-of-00002.gguf" for i in (1, 2)],
                None,
                "UD-Q2_K_XL",
            ),
        ),
        (
            UNSLOTH_VISION,
            "Q4_K_M",
            GgufChoice(["gemma-3-27b-it-Q4_K_M.gguf"], "mmproj-BF16.gguf", "Q4_K_M"),
        ),
        (
            UNSLOTH_VISION,
            "Q4_K_XL",
            GgufChoice(["gemma-3-27b-it-UD-Q4_K_XL.gguf"], "mmproj-BF16.gguf", "Q4_K_XL"),
        ),
        (
            UNSLOTH_VISION,
            "bf16",
            GgufChoice(
                [f"BF16/gemma-3-27b-it-BF16-0000{i}-of-00002.gguf" for i in (1, 2)],
                "mmproj-BF16.gguf",
                "BF16",
            ),
        ),
        (
            GGML_ORG_VISION,
            "Q8_0",
            GgufChoice(["gemma-3-4b-it-Q8_0.gguf"], "mmproj-model-f16.gguf", "Q8_0"),
        ),
        (
            FOLDER_PROJECTORS,
            "Q4_K_M",
            GgufChoice(["Q4_K_M/model-Q4_K_M.gguf"], "Q4_K_M/mmproj-model-f16.gguf", "Q4_K_M"),
        ),
        (
            FOLDER_PROJECTORS,
            "Q8_0",
            GgufChoice(["Q8_0/model-Q8_0.gguf"], "mmproj-BF16.gguf", "Q8_0"),
        ),
        # A single file beats a split copy of the same quant.
        (
            [*SPLIT_CAMEL, "Qwen2.5-7B-Instruct-Q4_K_M.gguf"],
            "Q4_K_M",
            GgufChoice(["Qwen2.5-7B-Instruct-Q4_K_M.gguf"], None, "Q4_K_M"),
        ),
    ],
)
def test_choose_gguf(files: list[str], quant: str, expected: GgufChoice) -> None:
    choice = choose_gguf(files, quant)
    assert choice == expected
    assert choice.model_file == expected.files[0]


@pytest.mark.parametrize(
    ("projectors", "expected"),
    [
        (["mmproj-F32.gguf", "mmproj-F16.gguf", "mmproj-BF16.gguf"], "mmproj-BF16.gguf"),
        (["mmproj-F32.gguf", "mmproj-F16.gguf"], "mmproj-F16.gguf"),
        (["mmproj-Q8_0.gguf", "mmproj-F32.gguf"], "mmproj-F32.gguf"),
        (["mmproj-Q4_0.gguf", "mmproj-Q8_0.gguf"], "mmproj-Q8_0.gguf"),
        (["gemma-3-4b-it-mmproj-f16.gguf"], "gemma-3-4b-it-mmproj-f16.gguf"),
        (["other/mmproj-BF16.gguf", "mmproj-model-f32.gguf"], "mmproj-model-f32.gguf"),
        ([], None),
    ],
)
def test_mmproj_ranking(projectors: list[str], expected: str | None) -> None:
    files = ["model-Q4_K_M.gguf", *projectors]
    assert choose_gguf(files, "Q4_K_M").mmproj == expected


@pytest.mark.parametrize(
    ("files", "expected_files", "quant"),
    [
        (BARTOWSKI, ["Llama-3.2-3B-Instruct-Q4_K_M.gguf"], "Q4_K_M"),
        (THEBLOKE, ["llama-2-7b-chat.Q4_K_M.gguf"], "Q4_K_M"),
        (
            QWEN_SPLIT,
            [
                "qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf",
                "qwen2.5-7b-instruct-q4_k_m-00002-of-00002.gguf",
            ],
            "Q4_K_M",
        ),
        (
            ["m-Q8_0.gguf", "m-Q6_K.gguf", "m-Q5_K_M.gguf", "m-F16.gguf"],
            ["m-Q5_K_M.gguf"],
            "Q5_K_M",
        ),
        (["m-Q8_0.gguf", "m-Q4_0.gguf", "m-Q4_K_S.gguf"], ["m-Q4_K_S.gguf"], "Q4_K_S"),
        (["m-Q8_0.gguf", "m-BF16.gguf", "m-F32.gguf"], ["m-Q8_0.gguf"], "Q8_0"),
        (["m-IQ4_XS.gguf", "m-F16.gguf"], ["m-IQ4_XS.gguf"], "IQ4_XS"),
        (["m-BF16.gguf", "m-F32.gguf"], ["m-BF16.gguf"], "BF16"),
        # Nothing from the preference list: the smallest-looking file.
        (["m-Q3_K_M.gguf", "m-Q2_K.gguf", "m-IQ3_XS.gguf"], ["m-Q2_K.gguf"], "Q2_K"),
        (["m-IQ2_XXS.gguf", "m-IQ1_M.gguf"], ["m-IQ1_M.gguf"], "IQ1_M"),
        (["m-Q3_K_L.gguf", "model.gguf"], ["m-Q3_K_L.gguf"], "Q3_K_L"),
        (["model.gguf"], ["model.gguf"], None),
        (
            ["b/model.gguf", "a-00001-of-00002.gguf", "a-00002-of-00002.gguf"],
            ["b/model.gguf"],
            None,
        ),
        # An incomplete split is skipped for the default pick.
        (["m-Q4_K_M-00001-of-00002.gguf", "m-Q8_0.gguf"], ["m-Q8_0.gguf"], "Q8_0"),
    ],
)
def test_default_quant(files: list[str], expected_files: list[str], quant: str | None) -> None:
    choice = choose_gguf(files, None)
    assert choice.files == expected_files
    assert choice.quant == quant


def test_default_quant_projector() -> None:
    assert choose_gguf(UNSLOTH_VISION, None) == GgufChoice(
        ["gemma-3-27b-it-Q4_K_M.gguf"], "mmproj-BF16.gguf", "Q4_K_M"
    )


@pytest.mark.parametrize(
    ("files", "quant", "available"),
    [
        (
            BARTOWSKI,
            "Q2_K",
            # the preference list's order, then the rest smallest first
            [
                "Q4_K_M",
                "Q4_K_S",
                "Q5_K_M",
                "Q4_0",
                "Q6_K",
                "Q8_0",
                "IQ4_XS",
                "F16",
                "IQ3_M",
                "Q3_K_L",
                "Q3_K_XL",
                "Q4_0_4_4",
                "Q4_0_4_8",
                "Q4_K_L",
                "Q6_K_L",
            ],
        ),
        (
            THEBLOKE,
            "q6_k",
            ["Q4_K_M", "Q5_K_M", "Q4_0", "Q8_0", "Q2_K", "Q3_K_S", "Q3_K_M"],
        ),
        (QWEN_SPLIT, "Q4_0", ["Q4_K_M", "Q8_0", "F16"]),
        (UNSLOTH_VISION, "Q5_K_M", ["Q4_K_M", "Q8_0", "BF16", "Q2_K", "Q4_K_XL"]),
        (UNSLOTH_FOLDERS, "Q8_0", ["Q4_K_M", "Q2_K_XL"]),
        (["model.gguf", "mmproj-f16.gguf"], "Q4_K_M", []),
    ],
)
def test_unknown_quant_lists_available(files: list[str], quant: str, available: list[str]) -> None:
    with pytest.raises(UnknownQuant) as info:
        choose_gguf(files, quant, repo_id="org/repo")
    assert info.value.available == available
    assert info.value.quant == quant.upper()
    message = str(info.value)
    assert "org/repo" in message
    assert repr(quant.upper()) in message
    for tag in available:
        assert tag in message
    assert available_quants(files) == available


def test_available_quants_follow_the_preference_list() -> None:
    shuffled = [f"m-{q}.gguf" for q in reversed(DEFAULT_QUANT_PREFERENCE)]
    assert available_quants(shuffled) == list(DEFAULT_QUANT_PREFERENCE)


@pytest.mark.parametrize(
    ("files", "fragment"),
    [
        ([], "no GGUF model files"),
        (LLAMA_SAFETENSORS, "no GGUF model files"),
        (["mmproj-model-f16.gguf", "README.md"], "no GGUF model files"),
        (["m-Q4_K_M-00001-of-00003.gguf", "m-Q4_K_M-00003-of-00003.gguf"], "shard(s) 2 of 3"),
    ],
)
def test_choose_gguf_errors(files: list[str], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        choose_gguf(files, None)
    assert fragment in str(info.value)
    assert not isinstance(info.value, UnknownQuant)


def test_incomplete_split_named_explicitly() -> None:
    files = ["m-Q4_K_M-00001-of-00002.gguf", "m-Q8_0.gguf"]
    with pytest.raises(ValueError, match=r"shard\(s\) 2 of 2 missing"):
        choose_gguf(files, "Q4_K_M")


# --------------------------------------------------------------------------------------------
# choose_safetensors


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (LLAMA_SAFETENSORS, LLAMA_SAFETENSORS_WANTED),
        (
            MISTRAL,
            [
                "config.json",
                "generation_config.json",
                "model.safetensors.index.json",
                "special_tokens_map.json",
                "tokenizer.json",
                "tokenizer.model",
                "tokenizer_config.json",
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
            ],
        ),
        (
            QWEN_VL,
            [
                "added_tokens.json",
                "chat_template.jinja",
                "chat_template.json",
                "config.json",
                "generation_config.json",
                "merges.txt",
                "preprocessor_config.json",
                "processor_config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "vocab.json",
                "model.safetensors",
            ],
        ),
        (["config.json", "consolidated.safetensors"], ["config.json", "consolidated.safetensors"]),
        (
            ["config.json", "adapter.safetensors", "consolidated.safetensors"],
            ["config.json", "adapter.safetensors"],
        ),
    ],
)
def test_choose_safetensors(files: list[str], expected: list[str]) -> None:
    assert choose_safetensors(files) == expected


@pytest.mark.parametrize(
    ("files", "fragments"),
    [
        (BARTOWSKI, ["pull org/repo:QUANT instead", "Q4_K_M, Q4_K_S, Q5_K_M"]),
        (UNSLOTH_FOLDERS, ["pull org/repo:QUANT instead", "Q4_K_M, Q2_K_XL"]),
        (["config.json", "pytorch_model.bin", "README.md"], ["pickle", "pytorch_model.bin"]),
        (["README.md", "onnx/model.onnx"], ["no safetensors or GGUF"]),
        ([], ["no safetensors or GGUF"]),
        (["config.json", "text_encoder/model.safetensors"], ["only in sub-folders"]),
        (["model.safetensors", "params.json", "tekken.json"], ["no config.json"]),
    ],
)
def test_choose_safetensors_errors(files: list[str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        choose_safetensors(files, repo_id="org/repo")
    for fragment in fragments:
        assert fragment in str(info.value)


# --------------------------------------------------------------------------------------------
# plan_pull


@pytest.mark.parametrize(
    ("text", "files", "expected"),
    [
        (
            "meta-llama/Llama-3.1-8B-Instruct",
            LLAMA_SAFETENSORS,
            PullPlan("safetensors", LLAMA_SAFETENSORS_WANTED, None, None, None),
        ),
        (
            f"meta-llama/Llama-3.1-8B-Instruct@{SHA}",
            LLAMA_SAFETENSORS,
            PullPlan("safetensors", LLAMA_SAFETENSORS_WANTED, None, None, None),
        ),
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF",
            BARTOWSKI,
            PullPlan(
                "gguf",
                ["Llama-3.2-3B-Instruct-Q4_K_M.gguf"],
                "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
                None,
                "Q4_K_M",
            ),
        ),
        (
            "hf.co/bartowski/Llama-3.2-3B-Instruct-GGUF:q8_0",
            BARTOWSKI,
            PullPlan(
                "gguf",
                ["Llama-3.2-3B-Instruct-Q8_0.gguf"],
                "Llama-3.2-3B-Instruct-Q8_0.gguf",
                None,
                "Q8_0",
            ),
        ),
        (
            "unsloth/gemma-3-27b-it-GGUF:BF16",
            UNSLOTH_VISION,
            PullPlan(
                "gguf",
                [
                    "BF16/gemma-3-27b-it-BF16-00001-of-00002.gguf",
                    "BF16/gemma-3-27b-it-BF16-00002-of-00002.gguf",
                    "mmproj-BF16.gguf",
                ],
                "BF16/gemma-3-27b-it-BF16-00001-of-00002.gguf",
                "mmproj-BF16.gguf",
                "BF16",
            ),
        ),
        (
            "ggml-org/gemma-3-4b-it-GGUF",
            GGML_ORG_VISION,
            PullPlan(
                "gguf",
                ["gemma-3-4b-it-Q4_K_M.gguf", "mmproj-model-f16.gguf"],
                "gemma-3-4b-it-Q4_K_M.gguf",
                "mmproj-model-f16.gguf",
                "Q4_K_M",
            ),
        ),
        (
            "TheBloke/Llama-2-7B-Chat-GGUF/llama-2-7b-chat.Q3_K_S.gguf",
            THEBLOKE,
            PullPlan(
                "gguf",
                ["llama-2-7b-chat.Q3_K_S.gguf"],
                "llama-2-7b-chat.Q3_K_S.gguf",
                None,
                "Q3_K_S",
            ),
        ),
        # A later shard (any case) brings the whole split model.
        (
            "unsloth/DeepSeek-R1-GGUF/q4_k_m/deepseek-r1-q4_k_m-00002-of-00003.gguf",
            UNSLOTH_FOLDERS,
            PullPlan(
                "gguf",
                [f"Q4_K_M/DeepSeek-R1-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)],
                "Q4_K_M/DeepSeek-R1-Q4_K_M-00001-of-00003.gguf",
                None,
                "Q4_K_M",
            ),
        ),
        (
            "org/repo/Q4_K_M/model-Q4_K_M.gguf",
            FOLDER_PROJECTORS,
            PullPlan(
                "gguf",
                ["Q4_K_M/model-Q4_K_M.gguf", "Q4_K_M/mmproj-model-f16.gguf"],
                "Q4_K_M/model-Q4_K_M.gguf",
                "Q4_K_M/mmproj-model-f16.gguf",
                "Q4_K_M",
            ),
        ),
        (
            "org/repo/model.gguf",
            ["model.gguf", "README.md"],
            PullPlan("gguf", ["model.gguf"], "model.gguf", None, None),
        ),
        # Both formats: a bare repo is the safetensors model, a quant the GGUF one.
        (
            "org/both",
            [*QWEN_VL, "gguf/model-Q4_K_M.gguf"],
            PullPlan("safetensors", choose_safetensors(QWEN_VL), None, None, None),
        ),
        (
            "org/both:Q4_K_M",
            [*QWEN_VL, "gguf/model-Q4_K_M.gguf"],
            PullPlan("gguf", ["gguf/model-Q4_K_M.gguf"], "gguf/model-Q4_K_M.gguf", None, "Q4_K_M"),
        ),
    ],
)
def test_plan_pull(text: str, files: list[str], expected: PullPlan) -> None:
    assert plan_pull(parse_ref(text), files) == expected


@pytest.mark.parametrize(
    ("text", "files", "fragments"),
    [
        (
            "TheBloke/Llama-2-7B-Chat-GGUF/llama-2-7b-chat.Q6_K.gguf",
            THEBLOKE,
            [
                "no file 'llama-2-7b-chat.Q6_K.gguf'",
                "llama-2-7b-chat.Q2_K.gguf",
                "llama-2-7b-chat.Q8_0.gguf",
            ],
        ),
        ("org/repo/x.gguf", LLAMA_SAFETENSORS, ["no file 'x.gguf'", "GGUF files: none"]),
        ("org/repo/mmproj-F16.gguf", UNSLOTH_VISION, ["multimodal projector"]),
        ("org/repo:Q4_K_M", LLAMA_SAFETENSORS, ["no GGUF files", "without a quant"]),
        ("org/repo:Q2_K", QWEN_SPLIT, ["available quants: Q4_K_M, Q8_0, F16"]),
        ("org/repo", ["README.md"], ["no safetensors or GGUF"]),
        ("org/repo/m-00001-of-00002.gguf", ["m-00001-of-00002.gguf"], ["shard(s) 2 of 2"]),
    ],
)
def test_plan_pull_errors(text: str, files: list[str], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        plan_pull(parse_ref(text), files)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_plan_pull_unknown_quant_is_typed() -> None:
    with pytest.raises(UnknownQuant) as info:
        plan_pull(parse_ref("bartowski/Llama-3.2-3B-Instruct-GGUF:Q1_0"), BARTOWSKI)
    assert info.value.available[:3] == ["Q4_K_M", "Q4_K_S", "Q5_K_M"]
    assert issubclass(UnknownQuant, ValueError)


def test_missing_file_listing_is_capped() -> None:
    files = [f"m-{i:03d}-Q4_0.gguf" for i in range(30)]
    with pytest.raises(ValueError, match="and 10 more"):
        plan_pull(parse_ref("org/repo/nope.gguf"), files)


@pytest.mark.parametrize(
    ("text", "files", "model_id"),
    [
        (
            "bartowski/Llama-3.2-3B-Instruct-GGUF",
            BARTOWSKI,
            "bartowski/llama-3.2-3b-instruct-gguf:q4_k_m",
        ),
        ("org/repo", ["model.gguf"], "org/repo/model.gguf"),
        ("org/repo:Q8_0", BARTOWSKI, "org/repo:q8_0"),
        ("org/Repo", LLAMA_SAFETENSORS, "org/repo"),
        ("org/repo/llama-2-7b-chat.Q2_K.gguf", THEBLOKE, "org/repo:q2_k"),
    ],
)
def test_pulled_model_id(text: str, files: list[str], model_id: str) -> None:
    parsed = parse_ref(text)
    assert pulled_model_id(parsed, plan_pull(parsed, files)) == model_id
