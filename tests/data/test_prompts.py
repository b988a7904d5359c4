"""Prompt styles as messages, rendered through the tokenizer module, and length filtering."""

import pytest

from bapo_jax.data import (
    BOXED_INSTRUCTION,
    build_messages,
    filter_by_prompt_length,
    render_prompt,
    render_prompt_text,
)
from bapo_jax.models import tokenizer as tok

PROBLEM = "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$"

# The DeepSeek-R1-Distill-Qwen special tokens (they take the ids right after the Qwen2
# vocabulary in that tokenizer). The test only relies on each being a single special token.
R1_ADDED_TOKENS = [
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜begin▁of▁sentence｜>",
    "<|EOT|>",
    "<think>",
    "</think>",
]
# The distill chat template's structure (written for this test): BOS, a bare system text,
# `<｜User｜>` turns, `<｜Assistant｜>` turns closed by EOS, and the generation prompt. The
# first revision of the template ended the prompt with `<｜Assistant｜>`; later revisions
# append "<think>\n" themselves.
R1_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' + generation_suffix }}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen():
    return tok.load_tokenizer()


@pytest.fixture(scope="module")
def r1_backend():
    first_id = 151643
    added = {
        first_id + i: {"content": content, "special": True}
        for i, content in enumerate(R1_ADDED_TOKENS)
    }
    directory = tok.SHIPPED_TOKENIZER_DIR
    return tok.build_qwen2_backend(directory / "vocab.json", directory / "merges.txt", added)


def _r1_tokenizer(backend, generation_suffix: str) -> tok.Tokenizer:
    template = R1_TEMPLATE.replace("generation_suffix", repr(generation_suffix))
    return tok.Tokenizer(
        backend,
        eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜end▁of▁sentence｜>",
        bos_token="<｜begin▁of▁sentence｜>",
        chat_template=template,
    )


def test_messages_of_both_styles():
    expected_user = {"role": "user", "content": PROBLEM + "\n" + BOXED_INSTRUCTION}
    assert BOXED_INSTRUCTION == (
        "Please reason step by step, and put your final answer within \\boxed{}."
    )
    assert build_messages(PROBLEM, "qwen_math") == [expected_user]
    assert build_messages(PROBLEM, "r1_distill") == [expected_user]
    assert build_messages("  " + PROBLEM + "\n", "qwen_math") == [expected_user]
    assert build_messages(PROBLEM, "qwen_math", system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        expected_user,
    ]


def test_message_errors():
    with pytest.raises(ValueError, match="system_prompt must be None for style 'r1_distill'"):
        build_messages(PROBLEM, "r1_distill", system_prompt="You are helpful.")
    with pytest.raises(ValueError, match="style must be one of \\['qwen_math', 'r1_distill'\\]"):
        build_messages(PROBLEM, "llama")
    with pytest.raises(ValueError, match="problem must be a non-empty string"):
        build_messages("   ")


def test_qwen_math_renders_with_the_shipped_chat_template(qwen):
    messages = build_messages(PROBLEM, "qwen_math")
    text = render_prompt_text(messages, qwen, "qwen_math")
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n"
        f"<|im_start|>user\n{PROBLEM}\n{BOXED_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = render_prompt(messages, qwen, "qwen_math")
    assert ids == qwen.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids[0] == tok.IM_START_ID and ids.count(tok.IM_END_ID) == 2
    assert qwen.decode(ids) == text


@pytest.mark.parametrize("template_suffix", ["", "<think>\n"], ids=["old", "new"])
def test_r1_distill_renders_and_opens_think_once(r1_backend, template_suffix):
    r1 = _r1_tokenizer(r1_backend, template_suffix)
    messages = build_messages(PROBLEM, "r1_distill")
    text = render_prompt_text(messages, r1, "r1_distill")
    expected = (
        f"<｜begin▁of▁sentence｜><｜User｜>{PROBLEM}\n{BOXED_INSTRUCTION}<｜Assistant｜><think>\n"
    )
    assert text == expected
    ids = render_prompt(messages, r1, "r1_distill")
    bos, user, assistant, think = (
        r1.token_to_id(t)
        for t in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>")
    )
    assert ids[:2] == [bos, user]
    assert ids[-3:] == [assistant, think, r1.encode("\n")[0]]
    assert ids.count(think) == 1
    assert r1.decode(ids) == expected


def test_filter_by_prompt_length_hand_cases():
    kept = filter_by_prompt_length([5, 10, 11, 3, 10], 10)
    assert kept.kept == (0, 1, 3, 4)
    assert kept.dropped == 1
    assert filter_by_prompt_length([5, 6], 4).kept == ()
    with pytest.raises(ValueError, match="max_prompt_tokens must be >= 1, got 0"):
        filter_by_prompt_length([1], 0)
