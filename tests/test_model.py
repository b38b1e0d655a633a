"""The decoder LM against references: formula, full forward, its own un-jitted/un-remat twin."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import MODEL_PRESETS, DecoderLM, ModelConfig, param_count, train_flops_per_token
from model.cached_attention import CACHE_BLOCK
from model.flops import matmul_params
from model.generate import decode_steps, generate, stream
from model.kv_cache import KVCache
from model.loss import nll_sum
from parallel.state import abstract_model
from tests.helpers import TINY, with_model


def _model(cfg=None, seed=0):
    return DecoderLM(cfg or TINY.model, rngs=nnx.Rngs(seed))


def test_shapes_and_exact_param_count():
    m = _model()
    tokens = jnp.zeros((3, 16), jnp.int32)
    assert m(tokens).shape == (3, 16, 256)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert n == param_count(TINY.model) == 41120


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_every_preset_counts_exactly_without_allocating(name):
    cfg = MODEL_PRESETS[name]
    _, _, abstract = abstract_model(cfg)  # eval_shape: shapes only, even for 1T parameters
    assert sum(x.size for x in jax.tree.leaves(abstract)) == param_count(cfg)


@pytest.mark.parametrize("name,target", [("1.3b", 1.3e9), ("7.5b", 7.5e9), ("7.5b-gqa", 7.5e9),
                                         ("128b", 128e9),
                                         ("1t", 1e12)])
def test_large_presets_match_zero_paper_sizes(name, target):
    assert abs(param_count(MODEL_PRESETS[name]) / target - 1) < 0.01


def test_small_and_tiny_sizes():
    assert param_count(MODEL_PRESETS["tiny"]) < 1_000_000
    assert 15e6 < param_count(MODEL_PRESETS["medium"]) < 25e6


def test_flops_formula_counts_matmuls():
    cfg = TINY.model
    # 6 FLOPs per matmul parameter per token plus causal attention.
    assert train_flops_per_token(cfg) == 6 * matmul_params(cfg) + 6 * cfg.n_layers * \
        cfg.max_len * cfg.d_model
    assert matmul_params(cfg) == param_count(cfg) - cfg.vocab_size * cfg.d_model - \
        (2 * cfg.n_layers + 1) * cfg.d_model


def test_causality():
    m = _model()
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 20)).astype(np.int32)
    b = a.copy()
    b[:, 12:] = rng.integers(0, 256, (2, 8))
    la, lb = m(jnp.asarray(a)), m(jnp.asarray(b))
    np.testing.assert_allclose(la[:, :12], lb[:, :12], atol=1e-6)
    assert np.abs(np.asarray(la[:, 12:] - lb[:, 12:])).max() > 1e-3


def _loss_and_grad(cfg, tokens, jit=True):
    graphdef, params = nnx.split(_model(cfg))
    params = nnx.to_pure_dict(params)

    def loss(p):
        return nll_sum(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].size

    f = jax.value_and_grad(loss)
    return (jax.jit(f) if jit else f)(params)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_and_jit_do_not_change_loss_or_grads(remat):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 17)), jnp.int32)
    ref_loss, ref_grad = _loss_and_grad(TINY.model, tokens, jit=False)
    loss, grad = _loss_and_grad(with_model(remat=remat), tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-6)


def test_scan_unroll_does_not_change_loss():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 17)), jnp.int32)
    a, _ = _loss_and_grad(TINY.model, tokens)
    b, _ = _loss_and_grad(with_model(scan_unroll=2), tokens)
    np.testing.assert_allclose(a, b, rtol=1e-6)


def _assert_cached_decoding_matches_full_forward(m, tokens, cache, layers=None):
    """A 7-token prefill, then one token at a time through `cache`: the full forward's logits
    (`layers`: the per-layer layout, `DecoderLM.unstack_layers`)."""
    full = m(tokens)
    logits, cache = m.decode(tokens[:, :7], cache, 0, layers)
    steps = [logits]
    for i in range(7, tokens.shape[1]):
        step_logits, cache = m.decode(tokens[:, i:i + 1], cache, i, layers)
        steps.append(step_logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_kv_cache_decoding_matches_full_forward():
    m = _model()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 12)), jnp.int32)
    _assert_cached_decoding_matches_full_forward(m, tokens, m.init_cache(2, 12))


def test_llama_options_count_exactly_and_decode_with_a_gqa_cache():
    # GQA (2 kv heads for 4 query heads), SwiGLU and a tied head: the SmolLM2 family, tiny.
    cfg = dataclasses.replace(TINY.model, n_heads=4, n_kv_heads=2, mlp="swiglu",
                              tie_embeddings=True)
    m = DecoderLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    assert "head" not in params and set(params["blocks"]["mlp"]) == {"gate", "up", "down"}
    assert params["blocks"]["attn"]["k"]["kernel"].shape == (2, 32, 2 * cfg.head_dim)
    assert sum(x.size for x in jax.tree.leaves(params)) == param_count(cfg)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 12)), jnp.int32)
    cache = m.init_cache(2, 12)
    # The cache holds kv heads only, in whole blocks of positions.
    assert cache.v.shape == (2, 2 * 2, CACHE_BLOCK, cfg.head_dim)  # [layers, B * K, S, H]
    assert cache.k.shape == (2, 2 * 2, cfg.head_dim, CACHE_BLOCK)  # keys transposed
    _assert_cached_decoding_matches_full_forward(m, tokens, cache)


def test_per_layer_decoding_matches_and_never_slices_weights_per_step():
    """The per-layer layout gives the full forward's logits and the layer scan's tokens, and its
    compiled step holds no dynamic-slice of a weight (the scan's step slices, i.e. copies, every
    layer's kernels out of the stack at every token)."""
    cfg = dataclasses.replace(TINY.model, n_heads=4, n_kv_heads=2, mlp="swiglu",
                              tie_embeddings=True)
    m = DecoderLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 256, (2, 12)), jnp.int32)
    layers = m.unstack_layers()
    _assert_cached_decoding_matches_full_forward(m, tokens, m.unstack_cache(m.init_cache(2, 12)),
                                                 layers)
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(state)
    a = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0), per_layer=True)
    b = generate(graphdef, params, tokens[:, :4], 8, jax.random.key(0), per_layer=False)
    np.testing.assert_array_equal(a, b)
    kernel = f"f32[1,{cfg.d_model},{cfg.d_ff}]"

    def step_hlo(layers, cache):
        fn = jax.jit(lambda p, ls, c: nnx.merge(graphdef, p).decode(tokens[:, :1], c, 5, ls))
        return fn.lower(params, layers, cache).compile().as_text()

    sliced = lambda hlo: [ln for ln in hlo.splitlines() if f"= {kernel}" in ln
                          and "dynamic-slice(" in ln]
    assert sliced(step_hlo(None, m.init_cache(2, 12)))  # the scan layout does slice
    assert not sliced(step_hlo(layers, m.unstack_cache(m.init_cache(2, 12))))


