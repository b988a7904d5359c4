"""The SentencePiece tokenizer of the arithmetic job in HF form: transformers' AutoTokenizer (in
an HF model directory, where transformers 5 runs every qwen2 tokenizer through Qwen2's pipeline)
and `load_tokenizer` give SentencePiece's ids and text on task text; a conversion that would
differ on a text it is asked to check is refused before anything is written."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from bapo_jax.export.tokenizer_files import (  # noqa: E402
    SPM_FILE,
    check_same_encoding,
    spm_to_tokenizers,
    write_spm_files,
)
from bapo_jax.models import Qwen2Config  # noqa: E402
from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer  # noqa: E402
from bapo_jax.models.tokenizer import load_tokenizer  # noqa: E402
from bapo_jax.tasks import arithmetic as A  # noqa: E402

CONFIGS = {
    "rewrite": A.ArithmeticConfig(
        min_ops=1, max_ops=4, max_operand=99, operators=("+", "-", "*"), max_mul_operand=9
    ),
    "steps": A.ArithmeticConfig(min_ops=1, max_ops=3, max_operand=9, scratchpad="steps"),
}


def _texts(config: A.ArithmeticConfig, split: str, n: int, seed: int) -> list[str]:
    return A.tokenizer_corpus(A.generate_problems(config, split, n, seed=seed))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, tmp_path_factory):
    """(SentencePiece tokenizer, held-out texts, an HF model directory with its export)."""
    config = CONFIGS[request.param]
    tokenizer = SentencePieceTokenizer.train(_texts(config, "sft", 300, 0), vocab_size=48)
    held_out = _texts(config, "eval", 200, 1)
    directory = tmp_path_factory.mktemp(request.param)
    arch = Qwen2Config.preset("tiny").replace(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    (directory / "config.json").write_text(json.dumps(arch.to_hf_dict()))
    names = write_spm_files(tokenizer, directory, model_max_length=256, check_texts=held_out)
    assert names == ("tokenizer.json", "tokenizer_config.json", SPM_FILE)
    return tokenizer, held_out, directory


def test_auto_tokenizer_gives_sentencepiece_ids_and_text(exported):
    tokenizer, held_out, directory = exported
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    assert (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id, auto.unk_token_id) == (
        tokenizer.eos_id,
        tokenizer.pad_id,
        tokenizer.bos_id,
        tokenizer.unk_id,
    )
    assert len(auto) == tokenizer.vocab_size  # no token added on load
    for text in held_out:
        ids = tokenizer.encode(text)
        assert auto.encode(text) == ids, text  # adds nothing around the text
        assert auto(text)["input_ids"] == ids
        assert auto.decode(ids) == text
    framed = [*tokenizer.encode("3+4=", add_bos=True, add_eos=True), tokenizer.pad_id]
    assert auto.decode(framed) == tokenizer.decode(framed) == "<s>3+4=</s><pad>"
    assert auto.decode(framed, skip_special_tokens=True) == "3+4="


def test_load_tokenizer_reads_the_export(exported):
    tokenizer, held_out, directory = exported
    ours = load_tokenizer(directory)
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (
        tokenizer.eos_id,
        tokenizer.pad_id,
        tokenizer.bos_id,
    )
    assert ours.encode_batch(held_out) == [tokenizer.encode(t) for t in held_out]
    ids = [*tokenizer.encode(held_out[0]), tokenizer.eos_id]
    assert ours.decode(ids, skip_special_tokens=True) == held_out[0]
    assert SentencePieceTokenizer.load(directory / SPM_FILE).model_proto == tokenizer.model_proto


def test_a_text_the_conversion_changes_is_refused_before_writing(tmp_path):
    tokenizer = SentencePieceTokenizer.train(_texts(CONFIGS["steps"], "sft", 100, 0), vocab_size=32)
    backend = spm_to_tokenizers(tokenizer)
    assert check_same_encoding(tokenizer, backend, ["1+2=3", "9-8=1"]) == 2
    # "é" is no piece: SentencePiece gives <unk>, byte-level BPE has no unk (drops it).
    with pytest.raises(ValueError, match="the HF tokenizer encodes '1\\+é=' to"):
        write_spm_files(tokenizer, tmp_path / "out", check_texts=["1+2=3", "1+é="])
    assert not (tmp_path / "out").exists()


def test_unsupported_sentencepiece_models_are_refused():
    texts = _texts(CONFIGS["steps"], "sft", 100, 0)
    unigram = SentencePieceTokenizer.train(texts, vocab_size=32, model_type="unigram")
    with pytest.raises(ValueError, match=r"model_type 1 \(want bpe or char\)"):
        spm_to_tokenizers(unigram)
