"""Run checkpoints exported to HF: transformers loads the export and its logits equal the Flax
model's of the same checkpoint (fp32); the step, dtype, generation ids and tokenizer files; the
run directory read from config.json or from its model/ record; named errors."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bapo_jax.export import (  # noqa: E402
    RunDirError,
    export_run,
    load_run_policy,
    read_run,
    record_policy,
)
from bapo_jax.export.__main__ import main  # noqa: E402
from bapo_jax.models import Qwen2Config, load_pretrained  # noqa: E402
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer  # noqa: E402
from bapo_jax.run.config import ModelSection  # noqa: E402

from .run_fixtures import make_run  # noqa: E402

ARCH = Qwen2Config.preset("tiny-hd64")  # tied, head_dim 64, q/k/v biases
TOL = 1e-4


@pytest.fixture(scope="module")
def math_run(tmp_path_factory):
    """A math run of the preset with the shipped tokenizer: checkpoints at steps 2 and 5."""
    run_dir = tmp_path_factory.mktemp("runs") / "math"
    saved = make_run(run_dir, ARCH, ModelSection(preset="tiny-hd64"), [(2, 0), (5, 1)])
    return run_dir, saved


@pytest.fixture(scope="module")
def fp32_export(math_run, tmp_path_factory):
    run_dir, _ = math_run
    out = tmp_path_factory.mktemp("exports") / "fp32"
    return export_run(run_dir, out, dtype="fp32")


def test_transformers_logits_equal_the_checkpoint_models(math_run, fp32_export):
    run_dir, _ = math_run
    policy = load_run_policy(run_dir)  # latest step, fp32
    assert policy.step == fp32_export.step == 5
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        fp32_export.path, dtype=torch.float32
    ).eval()
    ids = np.random.default_rng(0).integers(0, ARCH.vocab_size, (2, 11)).astype(np.int64)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(policy.model(jnp.asarray(ids, jnp.int32)))
    assert ours.shape == ref.shape == (2, 11, ARCH.vocab_size)
    assert float(np.max(np.abs(ours - ref))) <= TOL


def test_export_files_generation_ids_and_tokenizer(math_run, fp32_export):
    out = fp32_export.path
    names = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    assert {"vocab.json", "merges.txt", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert not [n for n in names if n.startswith(".")]  # no temp leftovers
    assert fp32_export.tokenizer_from == str(SHIPPED_TOKENIZER_DIR)
    assert fp32_export.architecture_from == "preset 'tiny-hd64'"
    assert Qwen2Config.from_hf(out) == ARCH
    with open(os.path.join(out, "generation_config.json")) as f:
        generation = json.load(f)
    tokenizer = load_tokenizer()
    # What the trainer stops at: the config's eos (2) and the tokenizer's (<|im_end|>).
    assert generation["eos_token_id"] == [ARCH.eos_token_id, tokenizer.eos_id]
    assert generation["pad_token_id"] == tokenizer.pad_id
    auto = transformers.AutoTokenizer.from_pretrained(out)
    text = "Find $x$ if $2x+3=7$."
    assert auto.encode(text) == tokenizer.encode(text)


def test_step_and_dtype_choice(math_run, tmp_path):
    run_dir, saved = math_run
    result = main(["--run", str(run_dir), "--step", "2", "--out", str(tmp_path / "bf16")])
    assert result["step"] == 2 and result["dtype"] == "float32"  # the checkpoint's by default
    model = load_pretrained(tmp_path / "bf16")
    np.testing.assert_array_equal(
        np.asarray(model.embed_tokens.get_value()), saved[2]["embed_tokens"]
    )
    main(["--run", str(run_dir), "--out", str(tmp_path / "bf16"), "--dtype", "bf16", "--overwrite"])
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="numpy") as f:
        assert str(f.get_slice("model.norm.weight").get_dtype()) == "BF16"
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"


def test_model_record_wins_over_the_run_config(math_run, tmp_path):
    """A dry run's config.json names the real model; its model/ record the stand-in trained."""
    run_dir, _ = math_run
    other = tmp_path / "dry"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"trainer": {}, "model": {"hf_dir": "/models/Qwen2.5-Math-7B"}})
    )
    with pytest.raises(
        RunDirError, match=r"model.hf_dir '/models/Qwen2\.5-Math-7B' does not exist"
    ):
        read_run(other)
    record_policy(other, ARCH)
    os.symlink(run_dir / "checkpoints", other / "checkpoints")
    run = read_run(other)
    assert run.architecture == ARCH and run.steps == (2, 5)
    assert run.tokenizer_dir == str(other / "model")
    assert run.architecture_from == str(other / "model" / "config.json")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_config", r"--run '.*empty': no config.json \(the run's RunConfig\)"),
        ("no_checkpoint", r"--run '.*': no complete checkpoint in '.*checkpoints'"),
        ("bad_step", r"--step 3: no complete checkpoint for that step .* complete steps: \[2, 5\]"),
        ("out_taken", r"--out '.*taken' exists and is not empty; choose another, or --overwrite"),
        ("out_is_run", r"--out '.*math' would overwrite the run directory"),
        ("hf_dir_as_run", r"config.json is not a RunConfig \(an HF model directory\?"),
    ],
)
def test_errors_name_the_flag(case, message, math_run, fp32_export, tmp_path):
    run_dir, _ = math_run
    argv = ["--run", str(run_dir), "--out", str(tmp_path / "out")]
    if case == "no_config":
        (tmp_path / "empty").mkdir()
        argv[1] = str(tmp_path / "empty")
    elif case == "no_checkpoint":
        make_run(tmp_path / "fresh", ARCH, ModelSection(preset="tiny-hd64"), [])
        argv[1] = str(tmp_path / "fresh")
    elif case == "bad_step":
        argv += ["--step", "3"]
    elif case == "out_taken":
        (tmp_path / "taken").mkdir()
        (tmp_path / "taken" / "x").write_text("x")
        argv[3] = str(tmp_path / "taken")
    elif case == "out_is_run":
        argv[3] = str(run_dir)
        argv.append("--overwrite")
    elif case == "hf_dir_as_run":
        argv[1] = fp32_export.path
    with pytest.raises(RunDirError, match=message):
        main(argv)
    assert not (tmp_path / "out").exists()


