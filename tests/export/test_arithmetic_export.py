"""The CPU main job's run directory exports to HF: a toy-size job (warm start + one RL
iteration through `build_trainer`, as `experiments.cpu_arithmetic` runs it) is exported, and
transformers loads the export with logits equal to the checkpointed params' and a tokenizer
that gives the job's SentencePiece ids."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bapo_jax.export import export_run, load_run_policy  # noqa: E402
from bapo_jax.overrides import apply_overrides  # noqa: E402
from bapo_jax.tasks.arithmetic_job import (  # noqa: E402
    ModelShape,
    TaskConfig,
    WarmStartConfig,
    prepare,
    run_rl,
)
from experiments.cpu_arithmetic import RUN  # noqa: E402

pytestmark = pytest.mark.slow  # long: in `make test-slow` (CI runs it)


def test_the_main_jobs_run_exports_to_transformers(tmp_path):
    task = TaskConfig(n_basic=60, n_target_sft=8, n_eval=8, vocab_size=40)
    shape = ModelShape(layers=1, hidden=64, heads=1, kv_heads=1)  # head_dim 64, as the job's
    warm = WarmStartConfig(steps=2, batch_size=8, length=32, warmup_steps=1)
    run_dir = tmp_path / "run"
    prepared = prepare(task, shape, warm, 4, str(run_dir / "warm_start"), eval_max_tokens=8)
    config = apply_overrides(
        RUN,
        [
            "trainer.steps=1",
            "trainer.eval_every=0",
            "trainer.rollout.prompts_per_step=2",
            "trainer.rollout.samples_per_prompt=2",
            "trainer.rollout.max_response_tokens=8",
            "trainer.algorithm.mini_batches=1",
            "trainer.checkpoint.every=1",
            "trainer.checkpoint.async_save=false",
            "trainer.logging.plots=false",
            "trainer.logging.progress=false",
            "trainer.logging.logprob_agreement=false",
        ],
    )
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, hf_dir=prepared.hf_dir)
    )
    run_rl(prepared, config, str(run_dir))

    out = tmp_path / "export"
    result = export_run(run_dir, out)
    assert result.step == 1 and result.path == str(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    spm = prepared.task.tokenizer
    for text in ("3+4-2=", "12-7+5=10", "3+4-2=7-2=5.\\boxed{5}"):
        assert hf_tokenizer.encode(text) == spm.encode(text), text
    ids = [spm.bos_id, *spm.encode("3+4-2=7-2=5.")]
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits.numpy()  # [1, T, V]
    policy = load_run_policy(run_dir)
    assert policy.step == 1
    logits = np.asarray(policy.model(jnp.asarray([ids])), np.float32)  # [1, T, V]
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
