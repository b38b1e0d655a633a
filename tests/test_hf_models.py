"""Hugging Face decoders (llama, mistral, qwen2, qwen3, gemma3_text) read by
model/hf_decoder.py against transformers itself: tests/fixtures/hf/<arch>/ holds tiny models
made and scored by experiments/reference/make_hf_fixtures.py (transformers 5, float32)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from experiments.cli.config import ConfigError
from experiments.pretrained import loading
from model import DecoderLM, param_count
from model.chat_template import ChatTemplateError
from model.generate import generate
from model.hf_decoder import HFError, expected_shapes, iter_params, load_hf, read_config
from model.hf_export import with_bos_first
from model.hf_tokenizer import HFTokenizer, HFTokenizerError
from model.llama_export import ExportError, family
from model.rope import llama3_freqs, rope_freqs
from parallel.sharded_run import run_label
from quant.modes import QuantConfig
from quant.pipeline import quantize
from quant.smoothquant import fold

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "phi3_partial",
         "phi3_longrope")
TOLERANCE = 1e-4  # nats, mean NLL against transformers


def reference(arch: str) -> list[dict]:
    return json.loads((FIXTURES / arch / "reference.json").read_text())["results"]


def model_of(cfg, params):
    graphdef = nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))))[0]
    return graphdef, nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


PAD = 128  # every text is right-padded to this (causal: padding changes nothing before it)


@functools.lru_cache(maxsize=32)
def _logprobs(graphdef):
    return jax.jit(lambda state, tokens: jax.nn.log_softmax(
        nnx.merge(graphdef, state)(tokens)[0], axis=-1))


def scores(model, ids: list[int]) -> tuple[float | None, int]:
    """(mean NLL over positions 1..n-1, argmax after the text), as experiments.score: one
    compiled forward per model."""
    graphdef, state = nnx.split(model)
    tokens = np.zeros((1, PAD), np.int32)
    tokens[0, :len(ids)] = ids
    logp = np.asarray(_logprobs(graphdef)(state, tokens), np.float64)[:len(ids)]
    nxt = int(np.argmax(logp[-1]))
    if len(ids) < 2:
        return None, nxt
    picked = logp[np.arange(len(ids) - 1), ids[1:]]
    return float(np.mean(-picked)), nxt


def worst_error(model, rows: list[dict]) -> tuple[float, int]:
    """(largest |mean NLL - transformers'|, how many next tokens differ) over the texts."""
    worst, wrong = 0.0, 0
    for r in rows:
        nll, nxt = scores(model, r["tokens"])
        if nll is not None:
            worst = max(worst, abs(nll - r["mean_nll"]))
        wrong += nxt != r["next_token"]
    return worst, wrong


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request):
    cfg, params = load_hf(FIXTURES / request.param)
    return request.param, cfg, params


def test_fixtures_cover_each_architecture_field():
    rows = {a: reference(a) for a in ARCHS}
    assert all(len(r) >= 6 for r in rows.values())
    cfgs = {a: load_hf(FIXTURES / a)[0] for a in ARCHS}
    assert cfgs["mistral"].sliding_window is not None
    assert max(len(r["tokens"]) for r in rows["mistral"]) > cfgs["mistral"].sliding_window
    assert max(len(r["tokens"]) for r in rows["phi3"]) > cfgs["phi3"].sliding_window
    assert cfgs["phi3_partial"].rotary_dim == 12 < cfgs["phi3_partial"].head_dim  # 0.75 of 16
    fused = load_file(str(FIXTURES / "phi3" / "model.safetensors"))
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
            } <= fused.keys() and "model.layers.0.self_attn.q_proj.weight" not in fused
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].tie_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim * 4 != cfgs["qwen3"].d_model
    assert not any(dataclasses.asdict(cfgs["llama"])[f] for f in ("qkv_bias", "qk_norm"))
    # Llama 3's scaling keeps some frequencies, blends some and divides the rest
    llama3 = cfgs["llama3"]
    freqs = rope_freqs(llama3.rope_base, llama3.head_dim)
    ratio = llama3_freqs(llama3) / freqs
    assert llama3.rope_scale_factor == 8 and cfgs["llama"].rope_scale_factor == 0
    assert ratio[0] == 1 and ratio[-1] == np.float32(1 / 8)
    assert any(1 / 8 < r < 1 for r in ratio)
    # LongRoPE: texts on both sides of the pretraining context, which is the default context
    longrope = cfgs["phi3_longrope"]
    lengths = [len(r["tokens"]) for r in rows["phi3_longrope"] if r["mean_nll"] is not None]
    assert longrope.max_len == longrope.rope_original_max_len == 24 and longrope.rotary_dim == 12
    assert sum(n <= 24 for n in lengths) >= 3 and sum(n > 24 for n in lengths) >= 3
    assert longrope.rope_attention_factor > 1
    assert all(a < b for a, b in zip(longrope.rope_short_factors[1:],
                                     longrope.rope_long_factors[1:], strict=True))
    gemma = cfgs["gemma3_text"]
    assert set(gemma.layer_pattern) == {"s", "g"} and gemma.rope_local_base != gemma.rope_base
    assert max(len(r["tokens"]) for r in rows["gemma3_text"]) > gemma.sliding_window
    assert gemma.query_pre_attn_scalar != gemma.head_dim and gemma.final_softcap
    assert gemma.post_norms and gemma.norm_plus_one and gemma.embed_scale and gemma.qk_norm