def test_stream_yields_what_generate_writes():
    """The chat path (the prompt's call, then loops of a growing number of tokens, each queued
    before the last one's tokens are read) writes the tokens `generate` writes, greedy and
    sampled, over several loops and at a budget that ends inside one, and stops after a stop
    token."""
    from model.generate import STREAM_FIRST_CHUNK

    m = _model()
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(state)
    prompt = jnp.asarray([[5, 6, 7]], jnp.int32)
    budget = m.cfg.max_len - 3
    assert budget > 1 + 3 * STREAM_FIRST_CHUNK  # three loops, the last one cut short
    for temperature in (0.0, 1.0):
        want = np.asarray(generate(graphdef, params, prompt, budget, jax.random.key(3),
                                   temperature=temperature))[0, 3:].tolist()
        assert list(stream(graphdef, params, prompt, budget, jax.random.key(3),
                           temperature=temperature)) == want
    stop = want[STREAM_FIRST_CHUNK + 3]  # in the second loop
    assert list(stream(graphdef, params, prompt, budget, jax.random.key(3), temperature=1.0,
                       stop_ids=(stop,))) == want[:want.index(stop) + 1]


def test_the_chat_paths_loops_stop_at_a_stop_token_and_write_the_cache_in_place():
    """A loop of the chat path ends after a stop token (the count it returns), and a loop
    queued after it runs no step; the prompt's call and the loops take the cache donated
    (written in place, not copied whole into a new one), not the weights."""
    from model.generate import _stream_programs

    m = _model()
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(state)
    cache = m.init_cache(1, 16)
    leaves, weights = jax.tree.flatten((params, None))
    first, chunk = _stream_programs(graphdef, weights, 1.0, 0)
    prompt = jnp.asarray([[5, 6, 7]], jnp.int32)
    token, after_prompt, key = first(leaves, prompt, cache, jax.random.key(3))
    assert token.shape == (1, 1)
    assert all(x.is_deleted() for x in jax.tree.leaves(cache))
    none = jnp.asarray([-1], jnp.int32)
    hlo = chunk.lower(leaves, token, after_prompt, 3, 6, key, none, False).compile().as_text()
    assert "input_output_alias" in hlo  # the loop's cache is the donated buffer
    out, n, *_ = chunk(leaves, token, after_prompt, 3, 6, key, none, False)
    assert int(n) == 6
    assert all(x.is_deleted() for x in jax.tree.leaves(after_prompt))
    wrote = np.asarray(out)[0, :6].tolist()
    assert len(set(wrote)) == 6  # sampled: the stop token below comes once
    token, after_prompt, key = first(leaves, prompt, m.init_cache(1, 16), jax.random.key(3))
    stops = jnp.asarray([wrote[2], 10_000], jnp.int32)
    out, n, last, after, key, stopped = chunk(leaves, token, after_prompt, 3, 6, key, stops,
                                              False)
    assert int(n) == 3 and bool(stopped) and np.asarray(out)[0, :3].tolist() == wrote[:3]
    _, n, *_ = chunk(leaves, last, after, 6, 6, key, stops, stopped)
    assert int(n) == 0
    assert not any(x.is_deleted() for x in leaves)


