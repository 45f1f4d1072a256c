"""Tokenizers against their references: transformers (GGUF and HF directories), sentencepiece."""
import json
import os
import shutil

import jinja2
import pytest
import sentencepiece

import gguf
from jaxprefix import tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path

TEXTS = [
    "Hello world",
    "12345 + 678 = 13023, and 3.14159 x10^-3",
    r"$\frac{a^2+b^2}{\sqrt{c}}$ and \boxed{42}",
    "  leading, trailing  and   runs of spaces   ",
    "line one\n\nline two\n\n\n\tindented\r\nwindows",
    "unicode: café, naïve, 日本語, Ελληνικά, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 7 * 8?"}],
    [{"role": "system", "content": "You solve math."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]
UNFINISHED = [{"role": "user", "content": "Compute 12 * 13."},
              {"role": "assistant", "content": "First, 12 * 10 = 120. Then"}]


@pytest.fixture(scope="module")
def smollm2_path():
    return bundled_smollm2_path()


@pytest.fixture(scope="module")
def ours_gguf(smollm2_path):
    return tokenizers.load(smollm2_path)


@pytest.fixture(scope="module")
def theirs_gguf(smollm2_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path),
                                         gguf_file=os.path.basename(smollm2_path))


def assert_same_tokenizer(ours, theirs):
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True), text


def assert_same_chat_template(ours, theirs, conversations=CONVERSATIONS, unfinished=UNFINISHED):
    for messages in conversations:
        for add in (True, False):
            expected = theirs.apply_chat_template(messages, add_generation_prompt=add,
                                                  tokenize=False)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
            assert ours.apply_chat_template(messages, add_generation_prompt=add,
                                            tokenize=True) == theirs.encode(
                                                expected, add_special_tokens=False)
    expected = theirs.apply_chat_template(unfinished, continue_final_message=True, tokenize=False)
    assert ours.apply_chat_template(unfinished, continue_final_message=True) == expected
    return expected


def test_gguf_vocabulary_matches_transformers(ours_gguf, theirs_gguf):
    assert_same_tokenizer(ours_gguf, theirs_gguf)
    # Hand-checked pieces: digits one by one (smollm pre-tokenizer), specials whole.
    assert ours_gguf.encode("2024") == [34, 32, 34, 36]
    assert ours_gguf.encode("<|im_end|>") == [2]


def test_gguf_chat_template_matches_transformers(ours_gguf, theirs_gguf):
    continued = assert_same_chat_template(ours_gguf, theirs_gguf)
    assert continued.endswith("<|im_start|>assistant\nFirst, 12 * 10 = 120. Then")
    # The continuation is a strict prefix of the finished conversation's text.
    finished = ours_gguf.apply_chat_template(UNFINISHED, add_generation_prompt=False)
    assert finished.startswith(continued) and finished[len(continued):] == "<|im_end|>\n"


# A template exercising what transformers' environment provides: trim_blocks/lstrip_blocks,
# loop controls, raise_exception, tojson (no HTML escaping, non-ASCII kept), strftime_now, and a
# `trim` that strips the final message (continue_final_message must then strip too).
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {{ '[sys] ' + m['content'] }}
        {% continue %}
    {% endif %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + m['role']) }}
    {% endif %}
<{{ m['role'] }}>{{ m['content'] | trim }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<assistant meta={{ {'year': strftime_now('%Y') | length, 'tag': 'é<&>'} | tojson }}>
{% endif %}"""


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory, theirs_gguf):
    """The SmolLM2 tokenizer saved by transformers, with TEMPLATE and a BOS post-processor."""
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    theirs_gguf.save_pretrained(directory)
    os.remove(directory / "chat_template.jinja")
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config["bos_token"] = {"__type": "AddedToken", "content": "<|im_start|>", "lstrip": False,
                           "rstrip": False, "normalized": False, "special": True}
    config_path.write_text(json.dumps(config))
    spec_path = directory / "tokenizer.json"
    spec = json.loads(spec_path.read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                            "tokens": ["<|im_start|>"]}}}
    spec_path.write_text(json.dumps(spec))
    return directory


def test_hf_directory_matches_transformers(hf_directory):
    from transformers import AutoTokenizer
    ours, theirs = tokenizers.load(hf_directory), AutoTokenizer.from_pretrained(hf_directory)
    assert isinstance(ours, tokenizers.HFTokenizer)
    assert_same_tokenizer(ours, theirs)
    assert ours.encode("hi", add_special_tokens=True)[0] == 1
    unfinished = [*UNFINISHED[:-1], {"role": "assistant", "content": "Then   "}]
    continued = assert_same_chat_template(ours, theirs, unfinished=unfinished)
    assert continued.endswith("<assistant>Then")
    assert '"é<&>"' in ours.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    # Loading tokenizer.json by file name reads the config beside it.
    assert tokenizers.load(hf_directory / "tokenizer.json").chat_template == TEMPLATE


def test_hf_directory_errors(tmp_path, hf_directory):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json, tokenizer.model or task_tokenizer.json"):
        tokenizers.load(tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(hf_directory, broken)
    (broken / "tokenizer_config.json").write_text('{"eos_token": "<|not a token|>"}')
    with pytest.raises(ValueError, match=r"eos_token '<\|not a token\|>' is not in the vocabulary"):
        tokenizers.load(broken)
    (broken / "tokenizer_config.json").write_text('{"eos_token": ')
    with pytest.raises(ValueError, match=r"tokenizer_config.json: invalid JSON"):
        tokenizers.load(broken)
    (broken / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    with pytest.raises(ValueError, match="has no chat template"):
        tokenizers.load(broken).apply_chat_template(CONVERSATIONS[0])


CORPUS = """The quick brown fox jumps over the lazy dog.
Seven times eight is fifty-six; twelve times thirteen is one hundred fifty-six.
A prefix of a solution guides the policy towards the answer.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    corpus = directory / "corpus.txt"
    corpus.write_text(CORPUS * 20)
    # Llama 2 style: BPE, bytes as <0xXX> pieces, text kept as written (no normalisation).
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "tokenizer"), vocab_size=400,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, bos_id=1, eos_id=2,
        unk_id=0, pad_id=3, normalization_rule_name="identity", remove_extra_whitespaces=False,
        minloglevel=2)
    return directory / "tokenizer.model"