def test_tokenizer_matches_transformers_ids():
    tok = HFTokenizer(FIXTURES / "qwen2")
    for r in reference("qwen2"):
        assert tok.encode(r["text"]) == r["tokens"]
        assert tok.decode(r["tokens"]) == r["text"]
    assert tok.bos == [] and tok.eos_id == tok.token_id("<|im_end|>")
    prompt = tok.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_as_transformers(arch):
    """Each folder's own chat template (ChatML; Llama 3's format; Gemma's, which refuses turns
    that do not alternate) gives transformers' text and ids for each conversation, or its
    refusal as one line. Control: Jinja without transformers' block trimming renders Gemma's
    (indented block tags) as another text."""
    tok = HFTokenizer(FIXTURES / arch)
    rows = json.loads((FIXTURES / arch / "reference.json").read_text())["chat"]
    assert len(rows) == 3
    for row in rows:
        if "refused" in row:
            with pytest.raises(ChatTemplateError, match=re.escape(row["refused"])):
                tok.chat_prompt(row["messages"])
            continue
        text = tok.chat_prompt(row["messages"])
        assert text == row["text"] and tok.encode(text, add_bos=False) == row["ids"]
        untrimmed = jinja2.Environment().from_string(tok.chat_template).render(
            messages=row["messages"], add_generation_prompt=True, bos_token="<|endoftext|>",
            eos_token="<|im_end|>")
        assert (untrimmed != text) == (arch == "gemma3_text")  # the others trim by hand
    assert ("refused" in rows[2]) == (arch == "gemma3_text")


def test_scores_match_transformers(loaded):
    """Every text the model's context holds (LongRoPE's default context, its pretraining one,
    holds the shorter texts: the longer ones are the next test's)."""
    arch, cfg, params = loaded
    _, model = model_of(cfg, params)
    rows = [r for r in reference(arch) if len(r["tokens"]) <= cfg.max_len]
    assert len(rows) >= 4
    worst, wrong = worst_error(model, rows)
    assert worst <= TOLERANCE and wrong == 0, (arch, worst, wrong)


def test_longrope_scores_as_transformers_on_each_side_of_the_original_context():
    """transformers takes LongRoPE's long factors for a sequence longer than the pretraining
    context, its short ones otherwise; we take them by the context the model runs with. The
    model read for a longer context scores the longer texts as transformers does. Controls:
    each factor set on the other side's texts, and the long set without its attention factor,
    miss the reference."""
    short, params = load_hf(FIXTURES / "phi3_longrope")
    long = load_hf(FIXTURES / "phi3_longrope", max_len=256)[0]
    assert long == dataclasses.replace(short, max_len=256)
    rows = [r for r in reference("phi3_longrope") if r["mean_nll"] is not None]
    within = [r for r in rows if len(r["tokens"]) <= short.rope_original_max_len]
    beyond = [r for r in rows if len(r["tokens"]) > short.rope_original_max_len]
    worst, wrong = worst_error(model_of(long, params)[1], beyond)
    assert worst <= TOLERANCE and wrong == 0, (worst, wrong)
    for cfg, texts in ((short, beyond), (long, within),
                       (dataclasses.replace(long, rope_attention_factor=1.0), beyond)):
        assert worst_error(model_of(cfg, params)[1], texts)[0] > 100 * TOLERANCE