def _gqa_model(max_len: int) -> DecoderLM:
    cfg = dataclasses.replace(TINY.model, n_heads=4, n_kv_heads=2, mlp="swiglu",
                              tie_embeddings=True, max_len=max_len)
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


# An instruction of a compiled program: its name, output dims and opcode.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = f32\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(")


def _moves(hlo: str, size: int) -> list[str]:
    """The copies and transposes (plain, or fusions named for them) of an array of `size`
    elements in the body of a compiled program's loop (what runs at every step)."""
    body = re.search(r"body=%([\w.-]+)", hlo).group(1)
    start = re.search(rf"^%{re.escape(body)} ", hlo, re.MULTILINE).start()
    found = []
    for line in hlo[start:hlo.index("\n}\n", start)].splitlines():
        m = _INSTRUCTION.match(line)
        if m and math.prod(int(d) for d in m.group(2).split(",") if d) == size and (
                m.group(3) in ("copy", "transpose") or re.search("copy|transpose", m.group(1))):
            found.append(line.strip())
    return found


def test_a_decoding_step_neither_transposes_nor_copies_the_cache():
    """The cache is stored in the layouts attention's two products read (model/kv_cache.py):
    the compiled token loop moves none of a layer's keys or values (stored as the projections
    write them, every step transposed each layer's keys and values, and copied the fresh cache);
    the check catches keys stored as written, read by the scores' product."""
    m = _gqa_model(max_len=64)
    graphdef, state = nnx.split(m)
    params = nnx.to_pure_dict(state)
    layers, cache = m.unstack_layers(), m.unstack_cache(m.init_cache(1, 64))
    first = jnp.asarray([3], jnp.int32)
    steps = jax.jit(lambda p, ls, c: decode_steps(nnx.merge(graphdef, p), first, c, ls, 5, 4,
                                                  jax.random.key(0)))
    size = cache[0].k.size
    assert cache[0].v.size == size
    assert not _moves(steps.lower(params, layers, cache).compile().as_text(), size)
    K, H, S = m.cfg.kv_heads, m.cfg.head_dim, cache[0].length

    def keys_as_written(k_1xSxKxH):  # the control: keys stored [B, S, K, H], scores as before
        q = jnp.ones((1, K, 2, 1, H), jnp.float32)

        def step(i, carry):
            k, acc = carry
            k = jax.lax.dynamic_update_slice_in_dim(k, jnp.full((1, 1, K, H), 1.0 * i), i, 1)
            return k, acc + jnp.einsum("bkgth,bckh->bkgtc", q, k)

        return jax.lax.fori_loop(0, 3, step, (k_1xSxKxH, jnp.zeros((1, K, 2, 1, S))))

    control = jax.jit(keys_as_written).lower(jnp.zeros((1, S, K, H))).compile()
    assert _moves(control.as_text(), size)


