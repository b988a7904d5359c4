"""The embedded JAX sampler: cached decoding equals the full forward, behaviour log-probs equal
teacher-forced log-probs (across cache segments, on a sharded model too), greedy equals
transformers' `generate`, seeds are deterministic, shapes decide compilation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bapo_jax.kernels import panel_matmul
from bapo_jax.models import decode, init_model, load_pretrained
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.models.forward import grow_cache
from bapo_jax.models.logprobs import model_token_logprobs
from bapo_jax.rollout import embedded
from bapo_jax.rollout import sampling as sampling_lib
from bapo_jax.rollout.cpu_kernels import PackedMatrix, PanelKernels
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.sharding import mesh as mesh_lib
from tests.models.hf_fixtures import TinySpec, make_hf_checkpoint

PROMPTS = [[5, 17, 42, 7, 99], [3, 8], [250, 251, 252, 253, 254, 255, 256, 1, 9]]
EOS = 2
# jax.monitoring's event for each program XLA builds (or reads from the compilation cache), with
# the jitted function's name: how a test sees a recompile through public API.
_PROGRAM_BUILT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def model():
    return init_model(Qwen2Config.preset("tiny"), seed=3)


def left_pad(prompts, pad=0):
    width = max(map(len, prompts))
    ids = np.full((len(prompts), width), pad, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("layout", [1, 3, "packed"])
def test_prefill_and_decode_equal_the_full_forward(model, layout):
    """Column blocks (XLA dots) and the CPU kernel's panels (`PackedMatrix`) alike."""
    if layout == "packed" and not panel_matmul.available():
        pytest.skip("the CPU decode kernel cannot be built here (no C++ compiler)")
    ids, mask = left_pad(PROMPTS)
    continuation = jnp.asarray([[11, 12, 13], [21, 22, 23], [31, 32, 33]], jnp.int32)
    full_ids = jnp.concatenate([ids, continuation], axis=1)
    full_mask = jnp.concatenate([mask, jnp.ones_like(continuation)], axis=1)
    expected = model(full_ids, attention_mask=full_mask)  # [B, P + 3, V]

    p = ids.shape[1]
    if layout == "packed":
        weights = decode.decode_weights(model, PanelKernels())
        assert isinstance(weights.layers[0]["gate_up"], PackedMatrix)
    else:
        weights = decode.decode_weights(model, decode.ColumnBlocks(layout))
        chex.assert_equal(len(weights.layers[0]["gate_up"]), layout)
    prefill = jax.jit(decode.prefill, static_argnums=3)  # compiled: faster than op by op
    decode_step = jax.jit(decode.decode_step)
    logits, positions, cache = prefill(weights, ids, mask, p + 1)
    chex.assert_trees_all_close(logits, expected[:, p - 1], atol=1e-5)
    for i in range(3):
        if i == 1:  # the cache is full: continue on a longer one
            cache = grow_cache(cache, p + 3)
            h = model.config.head_dim
            chex.assert_shape(cache.k, [(3, 2, h, p + 3)] * 2)  # keys [B, K, H, S]
            chex.assert_shape(cache.v, [(3, 2, p + 3, h)] * 2)  # values [B, K, S, H]
        logits, cache = decode_step(weights, continuation[:, i], positions + i, cache)
        chex.assert_trees_all_close(logits, expected[:, p + i], atol=1e-5)
    with pytest.raises(ValueError, match="grow_cache slots=2 is fewer than the cache's"):
        grow_cache(cache, 2)
    with pytest.raises(ValueError, match=r"ColumnBlocks\.blocks must be an int >= 1, got 0"):
        decode.ColumnBlocks(0)
    bf16 = init_model(model.config, ModelOptions(compute_dtype=jnp.bfloat16), seed=3)
    with pytest.raises(ValueError, match=r"PanelKernels need fp32 weights .*, got bfloat16"):
        decode.decode_weights(bf16, PanelKernels())