# A field switched off: Llama 3's RoPE scaling; Gemma 3's: every layer global, or one layer
# kind's RoPE base for all.
_OFF = {"rope_scale_factor": dict(rope_scale_factor=0.0, rope_low_freq_factor=0.0,
                                  rope_high_freq_factor=0.0, rope_original_max_len=0),
        "layer_pattern": dict(layer_pattern="gggg"),
        "rope_local_base": dict(rope_local_base=1_000_000.0),
        "query_pre_attn_scalar": dict(query_pre_attn_scalar=0.0),
        "embed_scale": dict(embed_scale=False), "final_softcap": dict(final_softcap=0.0),
        "rotary_dim": dict(rotary_dim=None),
        "rope_short_factors": dict(rope_short_factors=None, rope_long_factors=None,
                                   rope_attention_factor=0.0, rope_original_max_len=0)}
_GEMMA_OFF = ("layer_pattern", "rope_local_base", "query_pre_attn_scalar", "embed_scale",
              "final_softcap")


@pytest.mark.parametrize("arch, field", [("qwen2", "qkv_bias"), ("qwen3", "qk_norm"),
                                         ("mistral", "sliding_window"),
                                         ("phi3", "sliding_window"),
                                         ("phi3_partial", "rotary_dim"),
                                         ("phi3_longrope", "rope_short_factors"),
                                         ("llama3", "rope_scale_factor"),
                                         *(("gemma3_text", f) for f in _GEMMA_OFF)])
def test_dropping_a_field_misses_the_reference(arch, field):
    """The control: each architecture field matters to its fixture, so the parity above
    checks it (a reader that ignored biases, q/k norms, the window, Llama 3's RoPE scaling,
    Gemma's per-layer
    windows and RoPE bases, query scale, embedding scale or soft-cap would fail)."""
    cfg, params = load_hf(FIXTURES / arch)
    attn = params["blocks"]["attn"]
    if field == "qkv_bias":
        for p in ("q", "k", "v"):
            attn[p].pop("bias")
    if field == "qk_norm":
        attn.pop("q_norm"), attn.pop("k_norm")
    off = dataclasses.replace(cfg, **_OFF.get(
        field, {field: None if field == "sliding_window" else False}))
    worst, _ = worst_error(model_of(off, params)[1], reference(arch))
    assert worst > 100 * TOLERANCE, (arch, field, worst)


def test_phi3s_fused_tensors_split_in_their_row_order():
    """The control for Phi-3's fused tensors: the parts read in another order (k and v, or gate
    and up, exchanged) miss the reference that the order of their rows matches."""
    cfg, params = load_hf(FIXTURES / "phi3")
    for group, a, b in (("attn", "k", "v"), ("mlp", "gate", "up")):
        swapped = jax.tree.map(lambda x: x, params)
        layer = swapped["blocks"][group]
        layer[a], layer[b] = layer[b], layer[a]
        worst, _ = worst_error(model_of(cfg, swapped)[1], reference("phi3"))
        assert worst > 100 * TOLERANCE, (a, b, worst)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma3_text", "phi3",
                                  "phi3_partial", "phi3_longrope"])
def test_cached_decoding_follows_the_full_forward(arch):
    """Greedy tokens through the KV cache equal the argmax of the full forward at each step,
    the mistral and gemma prompts long enough that the window slides during decoding (on
    gemma's sliding layers only)."""
    cfg, params = load_hf(FIXTURES / arch)
    graphdef, model = model_of(cfg, params)
    prompt = reference(arch)[4]["tokens"][:14]
    steps = 6
    out = generate(graphdef, nnx.state(model), jnp.asarray([prompt], jnp.int32), steps,
                   jax.random.key(0))
    seq = list(prompt)
    for _ in range(steps):
        seq.append(scores(model, seq)[1])
    assert np.asarray(out[0]).tolist() == seq


def test_the_layout_probe_fits_a_short_context(tmp_path):
    """chat's layout probe at a context shorter than its usual prompt and new tokens (`chat
    --context 12`) runs in what fits, not refused."""
    from experiments.pretrained import decoding, loading

    pre = loading.with_context(loading.load(str(FIXTURES / "phi3_longrope")), 12)
    choice = decoding.remembered_layout(pre, tmp_path / "probe.json", "host")
    assert isinstance(choice["per_layer"], bool) and choice["probe_tokens"] == 9