def test_decoding_does_not_depend_on_the_cache_length():
    """The same tokens give bit-identical logits whatever the cache's size, across a block
    boundary (prefill up to 6 positions before it, then steps past it), and match the full
    forward; so a larger token budget only extends a greedy reply."""
    m = _gqa_model(max_len=4 * CACHE_BLOCK)
    n, start = CACHE_BLOCK + 6, CACHE_BLOCK - 6
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, n)), jnp.int32)
    step = jax.jit(lambda t, c, i: m.decode(t, c, i))

    def decoded(length, start, n):
        logits, cache = step(tokens[:, :start], m.init_cache(2, length), 0)
        out = [logits]
        for i in range(start, n):
            logits, cache = step(tokens[:, i:i + 1], cache, i)
            out.append(logits)
        return np.asarray(jnp.concatenate(out, axis=1))

    runs = [decoded(length, start, n) for length in (n, 4 * CACHE_BLOCK)]  # 2 and 4 blocks
    np.testing.assert_allclose(runs[0], m(tokens), atol=1e-5)
    np.testing.assert_array_equal(runs[1], runs[0])
    # A one-block cache runs no block loop; a two-block one does, for the same positions.
    np.testing.assert_array_equal(decoded(CACHE_BLOCK, 30, 40), decoded(2 * CACHE_BLOCK, 30, 40))
    graphdef, params = nnx.split(m)
    prompt = tokens[:1, :CACHE_BLOCK - 8]
    short = generate(graphdef, params, prompt, 12, jax.random.key(0))
    long = generate(graphdef, params, prompt, CACHE_BLOCK + 20, jax.random.key(0))
    np.testing.assert_array_equal(long[:, :short.shape[1]], short)


def test_cache_is_allocated_in_whole_blocks_and_attention_refuses_a_ragged_one():
    m = _gqa_model(max_len=4 * CACHE_BLOCK)
    assert m.init_cache(1, 1).length == CACHE_BLOCK
    assert m.init_cache(1, CACHE_BLOCK + 1).length == 2 * CACHE_BLOCK
    assert m.init_cache(1).length == 4 * CACHE_BLOCK  # the context, already whole blocks
    with pytest.raises(ValueError, match="cache length=0: must be a positive integer"):
        m.init_cache(1, 0)
    cache = m.init_cache(1, 1)
    ragged = KVCache(cache.k[..., :100], cache.v[..., :100, :], cache.kv_heads)
    assert isinstance(ragged, KVCache)
    with pytest.raises(ValueError, match=f"cache length=100: must be a multiple of {CACHE_BLOCK}"):
        m.decode(jnp.zeros((1, 1), jnp.int32), ragged, 0)


def test_bf16_compute_keeps_fp32_params_and_is_close():
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 17)), jnp.int32)
    ref, _ = _loss_and_grad(TINY.model, tokens)
    bf, grads = _loss_and_grad(with_model(compute_dtype="bfloat16"), tokens)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert abs(float(bf) - float(ref)) < 0.05


def test_every_parameter_has_logical_axes_and_no_mesh_axis():
    _, axes, abstract = abstract_model(TINY.model)
    names = {"vocab", "embed", "mlp", "heads", "kv_heads", "layers"}
    for spec, leaf in zip(jax.tree.leaves(axes), jax.tree.leaves(abstract), strict=True):
        assert len(spec) == leaf.ndim
        assert set(spec) <= names


@pytest.mark.parametrize("field,value,match", [
    ("n_heads", 3, "n_heads=3: must divide d_model"),
    ("d_model", 0, "d_model=0"),
    ("remat", "some", "remat='some'"),
    ("compute_dtype", "float16", "compute_dtype='float16'"),
    ("n_kv_heads", 3, "n_kv_heads=3: must be a positive divisor of n_heads=4"),
    ("mlp", "relu", "mlp='relu'"),
    ("attention", "flash", "attention='flash': allowed xla, cudnn"),
    ("attention", "cudnn", "attention='cudnn': needs compute_dtype='bfloat16'"),
])
def test_bad_model_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(ModelConfig(), **{field: value}).validate()