def test_sentencepiece_matches_processor(sentencepiece_model):
    ours = tokenizers.load(sentencepiece_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.pad_id) == (400, 1, 2, 3)
    for text in TEXTS + CORPUS.splitlines():
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert ours.encode(text, add_special_tokens=True) == [1] + ids
        assert ours.decode(ids) == sp.decode(ids), text
    ids = ours.encode("the fox") + [2]
    assert ours.decode(ids) == "the fox</s>"
    assert ours.decode(ids, skip_special_tokens=True) == "the fox"
    with pytest.raises(ValueError, match="has no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_sentencepiece_directory_uses_config(sentencepiece_model, tmp_path):
    shutil.copy(sentencepiece_model, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}",
         "eos_token": "<s>"}))
    ours = tokenizers.load(tmp_path)
    assert isinstance(ours, tokenizers.SentencePieceTokenizer) and ours.eos_id == 1
    assert ours.apply_chat_template(UNFINISHED, continue_final_message=True) == (
        "[user] Compute 12 * 13.[assistant] First, 12 * 10 = 120. Then")


def test_char_tokenizer():
    tok = tokenizers.CharTokenizer("0123456789+*= \n")
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id) == (17, 0, 1, None)
    assert tok.encode("12+3=") == [3, 4, 12, 5, 14]
    assert tok.encode("7 *8\n<eos><pad>") == [9, 15, 13, 10, 16, 1, 0]
    assert tok.decode([3, 4, 12, 5, 14, 1, 0]) == "12+3=<eos><pad>"
    assert tok.decode([3, 4, 12, 5, 14, 1, 0], skip_special_tokens=True) == "12+3="
    for text in ("", "9*9=81\n", "1 2 3<eos>"):
        assert tok.decode(tok.encode(text)) == text
    # The template concatenates contents; a generation prompt adds nothing.
    messages = [{"role": "user", "content": "3*4="}, {"role": "assistant", "content": "1"}]
    assert tok.apply_chat_template(messages[:1]) == "3*4="
    assert tok.apply_chat_template(messages, continue_final_message=True) == "3*4=1"
    assert tok.apply_chat_template(messages, continue_final_message=True, tokenize=True) == [
        5, 13, 6, 14, 3]
    with pytest.raises(ValueError, match=r"character 'x' is not in the vocabulary"):
        tok.encode("3x4")
    with pytest.raises(ValueError, match="token id 17 outside"):
        tok.decode([17])
    with pytest.raises(ValueError, match="single characters"):
        tokenizers.CharTokenizer(["1", "22"])
    with pytest.raises(ValueError, match="repeated"):
        tokenizers.CharTokenizer("112")


def test_chat_template_input_errors():
    tok = tokenizers.CharTokenizer("ab")
    with pytest.raises(ValueError, match="needs a final message"):
        tok.apply_chat_template([], continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
        tok.apply_chat_template([{"content": "a"}])


def write_gguf_vocabulary(path, kind, tokens, scores, types, bos=None, eos=None, unk=None):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for add, token_id in ((writer.add_bos_token_id, bos), (writer.add_eos_token_id, eos),
                          (writer.add_unk_token_id, unk)):
        if token_id is not None:
            add(token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found: .*missing.json"):
        tokenizers.load(tmp_path / "missing.json")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\n")
    with pytest.raises(ValueError, match=r"vocab.txt: unknown tokenizer format \(expected"):
        tokenizers.load(vocab)
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"\x00not a protobuf")
    with pytest.raises(ValueError, match="bad.model: not a SentencePiece model"):
        tokenizers.load(bad_model)
    # A GGUF vocabulary of another kind (T5's unigram) is refused with the alternative named.
    path = str(tmp_path / "t5_vocab.gguf")
    write_gguf_vocabulary(path, "t5", ["<pad>", "</s>", "<unk>", "\u2581a"], [0.0] * 4,
                          [3, 3, 2, 1])
    with pytest.raises(ValueError, match=r"t5_vocab.gguf: GGUF tokenizer.ggml.model 't5' is not "
                                         r"supported.*tokenizer.model"):
        tokenizers.load(path)


def test_gguf_sentencepiece_vocabulary_matches_processor(sentencepiece_model, tmp_path):
    # The pieces, scores and types llama.cpp's converter writes for a tokenizer.model.
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]
    path = str(tmp_path / "spm_vocab.gguf")
    write_gguf_vocabulary(path, "llama", [sp.id_to_piece(i) for i in range(n)],
                          [sp.get_score(i) for i in range(n)], types,
                          bos=sp.bos_id(), eos=sp.eos_id(), unk=sp.unk_id())
    ours = tokenizers.load(path)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (n, 1, 2)
    for text in TEXTS + CORPUS.splitlines() + [" leading space", "a  b", "x\n y"]:
        ids = ours.encode(text)
        assert ids == sp.encode(text), text
        assert ours.encode(text, add_special_tokens=True) == [1] + ids  # llama.cpp adds BOS
        assert ours.decode(ids) == sp.decode(ids), text