@pytest.mark.parametrize("mode,rules", [("w8a8", ("blocks/*",)), ("smoothquant", ("blocks/*",)),
                                        ("w8a8", ("embed",))])
def test_int8_stays_near_float(mode, rules):
    """The blocks' Dense layers (q/k/v with biases) in int8, and the tied table alone. (Both at
    once compound beyond this bound on the random 64-wide fixture; the table's cost on
    pretrained models is experiments.embed_int8's.)"""
    cfg, params = load_hf(FIXTURES / "qwen2")
    graphdef, model = model_of(cfg, params)
    # calibrated on each text's first 16 tokens: one shape, so each pass compiles once
    rows = [np.asarray([r["tokens"][:16]], np.int32) for r in reference("qwen2") if
            len(r["tokens"]) >= 16]
    qcfg = (QuantConfig(mode=mode, alpha=0.5, calib_batches=len(rows), rules=rules)
            if mode == "smoothquant" else QuantConfig(mode=mode, rules=rules))
    qgraph, qparams, _, _ = quantize(graphdef, params, qcfg, rows, error_report=False)
    qmodel = nnx.merge(qgraph, jax.tree.map(jnp.asarray, qparams))
    for r in reference("qwen2"):
        if len(r["tokens"]) > 1:
            assert abs(scores(qmodel, r["tokens"])[0] - scores(model, r["tokens"])[0]) < 0.5


def test_smoothquant_fold_is_exact_with_biases_and_qk_norm():
    """Folding any factors leaves the float function unchanged (up to rounding) on a model
    with q/k/v biases, one with q/k norms and Gemma 3 ((1 + w) norms, post-norms, GeGLU): v's
    bias is divided with its columns, a (1 + w) scale becomes (1 + w) / s - 1."""
    for arch in ("qwen2", "qwen3", "gemma3_text"):
        cfg, params = load_hf(FIXTURES / arch)
        _, model = model_of(cfg, params)
        ids = reference(arch)[5]["tokens"]
        before = np.asarray(model(jnp.asarray([ids], jnp.int32)))
        rng = np.random.default_rng(0)
        L, d, q = cfg.n_layers, cfg.d_model, cfg.q_dim
        absmax = {p: jnp.asarray(rng.uniform(0.1, 10.0, (L, n)), jnp.float32)
                  for p, n in (("blocks/attn/q", d), ("blocks/attn/o", q),
                               ("blocks/mlp/gate", d), ("blocks/mlp/down", cfg.d_ff))}
        fold(model, absmax, 0.5)
        after = np.asarray(model(jnp.asarray([ids], jnp.int32)))
        np.testing.assert_allclose(after, before, atol=2e-3 * np.abs(before).max())


def test_zero3_training_step_on_eight_devices():
    """A Hugging Face model trains under ZeRO-3 with remat: parameters stacked over `layers`,
    biases, q/k norms and Gemma's per-layer windows and RoPE bases included."""
    for arch in ("qwen2", "qwen3", "gemma3_text"):
        cfg, params = load_hf(FIXTURES / arch, max_len=32)
        cfg = dataclasses.replace(cfg, remat="full")
        batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, 17), np.int32)
        losses, new = run_label("zero3", 8, [batch, batch], cfg, optax.adam(1e-3), seed=0,
                                mesh_spec="fsdp=8", init_params=params)
        assert np.all(np.isfinite(losses)) and losses[1] < losses[0], (arch, losses)
        assert new["blocks"]["attn"]["q"]["kernel"].shape == params["blocks"]["attn"]["q"][
            "kernel"].shape