@pytest.mark.parametrize("d_model,n_heads", [(96, 8), (1024, 2)])  # head dims 12 and 512
def test_fused_attention_head_dim_limits_are_named(d_model, n_heads):
    cfg = ModelConfig(d_model=d_model, n_heads=n_heads, attention="cudnn",
                      compute_dtype="bfloat16")
    with pytest.raises(ValueError, match=rf"^attention='cudnn': needs a head dimension "
                                         rf"\(d_model/n_heads\) that is a multiple of 8 and at "
                                         rf"most 256, got {d_model // n_heads}$"):
        cfg.validate()
    dataclasses.replace(cfg, attention="xla").validate()  # XLA's attention takes any


def test_fused_attention_is_refused_in_one_line_off_a_gpu():
    # The cuDNN kernel exists on NVIDIA GPUs only (experiments.bench_gpu checks it against XLA's
    # attention there); elsewhere the model says so instead of failing inside the kernel.
    if jax.default_backend() == "gpu":
        pytest.skip("checks the behaviour off a GPU")
    cfg = dataclasses.replace(TINY.model, attention="cudnn", compute_dtype="bfloat16")
    cfg.validate()
    graphdef, _, abstract = abstract_model(cfg)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    model = nnx.merge(graphdef, params)
    with pytest.raises(ValueError, match=r"^attention='cudnn': needs an NVIDIA GPU, the JAX "
                                         r"backend is 'cpu' \(use attention='xla'\)"):
        model(jnp.zeros((1, 8), jnp.int32))


# Every pair of values of dtype, head layout and query block appears in some case (6 cases
# instead of the 12 of the full product, each a compile of its own).
@pytest.mark.parametrize("dtype,tol,heads,kv_heads,block", [
    ("float32", 1e-5, 3, 3, None), ("float32", 1e-5, 6, 2, 20), ("float32", 1e-5, 3, 3, 48),
    ("bfloat16", 2e-2, 6, 2, None), ("bfloat16", 2e-2, 3, 3, 20), ("bfloat16", 2e-2, 6, 2, 48)])
def test_attention_gradients_match_jax_reference_attention(dtype, tol, heads, kv_heads, block):
    """causal_attention's written-out backward (model/layers.py) against autodiff through
    jax.nn.dot_product_attention, an independent implementation, on random inputs and a random
    cotangent: outputs and all three gradients, also under jit and remat; multi-head and
    grouped-query (three query heads per key/value head, whose dK and dV sum over the group);
    query blocks of the default size (16 positions at 48), of 20 (the last block shorter), and
    one block for the whole sequence."""
    from functools import partial

    from model.layers import causal_attention
    causal_attention = partial(causal_attention, block=block)

    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (2, 48, heads, 16)).astype(dtype)
    k, v = (jax.random.normal(key, (2, 48, kv_heads, 16)).astype(dtype) for key in keys[1:3])
    weights = jax.random.normal(keys[3], (2, 48, heads, 16))

    def loss(attention):
        return lambda *qkv: (attention(*qkv).astype(jnp.float32) * weights).sum()

    reference = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    for attention in (causal_attention, jax.checkpoint(causal_attention)):
        got = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k, v)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype == jnp.dtype(dtype)
            scale = float(jnp.abs(w.astype(jnp.float32)).max())
            assert float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()) \
                <= tol * scale
    out = causal_attention(q, k, v).astype(jnp.float32)
    assert float(jnp.abs(out - reference(q, k, v).astype(jnp.float32)).max()) <= tol


def test_attention_blocks_follow_the_sequence_length():
    """The default query block is the power of two nearest sqrt(8 T) with at most 8 blocks per
    sequence, and a block size that is not a positive number of positions is refused in one
    line."""
    from model.layers import attention_block, causal_attention

    lengths = (1, 48, 128, 512, 2048, 8192)
    assert [attention_block(t) for t in lengths] == [4, 16, 32, 64, 256, 1024]
    x = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"^block: must be a positive number of positions, "
                                         r"got 0$"):
        causal_attention(x, x, x, block=0)
