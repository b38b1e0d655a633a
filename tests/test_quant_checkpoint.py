"""int8 inference (quant/), stored and run: the int8 checkpoint (round trip, older formats,
sharded loading), generation with a quantised model, the int8 KV cache, and bad input.

References: the float model's greedy tokens (trained tiny model), the float KV cache, and the
checkpoint's own saved tree (bit for bit).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from model import DecoderLM
from model.cached_attention import CACHE_BLOCK
from model.flops import param_bytes
from model.generate import default_per_layer, generate
from parallel.mesh import make_mesh
from quant import checkpoint as qckpt
from quant import native_int8
from quant import quantizers as qz
from quant.calibrate import calibrate
from quant.convert import QuantConfig, QuantError, apply_plan, make_plan
from quant.dense import use_native
from quant.kv_cache import init_int8_cache
from quant.pipeline import quantize
from quant.rotation import rotate_kernel
from tests.helpers import TINY, run_steps, synthetic_batches
from tests.quant_models import CFG, calibration_batches, logits, tiny_float_model


@pytest.fixture(scope="module")
def float_model():
    return tiny_float_model()


@pytest.fixture(scope="module")
def batches():
    return calibration_batches()


# --- checkpoint, sharding, generation ---------------------------------------------------------

def save_plan(path, q, plan, qcfg_json, fmt=qckpt.FORMAT, model=None):
    qckpt.save(path, q, {"format": fmt, "quant_config": qcfg_json, "plan": plan,
                         "model": model or dataclasses.asdict(CFG), "source_step": 0})


def assert_identical(tree_a, tree_b):
    for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_round_trip_loads_sharded(tmp_path, float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8-static", rules=("blocks/*", "head", "embed"))
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    mesh = make_mesh(8)
    g2, q2, meta2 = qckpt.load(tmp_path / "q", CFG, mesh, sharded=True)
    assert meta2["plan"] == plan
    assert_identical(q, q2)
    kernel = q2["blocks"]["attn"]["q"]["kernel_q"]
    # Stored [layers, out, in]: q's input (embed) and down's output (embed) over fsdp.
    assert kernel.dtype == jnp.int8 and kernel.sharding.spec == P(None, None, "fsdp")
    assert q2["blocks"]["mlp"]["down"]["kernel_q"].sharding.spec == P(None, "fsdp", None)
    # The int8 values are identical; the sharded program sums floats (norms, attention) in
    # another order, which may flip one activation's int8 rounding and move that token's row by
    # a quantisation step (seen on one host). So: nearly every token row identical, and the whole
    # far closer to the single-device int8 model than int8 is to float.
    tokens = batches[-1][:, :-1]
    sharded, single = (np.asarray(logits(*m, tokens)) for m in ((g2, q2), (g, q)))
    assert np.mean(np.all(np.isclose(sharded, single, rtol=1e-5, atol=1e-5), -1)) >= 0.95
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel(sharded, single) < 0.2 * rel(single, np.asarray(logits(graphdef, params, tokens)))
    float_disk = qckpt.save_float_reference(tmp_path / "f", params)
    # tiny model: scales and Orbax's metadata (tens of KB, which vary from run to run) weigh
    # against the 4x of the values alone; the medium shape reaches > 3.5x (quant_disk_medium)
    assert float_disk / qckpt.disk_bytes(tmp_path / "q" / "ckpt") > 1.8


@pytest.mark.parametrize("mode,extra", [("w8a8-outlier", {}), ("auto", {"error_budget": 0.006}),
                                        ("w8a8-rotated", {"rotation_seed": 7})])
def test_checkpoint_round_trip_keeps_capacity_kept_layers_and_rotation(tmp_path, float_model,
                                                                       batches, mode, extra):
    graphdef, params = float_model
    qcfg = QuantConfig(mode=mode, **extra)
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    g2, q2, meta = qckpt.load(tmp_path / "q", CFG)
    assert meta["plan"] == plan and QuantConfig.from_json(meta["quant_config"]) == qcfg
    assert_identical(q, q2)
    down = nnx.merge(g2, q2).blocks.mlp.down
    assert down.rotate == (mode == "w8a8-rotated")
    if mode == "auto":
        assert any(e["float_layers"] for e in plan.values())
    elif mode == "w8a8-outlier":
        assert down.outlier_capacity == -(-CFG.d_ff // 16)
    else:  # the stored kernel is the rotated one, Rᵀ W, and the model reads it back as such
        assert plan["blocks/mlp/down"]["rotation_seed"] == 7 and down.rotation_seed == 7
        rw = rotate_kernel(params["blocks"]["mlp"]["down"]["kernel"], 7)
        np.testing.assert_array_equal(q2["blocks"]["mlp"]["down"]["kernel_q"],
                                      jnp.swapaxes(qz.quantize(rw, qz.weight_scale(rw)), 1, 2))
    tokens = batches[-1][:, :-1]
    np.testing.assert_allclose(logits(g2, q2, tokens), logits(g, q, tokens), rtol=1e-6)


def test_format_1_checkpoint_loads_uncapped_and_unknown_fields_are_refused(tmp_path,
                                                                           float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8-outlier")
    _, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    drop = lambda d: {k: v for k, v in d.items() if k not in ("outlier_capacity", "rotate")}
    save_plan(tmp_path / "v1", kernels_in_out(q), {p: drop(e) for p, e in plan.items()},
              drop(qcfg.to_json()), fmt="shardq-int8/1")
    g1, q1, _ = qckpt.load(tmp_path / "v1", CFG)
    down = nnx.merge(g1, q1).blocks.mlp.down
    assert down.outlier_capacity == CFG.d_ff and not down.rotate  # as written
    save_plan(tmp_path / "new", q, plan, {**qcfg.to_json(), "group_size": 128})
    with pytest.raises(QuantError, match="quant_config: unknown field.*group_size"):
        qckpt.load(tmp_path / "new", CFG)


def kernels_in_out(q: dict) -> dict:
    """The int8 parameters as formats /1 to /3 stored them: QuantDense kernels [.., in, out]."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: np.swapaxes(a, -1, -2) if path[-1].key == "kernel_q" else a, q)