def test_a_lora_run_exports_merged_weights_and_its_peft_adapter(tmp_path):
    """A run whose params hold adapters (model.lora_rank): the export's weights are the merged
    W + s A B, and lora_adapter/ reads back (PEFT's format) as the checkpoint's adapters."""
    import jax
    from flax import nnx
    from safetensors.numpy import load_file

    from bapo_jax.models import ModelOptions, abstract_model, iter_hf_tensors
    from bapo_jax.models import lora as lora_lib
    from bapo_jax.models.config import LoRAConfig
    from bapo_jax.run.config import RunConfig, dump
    from bapo_jax.train import state as state_lib
    from bapo_jax.train.checkpoint import RunCheckpointer
    from bapo_jax.train.state import init_train_state

    from .run_fixtures import ADAMW

    lora = LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "down_proj"))
    arch = Qwen2Config.preset("tiny-hd64")
    run_dir = tmp_path / "run"
    options = ModelOptions(lora=lora)
    _, state = init_train_state(arch, ADAMW, options=options, seed=1)
    rng = np.random.default_rng(2)  # non-zero B: the merge shows in the weights
    trainable, frozen = state_lib.split_trainable(state.params)
    values = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), trainable)
    state.params = state_lib.merge_trainable(values, frozen)
    model_section = ModelSection(
        preset="tiny-hd64", lora_rank=2, lora_alpha=4.0, lora_targets=lora.targets
    )
    os.makedirs(run_dir)
    dump(RunConfig(model=model_section), os.path.join(run_dir, "config.json"))
    with RunCheckpointer(os.path.join(run_dir, "checkpoints"), async_save=False) as ckpt:
        ckpt.save(3, state, {"iteration": 3}, {})
    out = export_run(run_dir, tmp_path / "export")
    assert out.step == 3
    graphdef = nnx.graphdef(abstract_model(arch, options))
    model = nnx.merge(graphdef, state.params)
    exported = dict(load_file(str(tmp_path / "export" / "model.safetensors")))
    merged = dict(iter_hf_tensors(model))
    assert exported.keys() == merged.keys()
    for name in exported:
        np.testing.assert_allclose(exported[name], merged[name], rtol=1e-6, atol=1e-6)
    w = np.asarray(model.layers.q_proj.get_value()[0])
    a, b = (np.asarray(x[0]) for x in (values["layers"]["q_proj_lora_a"].get_value(),
                                       values["layers"]["q_proj_lora_b"].get_value()))  # fmt: skip
    want = (w + 2.0 * np.tensordot(a, b, axes=1)).transpose(1, 2, 0).reshape(-1, w.shape[0])
    np.testing.assert_allclose(exported["model.layers.0.self_attn.q_proj.weight"], want, atol=1e-5)
    back_lora, back = lora_lib.load_peft(tmp_path / "export" / "lora_adapter", arch)
    assert back_lora == lora
    for name, array in back.items():
        np.testing.assert_array_equal(array, values["layers"][name].get_value())
