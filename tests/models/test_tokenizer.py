"""The shipped Qwen2.5 tokenizer: golden ids, round trips, chat prompts equal to transformers."""

import json
import shutil

import jinja2
import numpy as np
import pytest

from bapo_jax.models import tokenizer as tok

TESTVECTORS = tok.SHIPPED_TOKENIZER_DIR / "testvectors"
AIME_2024 = tok.SHIPPED_TOKENIZER_DIR.parent / "data" / "aime" / "aime2024.jsonl"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
SEPARATOR = "\n__ggml_vocab_test__\n"


def read_testvectors() -> list[tuple[str, list[int]]]:
    """llama.cpp's format: every input is followed by SEPARATOR (so splitting leaves one empty
    trailing piece); the .out file has one line of space-separated ids per input, empty for an
    input with no tokens."""
    raw_inputs = (TESTVECTORS / "qwen2_vocab_test.inp").read_text(encoding="utf-8")
    raw_outputs = (TESTVECTORS / "qwen2_vocab_test.out").read_text(encoding="utf-8")
    assert raw_inputs.endswith(SEPARATOR)
    inputs = raw_inputs[: -len(SEPARATOR)].split(SEPARATOR)
    assert raw_outputs.endswith("\n")
    outputs = [[int(i) for i in line.split()] for line in raw_outputs[:-1].split("\n")]
    assert len(inputs) == len(outputs)
    return list(zip(inputs, outputs, strict=True))


TESTVECTOR_CASES = read_testvectors()


@pytest.fixture(scope="module")
def qwen() -> tok.Tokenizer:
    return tok.load_tokenizer()


def test_hello_world_and_special_ids(qwen):
    assert qwen.encode("Hello world") == [9707, 1879]
    assert qwen.token_to_id(tok.ENDOFTEXT_TOKEN) == tok.ENDOFTEXT_ID == 151643
    assert qwen.token_to_id(tok.IM_START_TOKEN) == tok.IM_START_ID == 151644
    assert qwen.token_to_id(tok.IM_END_TOKEN) == tok.IM_END_ID == 151645
    assert qwen.vocab_size == 151665
    assert (qwen.eos_id, qwen.pad_id, qwen.bos_id) == (tok.IM_END_ID, tok.ENDOFTEXT_ID, None)
    # Special tokens written in the text map to their ids.
    assert qwen.encode("<|im_start|>user") == [tok.IM_START_ID, 872]


def test_base_model_eos_is_an_argument():
    base = tok.load_tokenizer(eos_token=tok.BASE_MODEL_EOS)
    assert base.eos_id == tok.ENDOFTEXT_ID
    with pytest.raises(ValueError, match="eos_token must be a token of the vocabulary"):
        tok.load_tokenizer(eos_token="<|not_a_token|>")


def test_testvector_file_has_every_input():
    # 46 separators and 46 id lines: llama.cpp's Qwen2 list, including the empty string.
    assert len(TESTVECTOR_CASES) == 46
    assert ("", []) in TESTVECTOR_CASES
    assert ("Hello world", [9707, 1879]) in TESTVECTOR_CASES


@pytest.mark.parametrize(
    ("text", "expected"), TESTVECTOR_CASES, ids=[f"vec{i}" for i in range(len(TESTVECTOR_CASES))]
)
def test_llama_cpp_testvectors(qwen, text, expected):
    assert qwen.encode(text) == expected


def test_encode_batch_equals_encode(qwen):
    texts = [text for text, _ in TESTVECTOR_CASES]
    assert qwen.encode_batch(texts) == [ids for _, ids in TESTVECTOR_CASES]


def test_decode_round_trip(qwen):
    for text, ids in TESTVECTOR_CASES:
        # NFC normalisation is the only change encoding may make; these inputs are NFC already.
        assert qwen.decode(ids) == text
    prompt_ids = qwen.apply_chat_template([{"role": "user", "content": "1+1?"}])
    assert qwen.decode(prompt_ids, skip_special_tokens=True) == (
        "system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n"
        "user\n1+1?\nassistant\n"
    )


def test_decode_of_a_split_multibyte_character_uses_replacement(qwen):
    ids = qwen.encode("𓀀")
    assert len(ids) > 1  # the emoji is several byte-level tokens
    assert qwen.decode(ids[:1]) == "\ufffd"


def test_chat_template_text(qwen):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    text = qwen.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = qwen.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]


def test_bad_messages_are_rejected(qwen):
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a 'role'"):
        qwen.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="messages must be a list of dicts"):
        qwen.apply_chat_template("hello")


def test_template_raise_exception_is_available():
    template = tok.compile_chat_template("{{ raise_exception('bad role: ' + messages[0].role) }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role: robot"):
        template.render(messages=[{"role": "robot"}])


def test_hf_dir_with_tokenizer_json_and_vocab_merges(tmp_path, qwen):
    # A model directory without tokenizer.json loads from vocab/merges + tokenizer_config.json.
    vocab_dir = tmp_path / "vocab_merges"
    shutil.copytree(tok.SHIPPED_TOKENIZER_DIR, vocab_dir, ignore=shutil.ignore_patterns("test*"))
    (vocab_dir / "chat_template.jinja").unlink()  # falls back to tokenizer_config's template
    from_vocab = tok.load_tokenizer(vocab_dir)
    # A directory holding tokenizer.json loads from it.
    json_dir = tmp_path / "tokenizer_json"
    json_dir.mkdir()
    qwen.backend.save(str(json_dir / "tokenizer.json"))
    config = json.loads((vocab_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["eos_token"] = {"content": tok.ENDOFTEXT_TOKEN}
    (json_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    from_json = tok.load_tokenizer(json_dir)
    assert from_json.eos_id == tok.ENDOFTEXT_ID
    messages = [{"role": "user", "content": "Äpfel 😁 <|im_end|> 123"}]
    expected = qwen.apply_chat_template(messages)
    assert from_vocab.apply_chat_template(messages) == expected
    assert from_json.apply_chat_template(messages) == expected
    (vocab_dir / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing merges\.txt"):
        tok.load_tokenizer(vocab_dir)


def test_runtime_path_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys; from bapo_jax.models.tokenizer import load_tokenizer; "
        "load_tokenizer().apply_chat_template([{'role': 'user', 'content': 'x'}]); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_aime_2024_prompts_equal_transformers(qwen):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tok.SHIPPED_TOKENIZER_DIR))
    problems = [json.loads(line)["problem"] for line in AIME_2024.read_text("utf-8").splitlines()]
    assert len(problems) == 30
    for problem in problems:
        messages = [{"role": "user", "content": problem + MATH_SUFFIX}]
        expected = reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ours = qwen.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(expected))
        assert ours[-3:] == [tok.IM_START_ID, 77091, 198]  # "<|im_start|>assistant\n"
        assert qwen.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
