"""GGUF import: a small file written here with llama.cpp's conventions, and the bundled SmolLM2."""
import os

import numpy as np
import pytest

import gguf
from jaxprefix.checkpoints import gguf as gguf_import, hf

TINY = dict(hidden=64, heads=4, kv_heads=2, inter=96, layers=2, vocab=96, context=128)
QUANTISED = ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight")


def llama_cpp_permute(w, n_heads):
    """Q/K row permutation as llama.cpp's convert_hf_to_gguf.py writes it (the inverse of ours)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(seed=0):
    t, rng = TINY, np.random.default_rng(seed)
    d, dh = t["hidden"], t["hidden"] // t["heads"]
    shapes = {"model.embed_tokens.weight": (t["vocab"], d), "model.norm.weight": (d,),
              "lm_head.weight": (t["vocab"], d)}
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (t["heads"] * dh, d),
            p + "self_attn.k_proj.weight": (t["kv_heads"] * dh, d),
            p + "self_attn.v_proj.weight": (t["kv_heads"] * dh, d),
            p + "self_attn.o_proj.weight": (d, t["heads"] * dh),
            p + "mlp.gate_proj.weight": (t["inter"], d), p + "mlp.up_proj.weight": (t["inter"], d),
            p + "mlp.down_proj.weight": (d, t["inter"])})
    return {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in shapes.items()}


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{GGUF_NAMES[module]}.weight"


def write_tiny_gguf(path, tensors, arch="llama", tied=False, quantise=()):
    """A llama GGUF as llama.cpp writes one: permuted Q/K, chosen tensors in Q8_0."""
    t = TINY
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(t["context"])
    w.add_embedding_length(t["hidden"])
    w.add_block_count(t["layers"])
    w.add_feed_forward_length(t["inter"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(t["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, x in tensors.items():
        if tied and name == "lm_head.weight":
            continue
        if "q_proj" in name:
            x = llama_cpp_permute(x, t["heads"])
        elif "k_proj" in name:
            x = llama_cpp_permute(x, t["kv_heads"])
        if name in quantise:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), gguf.quants.quantize(x, q8), raw_dtype=q8)
        else:
            w.add_tensor(gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tensors = tiny_hf_tensors()
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path, tensors, quantise=QUANTISED)
    return path, tensors


def test_tiny_round_trip_undoes_permutation_and_dequantises(tiny):
    path, expected = tiny
    config, tensors = gguf_import.read_gguf(path)
    assert sorted(tensors) == sorted(expected)
    for name, x in expected.items():
        assert tensors[name].dtype == np.float32 and tensors[name].shape == x.shape, name
        if name in QUANTISED:
            # Q8_0: one scale per 32 values, error at most half a step of max|x|/127.
            step = np.abs(x).max() / 127
            np.testing.assert_allclose(tensors[name], x, atol=step, err_msg=name)
            assert not np.array_equal(tensors[name], x)
        else:
            np.testing.assert_array_equal(tensors[name], x, err_msg=name)
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 96
    assert config["num_hidden_layers"] == 2 and config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16
    assert config["vocab_size"] == 96 and config["max_position_embeddings"] == 128
    assert config["rope_theta"] == 50000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_permutation_is_inverse_of_llama_cpp():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    back = gguf_import.unpermute_rotary(llama_cpp_permute(w, 8), 8)
    np.testing.assert_array_equal(back, w)
    # Not the identity: HF row 1 (first half, pair 1) is GGUF row 2 (pair 1, first element).
    np.testing.assert_array_equal(gguf_import.unpermute_rotary(w, 8)[1], w[2])


def test_tied_when_no_output_tensor(tmp_path):
    tensors = tiny_hf_tensors()
    path = str(tmp_path / "tied.gguf")
    write_tiny_gguf(path, tensors, tied=True)
    config, read = gguf_import.read_gguf(path)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in read


def test_errors_name_file_and_expectation(tmp_path, tiny):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_import.read_gguf(missing)

    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"model.bin.*expected magic b'GGUF'"):
        gguf_import.read_gguf(not_gguf)

    data = open(tiny[0], "rb").read()
    # Cut in the tensor data, or in the header: the message says which.
    for cut, part in ((len(data) - 100, "the header is whole but the tensor data is cut"),
                      (200, "unreadable GGUF header, the file is truncated")):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}.gguf.*{part}"):
            gguf_import.read_gguf(truncated)

    falcon = str(tmp_path / "falcon.gguf")
    write_tiny_gguf(falcon, tiny_hf_tensors(), arch="falcon")
    with pytest.raises(ValueError, match=r"falcon.gguf.*'falcon' is not supported.*llama"):
        gguf_import.read_gguf(falcon)


def test_bundled_smollm2_metadata():
    path = gguf_import.bundled_smollm2_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = gguf_import.read_gguf_config(path)
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30, 576, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["vocab_size"], config["rope_theta"], config["rms_norm_eps"]) == (
        49152, 100000.0, 1e-5)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


# --- against transformers' own GGUF loading of the same file ------------------------------------


@pytest.fixture(scope="module")
def smollm2_ours():
    return gguf_import.read_gguf(gguf_import.bundled_smollm2_path())


@pytest.fixture(scope="module")
def smollm2_transformers():
    from transformers import AutoModelForCausalLM
    path = gguf_import.bundled_smollm2_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)).eval()


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers(smollm2_ours, smollm2_transformers):
    config, tensors = smollm2_ours
    reference = {k: v.numpy() for k, v in smollm2_transformers.state_dict().items()}
    assert config["tie_word_embeddings"] and "lm_head.weight" not in tensors
    reference.pop("lm_head.weight")  # tied: transformers lists the embedding twice
    assert sorted(tensors) == sorted(reference)
    for name, x in reference.items():
        np.testing.assert_array_equal(tensors[name], x, err_msg=name)
    hf = smollm2_transformers.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim"):
        assert config[key] == getattr(hf, key), key
    assert config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]


def transformers_llama(config, tensors):
    """transformers' LlamaForCausalLM holding HF-named numpy `tensors`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    hf_config = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    model = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def logits_both_ways(model, reference, ids):
    import torch
    ours = np.asarray(model(np.asarray([ids], dtype=np.int32)))[0]
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0].numpy()
    return ours, theirs


def test_tiny_from_gguf_logits_match_transformers(tiny):
    # Rotary is where an un-undone permutation shows: logits differ from position 1 on.
    path, originals = tiny
    model, config = hf.from_gguf(path)
    hf_config, tensors = gguf_import.read_gguf(path)
    assert config.num_layers == 2 and config.num_kv_heads == 2
    reference = transformers_llama(hf_config, tensors)
    ids = [3, 17, 5, 90, 41, 41, 8, 60, 2, 77]
    ours, theirs = logits_both_ways(model, reference, ids)
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_transformers):
    from transformers import AutoTokenizer
    path = gguf_import.bundled_smollm2_path()
    model, _ = hf.from_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path))
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Solve: 12 * 7 = ",
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
    worst = 0.0
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        ours, theirs = logits_both_ways(model, smollm2_transformers, ids)
        np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
        worst = max(worst, float(np.abs(ours - theirs).max()))
    print(f"SmolLM2 GGUF: max |logit difference| vs transformers = {worst:.2e}")
    assert worst < 1e-3
