"""`benchmarks.model_blocks` times the same computation on both sides: for every block, the JAX
and the PyTorch callables give the same output and input gradient from the same weights."""

import numpy as np
import pytest

from bapo_jax.models import Qwen2Config
from benchmarks.model_blocks import blocks, main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = Qwen2Config.preset("tiny-tied")  # the blocks use the tied head


@pytest.mark.parametrize("seq", [48, 256])  # one causal block; two (the benchmark's rows)
def test_each_block_computes_the_same_on_both_sides(seq):
    pairs = blocks(TINY, batch=2, seq=seq)
    assert [p.name for p in pairs] == [
        "attention core",
        "MLP",
        "decoder layer",
        "layer stack",
        "head + loss",
        "AdamW",
    ]
    for pair in pairs:
        got = [np.asarray(x) for x in pair.jax()[:2]]
        want = [x.detach().numpy() for x in pair.torch()[:2]]
        assert len(got) == len(want), pair.name
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape, (pair.name, g.shape, w.shape)
            scale = float(np.abs(w).max())
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-4 * scale, err_msg=pair.name)


def test_bad_sizes_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--seq", "0"])
    assert "--seq must be >= 1, got 0" in capsys.readouterr().err