def test_a_format_3_checkpoint_is_transposed_onto_the_stored_layout(tmp_path, float_model,
                                                                    batches):
    """Files written before int8 kernels were stored [out, in] hold them [in, out]: read onto
    8 devices in the zero3 layout, they come back as the new layout's parameters bit for bit,
    sharded as a new file would be, and compute the same logits. Such a file's model config
    also predates the `attention` field (it counts as its default, "xla") and may name another
    remat policy (how the model is computed, not what)."""
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8", rules=("blocks/*", "embed"))
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    old = kernels_in_out(q)
    assert old["blocks"]["attn"]["q"]["kernel_q"].shape[1:] == (CFG.d_model, CFG.d_model) and \
        old["blocks"]["mlp"]["up"]["kernel_q"].shape[1:] == (CFG.d_model, CFG.d_ff)
    written = {k: v for k, v in dataclasses.asdict(CFG).items() if k != "attention"}
    save_plan(tmp_path / "v3", old, plan, qcfg.to_json(), fmt="shardq-int8/3",
              model={**written, "remat": "full"})
    save_plan(tmp_path / "v4", q, plan, qcfg.to_json())
    mesh = make_mesh(8)
    _, q3, meta3 = qckpt.load(tmp_path / "v3", CFG, mesh, sharded=True)
    _, q4, _ = qckpt.load(tmp_path / "v4", CFG, mesh, sharded=True)
    assert meta3["format"] == "shardq-int8/3"
    assert_identical(q3, q)
    assert jax.tree.map(lambda a: a.sharding, q3) == jax.tree.map(lambda a: a.sharding, q4)
    tokens = batches[-1][:, :-1]
    np.testing.assert_array_equal(logits(g, jax.device_get(q3), tokens), logits(g, q, tokens))


def test_a_format_5_checkpoint_keeps_its_float32_block_scales(tmp_path, float_model, batches):
    """/5 stored an int8 table's block scales in float32 and its plan named no `scale_dtype`:
    such a file loads with float32 scales, and a model whose float16 scales hold the same values
    computes the same logits from it."""
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8a8")
    g, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    assert q["embed"]["block_scale"].dtype == jnp.float16
    old_q = {**q, "embed": {**q["embed"],
                            "block_scale": q["embed"]["block_scale"].astype(jnp.float32)}}
    old_plan = {p: {k: v for k, v in e.items() if k != "scale_dtype"} for p, e in plan.items()}
    save_plan(tmp_path / "v5", old_q, old_plan, qcfg.to_json(), fmt="shardq-int8/5")
    g5, q5, _ = qckpt.load(tmp_path / "v5", CFG)
    assert_identical(q5, old_q)
    tokens = batches[-1][:, :-1]
    np.testing.assert_array_equal(logits(g5, q5, tokens), logits(g, q, tokens))


def test_checkpoint_for_another_model_is_refused(tmp_path, float_model, batches):
    graphdef, params = float_model
    qcfg = QuantConfig(mode="w8")
    _, q, plan, _ = quantize(graphdef, params, qcfg, batches[:1])
    save_plan(tmp_path / "q", q, plan, qcfg.to_json())
    other = dataclasses.replace(CFG, d_ff=64, remat="save_dots")
    with pytest.raises(QuantError, match=rf"written for a different model \(d_ff: {CFG.d_ff} in "
                                         rf"the file, 64 here\); quantise this run again$"):
        qckpt.load(tmp_path / "q", other)
    assert qckpt.model_differences({**dataclasses.asdict(CFG), "n_experts": 4}, CFG) == \
        ["n_experts: 4 in the file, no such field here"]
    with pytest.raises(QuantError, match="no quantised checkpoint"):
        qckpt.load(tmp_path / "missing", CFG)


@pytest.fixture(scope="module")
def trained_model():
    """The tiny model after 100 AdamW steps on the synthetic sequences: confident enough that
    greedy decoding is not decided by rounding noise. (An untrained model's near-flat logits
    are: int8 and float greedy tokens agreed on 79% of positions there, 84% after 30 steps, and
    a token that flips early changes the rest of its row.)"""
    train = dataclasses.replace(TINY.train, steps=100)
    _, params = run_steps("dp", 1, synthetic_batches(100, 1, 16, CFG.max_len, seed=2),
                          train=train)
    return nnx.graphdef(nnx.eval_shape(lambda: DecoderLM(CFG, rngs=nnx.Rngs(0)))), params


def test_generation_with_a_quantized_model(trained_model, batches):
    graphdef, params = trained_model
    g, q, _, _ = quantize(graphdef, params, QuantConfig(mode="w8a8"), batches[:1])
    prompt = jnp.asarray(np.concatenate([batches[0][:, :8], batches[1][:, :8]]))  # 8 rows
    gen = jax.jit(generate, static_argnums=(0, 3))
    out = gen(g, q, prompt, 16, jax.random.key(0))
    ref = gen(graphdef, params, prompt, 16, jax.random.key(0))
    assert out.shape == (8, 24)
    np.testing.assert_array_equal(out[:, :8], prompt)
    agree = float(jnp.mean(out[:, 8:] == ref[:, 8:]))
    # Measured: all 128 greedy tokens agreed (the float model's smallest top-2 probability gap
    # there is 0.008). 0.85 leaves room for one row that diverges early on another host's
    # rounding, not for a broken int8 path.
    assert agree >= 0.85
    # int8 kernels go per layer where shardq's kernel runs their products, and keep the layer
    # scan where XLA's do; both layouts write the same tokens.
    assert default_per_layer(nnx.merge(graphdef, params))
    assert default_per_layer(nnx.merge(g, q)) == native_int8.status()["available"]
    assert not default_per_layer(use_native(nnx.merge(g, q), False))
    other = not default_per_layer(nnx.merge(g, q))
    layout = jax.jit(functools.partial(generate, per_layer=other), static_argnums=(0, 3))
    np.testing.assert_array_equal(layout(g, q, prompt, 16, jax.random.key(0)), out)


# --- bad input -------------------------------------------------------------------------------

def test_non_finite_weights_are_refused(float_model, batches):
    graphdef, params = float_model
    bad = jax.tree.map(np.array, params)
    bad["blocks"]["mlp"]["up"]["kernel"][0, 0, 0] = np.nan
    with pytest.raises(QuantError, match="non-finite"):
        quantize(graphdef, bad, QuantConfig(mode="w8a8"), batches[:1])


def test_non_finite_calibration_activations_are_refused(float_model, batches):
    graphdef, params = float_model
    bad = jax.tree.map(np.array, params)
    bad["blocks"]["attn_norm"]["scale"][0, 0] = np.inf  # finite tokens, non-finite activations
    with pytest.raises(QuantError, match="calibration"):
        calibrate(graphdef, bad, batches[:1])


def test_unsupported_mode_rules_and_dtype_are_refused(float_model):
    graphdef, params = float_model
    model = nnx.merge(graphdef, params)
    with pytest.raises(QuantError, match="mode='w4'"):
        make_plan(QuantConfig(mode="w4"), model)
    with pytest.raises(QuantError, match="select no module"):
        make_plan(QuantConfig(rules=("nothing/*",)), model)
    plan = make_plan(QuantConfig(rules=("head",)), model)
    model.head.kernel.set_value(model.head.kernel[...].astype(jnp.int32))
    with pytest.raises(QuantError, match="dtype int32"):
        apply_plan(model, plan, QuantConfig())


def test_int8_kv_cache_decodes_like_the_float_cache():
    cfg = TINY.model
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 12)), jnp.int32)
    full = model(tokens)
    cache = init_int8_cache(cfg, 2, 12)
    logits, cache = model.decode(tokens[:, :7], cache, 0)
    steps = [logits]
    for i in range(7, 12):
        step_logits, cache = model.decode(tokens[:, i:i + 1], cache, i)
        steps.append(step_logits)
    assert cache.k.dtype == jnp.int8 and cache.k_scale.dtype == jnp.float32
    # int8 keys/values (per token and head) perturb logits by well under the logits' spread.
    err = float(jnp.max(jnp.abs(jnp.concatenate(steps, axis=1) - full)))
    assert 0 < err < 0.05 * float(jnp.std(full))
    head_dim = cfg.head_dim
    assert param_bytes(cache) == param_bytes(model.init_cache(2, 12, jnp.float32)) * \
        (1 + 4 / head_dim) / 4
    out = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0),
                   make_cache=init_int8_cache)
    ref = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0))
    assert out.shape == ref.shape == (2, 12)
    assert float(jnp.mean(out == ref)) > 0.9  # greedy decoding barely changes


def test_int8_kv_cache_decoding_does_not_depend_on_the_cache_length():
    """The int8 cache is read a block at a time like the float one: past a block boundary
    (prefill up to 8 positions before it, steps to 12 past it), a longer cache gives
    bit-identical logits."""
    cfg = dataclasses.replace(TINY.model, max_len=3 * CACHE_BLOCK)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    n, start = CACHE_BLOCK + 12, CACHE_BLOCK - 8
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, (1, n)), jnp.int32)
    step = jax.jit(lambda t, c, i: model.decode(t, c, i))
    runs = []
    for length in (n, 3 * CACHE_BLOCK):
        logits, cache = step(tokens[:, :start], init_int8_cache(cfg, 1, length), 0)
        out = [logits]
        for i in range(start, n):
            logits, cache = step(tokens[:, i:i + 1], cache, i)
            out.append(logits)
        runs.append(np.asarray(jnp.concatenate(out, axis=1)))
    assert cache.length == 3 * CACHE_BLOCK and cache.k.dtype == jnp.int8
    np.testing.assert_array_equal(runs[1], runs[0])


def test_results_record_workdirs_relative_to_the_project_root(tmp_path):
    """quant_table stores its --workdir through project_relative: a committed results file must
    not hold the absolute paths of the machine that wrote it."""
    import json

    from experiments.reporting.results_io import PROJECT_ROOT, RESULTS_DIR, project_relative

    assert project_relative(PROJECT_ROOT / "runs" / "main") == "runs/main"
    outside = project_relative(tmp_path / "run")
    assert not outside.startswith("/") and (PROJECT_ROOT / outside).resolve() == \
        (tmp_path / "run").resolve()
    for f in sorted(RESULTS_DIR.glob("*.json")):
        workdir = json.loads(f.read_text()).get("workdir")
        assert workdir is None or not workdir.startswith("/"), f.name
