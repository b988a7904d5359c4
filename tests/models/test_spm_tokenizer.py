"""The in-process SentencePiece tokenizer: round trips on task text, ids, save/load, errors."""

import pytest

from bapo_jax.models import spm_tokenizer as spm_lib
from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer
from bapo_jax.tasks import arithmetic as A

CONFIG = A.ArithmeticConfig(
    min_ops=1, max_ops=4, max_operand=99, operators=("+", "-", "*"), max_mul_operand=9
)


@pytest.fixture(scope="module")
def corpus():
    return A.tokenizer_corpus(A.generate_problems(CONFIG, "sft", 400, seed=0))


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return SentencePieceTokenizer.train(corpus, vocab_size=64)


def test_round_trip_on_held_out_task_texts(tokenizer):
    texts = A.tokenizer_corpus(A.generate_problems(CONFIG, "eval", 200, seed=1))
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.unk_id not in ids, text
        assert tokenizer.decode(ids) == text


def test_prompt_and_target_encoded_apart_concatenate(tokenizer):
    problem = A.make_problem([12, 7, 3, 5], ["+", "*", "-"])
    ids = tokenizer.encode(problem.prompt_text) + tokenizer.encode(problem.target_text)
    assert tokenizer.decode(ids) == problem.prompt_text + problem.target_text


def test_digits_are_single_pieces(tokenizer):
    for digit in "0123456789":
        assert tokenizer.token_to_id(digit) is not None
    ids = tokenizer.encode("1234")
    assert [tokenizer.id_to_token(i) for i in ids] == ["1", "2", "3", "4"]


def test_special_ids_and_bos_eos_handling(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (
        spm_lib.PAD_ID,
        spm_lib.UNK_ID,
        spm_lib.BOS_ID,
        spm_lib.EOS_ID,
    )
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    plain = tokenizer.encode("3+4=")
    framed = tokenizer.encode("3+4=", add_bos=True, add_eos=True)
    assert framed == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert tokenizer.decode(framed) == "<s>3+4=</s>"
    assert tokenizer.decode(framed, skip_special_tokens=True) == "3+4="
    padded = [*plain, tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(padded, skip_special_tokens=True) == "3+4="
    assert tokenizer.is_special(tokenizer.eos_id) and not tokenizer.is_special(plain[0])
    assert tokenizer.encode_batch(["3+4=", "5"]) == [plain, tokenizer.encode("5")]


def test_vocab_size_is_bounded_and_ids_in_range(tokenizer, corpus):
    assert 16 <= tokenizer.vocab_size <= 64
    assert max(max(tokenizer.encode(t)) for t in corpus) < tokenizer.vocab_size
    assert tokenizer.token_to_id("not-a-piece") is None
    assert tokenizer.id_to_token(tokenizer.vocab_size) is None


def test_training_is_deterministic_and_save_load_round_trips(corpus, tokenizer, tmp_path):
    again = SentencePieceTokenizer.train(corpus, vocab_size=64)
    assert again.model_proto == tokenizer.model_proto
    path = tmp_path / "task.model"
    tokenizer.save(path)
    loaded = SentencePieceTokenizer.load(path)
    assert loaded.model_proto == tokenizer.model_proto
    assert loaded.encode(corpus[1]) == tokenizer.encode(corpus[1])


def test_user_symbols_and_byte_fallback(corpus):
    tok = SentencePieceTokenizer.train(
        corpus, vocab_size=320, user_defined_symbols=["\\boxed{"], byte_fallback=True
    )
    ids = tok.encode("\\boxed{12}")
    assert tok.id_to_token(ids[0]) == "\\boxed{"
    unseen = "x²"  # never in the corpus: falls back to bytes, still round-trips
    assert tok.unk_id not in tok.encode(unseen)
    assert tok.decode(tok.encode(unseen)) == unseen


def test_bad_inputs_raise(tokenizer):
    with pytest.raises(ValueError, match="vocab_size must be an int >= 8"):
        SentencePieceTokenizer.train(["1+2="], vocab_size=4)
    with pytest.raises(ValueError, match="model_type must be one of"):
        SentencePieceTokenizer.train(["1+2="], vocab_size=16, model_type="wordpiece")
    with pytest.raises(ValueError, match="at least one non-empty str"):
        SentencePieceTokenizer.train(["", ""], vocab_size=16)
    with pytest.raises(ValueError, match="texts must hold str, got int"):
        SentencePieceTokenizer.train(["1+2=", 3], vocab_size=16)
    with pytest.raises(ValueError, match="a single str"):
        SentencePieceTokenizer.train("1+2=", vocab_size=16)
    with pytest.raises(ValueError, match="text must be a str"):
        tokenizer.encode(b"1+2")
    with pytest.raises(ValueError, match=r"token id must be in \[0, "):
        tokenizer.decode([tokenizer.vocab_size])
    with pytest.raises(ValueError, match="model_proto must be non-empty bytes"):
        SentencePieceTokenizer(b"")