def _assert_teacher_forced(model, rollout, prompts, temperature):
    """Every sample's behaviour log-probs equal the full forward's log-probs of its tokens."""
    for sample in rollout.samples:
        prompt = prompts[sample.prompt_index]
        seq = jnp.asarray([list(prompt) + list(sample.token_ids)], jnp.int32)
        targets = jnp.roll(seq, -1, axis=1)
        logp, _ = model_token_logprobs(model, seq, None, targets, temperature=temperature)
        teacher = np.asarray(logp[0, len(prompt) - 1 : -1])
        np.testing.assert_allclose(sample.logprobs, teacher, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_behaviour_logprobs_equal_teacher_forced(model, temperature):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    sampling = SamplingParams(max_tokens=12, temperature=temperature)
    rollout = engine.generate(PROMPTS, n=2, sampling=sampling, seed=0)
    assert len(rollout.samples) == 6
    _assert_teacher_forced(model, rollout, PROMPTS, temperature)
    for sample in rollout.samples:
        assert sample.finish_reason == ("stop" if sample.token_ids[-1] == EOS else "length")
        assert EOS not in sample.token_ids[:-1]
        assert (sample.versions == 0).all()


def test_bf16_decode_accumulates_in_fp32_and_matches_the_bf16_forward():
    """bf16 compute: each block dot sums in fp32 and rounds once (a bf16 sum over I = 512 terms
    would be off by ~sqrt(512) bf16 ulps); sampled log-probs stay within bf16 rounding of the
    bf16 model's teacher-forced ones (measured 1.8e-3 on this model)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 512)), jnp.bfloat16)
    blocks = tuple(jnp.asarray(rng.standard_normal((512, 96)), jnp.bfloat16) for _ in range(2))
    out = decode.ColumnBlocks(2).linear(x, blocks)
    assert out.dtype == jnp.bfloat16
    exact = np.asarray(x, np.float64) @ np.concatenate(
        [np.asarray(b, np.float64) for b in blocks], 1
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=2.0**-8, atol=1e-6)

    model = init_model(Qwen2Config.preset("tiny"), ModelOptions(compute_dtype=jnp.bfloat16), seed=3)
    rollout = EmbeddedEngine(model, eos_token_ids=[EOS]).generate(
        PROMPTS, n=2, sampling=SamplingParams(max_tokens=12, temperature=1.0), seed=0
    )
    for sample in rollout.samples:
        prompt = PROMPTS[sample.prompt_index]
        seq = jnp.asarray([list(prompt) + list(sample.token_ids)], jnp.int32)
        logp, _ = model_token_logprobs(model, seq, None, jnp.roll(seq, -1, axis=1))
        np.testing.assert_allclose(sample.logprobs, logp[0, len(prompt) - 1 : -1], atol=5e-3)


def test_same_seed_same_samples_and_version_tag(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS], version=4)
    sampling = SamplingParams(max_tokens=10, temperature=1.0)
    a = engine.generate(PROMPTS, n=3, sampling=sampling, seed=7)
    b = engine.generate(PROMPTS, n=3, sampling=sampling, seed=7)
    c = engine.generate(PROMPTS, n=3, sampling=sampling, seed=8)
    ids = lambda r: [tuple(s.token_ids) for s in r.samples]
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert all((s.versions == 4).all() for s in a.samples)


def test_top_k_one_is_greedy_with_zero_logprob(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    top1 = engine.generate(PROMPTS, 1, SamplingParams(max_tokens=6, temperature=1.0, top_k=1), 0)
    greedy = engine.generate(
        PROMPTS, 1, SamplingParams(max_tokens=6, temperature=1.0), 0, greedy=True
    )
    for s, g in zip(top1.samples, greedy.samples, strict=True):
        np.testing.assert_array_equal(s.token_ids, g.token_ids)
        np.testing.assert_allclose(s.logprobs, 0.0, atol=1e-6)  # processed: one token kept


def test_greedy_equals_transformers_generate(tmp_path):
    hf = make_hf_checkpoint(tmp_path, TinySpec(tied=True), seed=1)
    model = load_pretrained(tmp_path)
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    rollout = engine.generate(
        PROMPTS, 1, SamplingParams(max_tokens=8, temperature=1.0), 0, greedy=True
    )
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
            attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )
    for r, sample in enumerate(rollout.samples):
        expected = out[r, ids.shape[1] :].tolist()
        if EOS in expected:
            expected = expected[: expected.index(EOS) + 1]
        assert sample.token_ids.tolist() == expected


def test_unsupported_sampling_fields_are_refused(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    with pytest.raises(ValueError, match=r"repetition_penalty=1\.1 is not supported"):
        engine.generate(
            PROMPTS, 1, SamplingParams(max_tokens=4, temperature=1.0, repetition_penalty=1.1), 0
        )
    with pytest.raises(ValueError, match="version must be an int >= 0, got -1"):
        engine.update_weights(-1, nnx.state(model))


def test_update_weights_switches_policy(model):
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    other = init_model(Qwen2Config.preset("tiny"), seed=11)
    sampling = SamplingParams(max_tokens=6, temperature=1.0)
    before = engine.generate(PROMPTS, 1, sampling, 0, greedy=True)
    params = nnx.state(other)
    handle = engine.begin_update(1, params, step=3)
    jax.tree.map(lambda x: x.delete(), params)  # as the next train step donates them
    between = engine.generate(PROMPTS, 1, sampling, 0, greedy=True)
    assert engine.policy_version == 0  # begin_update switches nothing
    assert [s.token_ids.tolist() for s in between.samples] == [
        s.token_ids.tolist() for s in before.samples
    ]
    timings = engine.finish_update(handle)
    assert timings["server_version"] == 1 and timings["attempts"] == 1
    after = engine.generate(PROMPTS, 1, sampling, 0, greedy=True)
    assert engine.policy_version == 1 and all((s.versions == 1).all() for s in after.samples)
    assert [s.token_ids.tolist() for s in before.samples] != [
        s.token_ids.tolist() for s in after.samples
    ]


def test_segment_bounds_double_then_grow_linearly():
    assert embedded.segment_bounds(1) == (32,)
    assert embedded.segment_bounds(32) == (32,)
    assert embedded.segment_bounds(33) == (32, 64)
    assert embedded.segment_bounds(1100) == (32, 64, 128, 256, 512, 1024, 1536)


def test_long_samples_cross_cache_segments(model):
    """70 tokens span three segments (bounds 32, 64, 128): the cache grows twice."""
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    sampling = SamplingParams(max_tokens=70, temperature=1.0, ignore_eos=True)
    rollout = engine.generate(PROMPTS[:2], n=1, sampling=sampling, seed=5)
    assert [len(s.token_ids) for s in rollout.samples] == [70, 70]
    assert all(s.finish_reason == "length" for s in rollout.samples)
    _assert_teacher_forced(model, rollout, PROMPTS, 1.0)


def test_budgets_rows_and_sampling_values_reuse_compiled_programs(model):
    """Programs depend on shapes and filter switches only: max_tokens within a segment, the row
    count within a multiple of 8, temperature, seed and stop ids never recompile."""
    engine = EmbeddedEngine(model, eos_token_ids=[EOS])
    engine.generate(PROMPTS, 1, SamplingParams(max_tokens=40, temperature=1.0), seed=0)
    built: list[str] = []  # the function name of every program built from here on

    def on_event(event: str, seconds: float, **kwargs) -> None:
        if event == _PROGRAM_BUILT:
            built.append(str(kwargs.get("fun_name")))

    def probe(x):
        return x * 3

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        jax.jit(probe)(jnp.arange(5))  # a new function: the listener sees it built, by name
        assert any("probe" in name for name in built), built
        for n, sampling in [
            (2, SamplingParams(max_tokens=50, temperature=0.7)),
            (1, SamplingParams(max_tokens=3, temperature=1.3, stop_token_ids=(7, 9))),
            (2, SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)),
        ]:
            rollout = engine.generate(PROMPTS, n, sampling, seed=n)
            assert all(len(s.token_ids) <= sampling.max_tokens for s in rollout.samples)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    segments = [name for name in built if "_first_segment" in name or "_next_segment" in name]
    assert segments == [], built


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_sharded_model_samples_like_the_unsharded_one(tmp_path):
    """Params split over a (fsdp=4, tensor=2) mesh: same greedy tokens and log-probs."""
    make_hf_checkpoint(tmp_path, TinySpec(), seed=2)  # random biases and norms
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_preset("cpu-fsdp4-tp2"), jax.devices()[:8])
    sharded = load_pretrained(tmp_path, mesh=mesh)
    assert len(sharded.layers.q_proj.get_value().sharding.device_set) == 8
    plain = load_pretrained(tmp_path)
    sampling = SamplingParams(max_tokens=10, temperature=0.8)
    out = {}
    for name, m in (("sharded", sharded), ("plain", plain)):
        engine = EmbeddedEngine(m, eos_token_ids=[EOS])
        out[name] = engine.generate(PROMPTS, 2, sampling, seed=3)
        # XLA dots on the mesh; the CPU kernel (where it builds) on one device
        packed = name == "plain" and panel_matmul.available()
        assert isinstance(engine.decode_weights.unembed, PackedMatrix) == packed
    for a, b in zip(out["sharded"].samples, out["plain"].samples, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    _assert_teacher_forced(plain, out["sharded"], PROMPTS, 0.8)


def test_cpu_kernels_off_decodes_with_xla_ops_and_samples_alike(tmp_path):
    """cpu_kernels=False: no packed panels, and the same tokens (log-probs within float
    rounding) as the default, which uses the kernels where they build."""
    make_hf_checkpoint(tmp_path, TinySpec(), seed=4)
    sampling = SamplingParams(max_tokens=12, temperature=0.9)
    out = {}
    for kernels in (True, False):
        engine = EmbeddedEngine(load_pretrained(tmp_path), eos_token_ids=[EOS], cpu_kernels=kernels)
        out[kernels] = engine.generate(PROMPTS, 2, sampling, seed=5)
        packed = kernels and panel_matmul.available()
        assert isinstance(engine.decode_weights.unembed, PackedMatrix) == packed
    for a, b in zip(out[True].samples, out[False].samples, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_row_argmax_equals_jnp_argmax():
    """The two-reduction argmax: the first maximum, -inf rows included."""
    logits = jax.random.normal(jax.random.key(0), (6, 300)) * 3.0
    logits = logits.at[1, 7].set(logits[1].max() + 1.0).at[1, 9].set(logits[1].max() + 1.0)
    logits = logits.at[2].set(-jnp.inf)
    np.testing.assert_array_equal(sampling_lib.row_argmax(logits), jnp.argmax(logits, axis=-1))


def test_inverse_cdf_hand_computed_cases():
    """p = (0.1, 0, 0.2, 0.7): cumulative 0.1, 0.1, 0.3, 1.0; the zero-probability token is never
    drawn, whatever u. Across blocks: mass 1/4, 1/2, 1/4 at entries 5, 130 and 299 of 300 (three
    blocks of 128, the last one partial), every other entry -inf."""
    small = jnp.log(jnp.array([0.1, 0.0, 0.2, 0.7], jnp.float32))
    u = jnp.array([0.0, 0.05, 0.1001, 0.29, 0.31, 1.0 - 2.0**-24], jnp.float32)
    tokens, log_total = sampling_lib.inverse_cdf(jnp.broadcast_to(small, (6, 4)), u)
    np.testing.assert_array_equal(tokens, [0, 0, 2, 2, 3, 3])
    np.testing.assert_allclose(log_total, 0.0, atol=1e-6)  # the probabilities sum to 1

    wide = (
        jnp.full((300,), -jnp.inf).at[jnp.array([5, 130, 299])].set(jnp.log(jnp.array([1, 2, 1.0])))
    )
    u = jnp.array([0.0, 0.2499, 0.2501, 0.7499, 0.7501, 1.0 - 2.0**-24], jnp.float32)
    tokens, log_total = sampling_lib.inverse_cdf(jnp.broadcast_to(wide, (6, 300)), u)
    np.testing.assert_array_equal(tokens, [5, 5, 130, 130, 299, 299])
    np.testing.assert_allclose(log_total, np.log(4.0), atol=1e-6)


def test_inverse_cdf_splits_a_uniform_grid_by_probability():
    """u on a fine grid: each token takes a run of the grid as long as its probability (exact up
    to one grid step at each end), for 1000 entries over 8 blocks with some -inf."""
    z = jax.random.normal(jax.random.key(1), (1000,)) * 2.0
    z = z.at[::7].set(-jnp.inf)
    n = 20_000
    u = (jnp.arange(n, dtype=jnp.float32) + 0.5) / n
    tokens, log_total = sampling_lib.inverse_cdf(jnp.broadcast_to(z, (n, 1000)), u)
    p = np.exp(np.asarray(z, np.float64) - float(jnp.max(z)))
    p /= p.sum()  # float64 softmax, the reference
    counts = np.bincount(np.asarray(tokens), minlength=1000)
    np.testing.assert_array_less(np.abs(counts - p * n), 2.0)  # one grid step at each end
    assert counts[::7].sum() == 0
    assert np.all(np.diff(np.asarray(tokens)) >= 0)  # the grid is sorted, so are the draws
    np.testing.assert_allclose(log_total[0], jax.nn.logsumexp(z), atol=1e-5)


def test_sample_tokens_is_deterministic_per_key_and_reports_the_processed_logprob():
    logits = jax.random.normal(jax.random.key(0), (6, 300)) * 3.0
    choice = sampling_lib.SamplingArrays.from_params(SamplingParams(max_tokens=1, temperature=0.7))
    draws = []
    for seed in range(5):
        key = jax.random.key(seed)
        tokens, logp = sampling_lib.sample_tokens(logits, key, choice)
        np.testing.assert_array_equal(sampling_lib.sample_tokens(logits, key, choice)[0], tokens)
        chex.assert_trees_all_close(
            logp, jax.nn.log_softmax(logits / 0.7)[jnp.arange(6), tokens], atol=1e-5
        )
        draws.append(np.asarray(tokens))
    assert len({tuple(d) for d in draws}) == 5  # different keys, different draws