def test_peak_host_memory_while_loading():
    """At most the float32 model plus 1.5x its largest tensor (numpy's allocations, traced)."""
    folder = FIXTURES / "qwen3"
    cfg = load_hf(folder)[0]
    shapes = expected_shapes(cfg)
    largest = max(int(np.prod(s)) * 4 for s in shapes.values())
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        held = [a for _, a in iter_params(folder, cfg)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    total = sum(a.nbytes for a in held)
    assert peak - base <= total + 1.5 * largest, (peak - base, total, largest)


def bad_folder(tmp_path: Path, arch: str = "llama") -> Path:
    folder = tmp_path / arch
    shutil.copytree(FIXTURES / arch, folder)
    return folder


def test_bad_folders_are_one_line(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        load_hf(tmp_path)
    folder = bad_folder(tmp_path)
    hf = read_config(folder)
    (folder / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))
    with pytest.raises(HFError, match=r"model_type='gpt2' is not supported \(allowed: llama, "):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 3}))
    with pytest.raises(HFError, match="missing tensor for blocks/attn_norm/scale of layer 2"):
        load_hf(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(HFError, match="no model.safetensors and no"):
        load_hf(folder)
    for e in (HFError,):
        assert issubclass(e, ValueError)


def test_phi3_folders_we_cannot_read_are_one_line(tmp_path):
    """A rotary part that is no part of a head or leaves an odd number of dimensions, RoPE on
    part of a head outside Phi-3, RoPE parameters that are no object, a RoPE type other than
    LongRoPE and LongRoPE without its factors, a context or one factor per frequency are
    refused by name; a fused tensor of another size, or a part held twice, names the tensor."""
    llama = bad_folder(tmp_path, "llama")
    hf = read_config(llama)
    (llama / "config.json").write_text(json.dumps({**hf, "partial_rotary_factor": 0.75}))
    with pytest.raises(HFError, match="partial_rotary_factor=0.75 is not supported"):
        load_hf(llama)
    folder = bad_folder(tmp_path, "phi3")
    hf = read_config(folder)
    for change, match in (
            ({"rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": 1.5}},
             r"partial_rotary_factor=1.5: must be a number in \(0, 1\]"),
            ({"rope_parameters": {**hf["rope_parameters"], "partial_rotary_factor": 0.5625}},
             "rotary_dim=9: must be even"),
            ({"rope_parameters": [1e4]}, r"rope_parameters \(or rope_scaling\) must be an "
                                         r"object"),
            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
             r"rope_type='yarn' is not supported \(allowed: 'default', 'longrope', 'su'\)"),
            ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                  "short_factor": [1.0] * 8, "long_factor": "1"}},
             "rope_type='longrope' needs short_factor and long_factor as lists of numbers"),
            ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                  "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
              "original_max_position_embeddings": 0},
             "rope_type='longrope' needs a positive original_max_position_embeddings"),
            ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                  "short_factor": [1.0] * 6, "long_factor": [1.0] * 6}},
             r"rope_short_factors: LongRoPE needs 8 positive finite numbers")):
        (folder / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(HFError, match=match):
            load_hf(folder)
    (folder / "config.json").write_text(json.dumps(hf))
    tensors = load_file(folder / "model.safetensors")
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    for extra, match in (
            ({qkv: tensors[qkv][:-1]}, re.escape(f"tensor {qkv!r} has shape [127, 64], "
                                                 "config.json implies [128, 64]")),
            ({"model.layers.1.self_attn.k_proj.weight": tensors[qkv][64:96]},
             "tensors 'model.layers.1.self_attn.k_proj.weight' and "
             "'model.layers.1.self_attn.qkv_proj.weight' both hold blocks/attn/k/kernel")):
        save_file({**tensors, **extra}, folder / "model.safetensors")
        with pytest.raises(HFError, match=match):
            load_hf(folder)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
def test_export_names_the_family_whose_fields_a_model_uses(arch):
    """Each fixture transformers made is exported as its own model_type (phi3's fields beyond
    Mistral's are RoPE on part of each head and LongRoPE); a GELU MLP, which no exported family
    has, is refused naming the field."""
    cfg = load_hf(FIXTURES / arch)[0]
    assert family(cfg) == arch
    with pytest.raises(ExportError, match="^mlp='gelu': no exported family"):
        family(dataclasses.replace(cfg, mlp="gelu"))
    # RoPE on part of each head, LongRoPE: Phi-3's fields
    assert family(dataclasses.replace(cfg, rotary_dim=4)) == "phi3"
    assert family(load_hf(FIXTURES / "phi3_longrope")[0]) == "phi3"


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])  # phi3: parts of fused tensors
def test_sharded_and_half_precision_folders_read_the_same(tmp_path, arch):
    """model-*.safetensors with model.safetensors.index.json reads as the one file does; a
    bfloat16 / float16 file reads as its values in float32."""
    import ml_dtypes
    source = FIXTURES / arch
    cfg, want = load_hf(source)
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    sharded = bad_folder(tmp_path, arch)
    (sharded / "model.safetensors").unlink()
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))
    got = load_hf(sharded)[1]
    jax.tree.map(np.testing.assert_array_equal, got, want)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        half = tmp_path / np.dtype(dtype).name
        half.mkdir()
        shutil.copy(source / "config.json", half)
        save_file({n: t.astype(dtype) for n, t in tensors.items()}, half / "model.safetensors")
        got = load_hf(half)[1]
        rounded = jax.tree.map(lambda a, d=dtype: a.astype(d).astype(np.float32), want)
        jax.tree.map(np.testing.assert_array_equal, got, rounded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00003-of-00002.safetensors" for n in names}}))
    with pytest.raises(HFError, match="lists shard 'model-00003-of-00002.safetensors'"):
        load_hf(sharded)


def test_zero3_prefetch_runs_gemma_layers_carrying_their_counter():
    """zero3_prefetch's hand-written backward reads each layer's input from the stacked scan
    inputs; Gemma's carry is (activations, layer counter): same losses as zero3's."""
    cfg, params = load_hf(FIXTURES / "gemma3_text", max_len=32)
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8, 17), np.int32)
    losses = {s: run_label(s, 8, [batch, batch], cfg, optax.adam(1e-3), seed=0,
                           mesh_spec="fsdp=8", init_params=params)[0]
              for s in ("zero3", "zero3_prefetch")}
    np.testing.assert_allclose(losses["zero3_prefetch"], losses["zero3"], rtol=1e-5)
    assert losses["zero3"][1] < losses["zero3"][0]


def test_param_count_is_exact_for_every_architecture():
    """model.flops.param_count (the planner's and the ZeRO evidence's Ψ) against the arrays the
    model builds: q/k/v biases, q/k norms, q wider than d_model, GeGLU and Gemma's four norms."""
    for arch in ("qwen2", "qwen3", "gemma3_text"):
        cfg, params = load_hf(FIXTURES / arch, max_len=32)
        assert param_count(cfg) == sum(np.size(x) for x in jax.tree.leaves(params)), arch


def test_chat_ids_are_the_templates_alone_and_a_refusal_is_one_line(tmp_path):
    """A conversation's ids are the rendered template's, with no BOS of the tokenizer's own
    even where it adds one (the template writes it: transformers' ids); a conversation the
    template refuses is one ConfigError line naming the model."""
    folder = tmp_path / "gemma"
    shutil.copytree(FIXTURES / "gemma3_text", folder)
    bos = HFTokenizer(folder).bos_id
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    with_bos_first(tokenizer, bos).save(str(folder / "tokenizer.json"))
    pre = loading.load(str(folder))
    assert pre.tokenizer.bos  # encode would put one first
    rows = json.loads((folder / "reference.json").read_text())["chat"]
    assert loading.conversation_ids(pre, rows[0]["messages"]) == rows[0]["ids"]
    assert rows[0]["ids"].count(pre.tokenizer.bos[0]) == 1
    with pytest.raises(ConfigError, match=f"model={str(folder)!r}: chat_template: Conversation "
                                          f"roles must alternate"):
        loading.conversation_ids(pre, rows[2]["messages"])


def test_generation_configs_eos_ids_also_stop_a_reply(tmp_path):
    """A folder's generation_config.json eos ids (a list, as Llama 3.1's) stop a reply besides
    the tokenizer's eos; a malformed list is one line naming the file."""
    assert HFTokenizer(FIXTURES / "llama").stop_ids == (2,)
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert HFTokenizer(folder).stop_ids == (2, 0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(HFTokenizerError, match="generation_config.json'.*eos_token_id="):
        HFTokenizer(folder)


def test_rope_scaling_beside_rope_parameters_is_taken_first_as_transformers_does(tmp_path):
    """A config.json holding both forms (an older `rope_scaling` beside transformers 5's
    `rope_parameters`) is read from `rope_scaling`, as transformers reads it, with the
    top-level `rope_theta`: here Llama 3's scaling with the plain folder's parameters beside
    it."""
    folder = bad_folder(tmp_path, "llama3")
    hf = read_config(folder)
    scaling = {k: v for k, v in hf["rope_parameters"].items() if k != "rope_theta"}
    both = {**hf, "rope_scaling": scaling, "rope_theta": hf["rope_parameters"]["rope_theta"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    (folder / "config.json").write_text(json.dumps(both))
    assert load_hf(folder)[0] == load_hf(FIXTURES / "llama3")[0]
