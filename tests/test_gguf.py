"""The GGUF reader and Llama loader against untrusted files: every bad file is one GGUFError
line (never another exception, a hang, or an allocation sized by a forged header), and a good
file loads into exactly the parameters our DecoderLM declares."""

from __future__ import annotations

import struct
import time

import jax
import numpy as np
import pytest
from flax import nnx

from model import DecoderLM
from model.config import ModelConfig
from model.gguf import GGUFError, GGUFFile
from model.llama_gguf import llama3_divisors, llama3_scaling, load_gguf
from model.tokenizer import BPETokenizer, chat_prompt, tokenizer_from_gguf
from tests import gguf_files


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return gguf_files.write(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def load_all(path):
    cfg, params, g = load_gguf(path)
    return cfg, params, tokenizer_from_gguf(g)


def test_a_good_file_fills_every_declared_parameter(good):
    cfg, params, _ = load_all(good)
    assert (cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.mlp, cfg.tie_embeddings) == \
        (gguf_files.LAYERS, gguf_files.HEADS, gguf_files.KV_HEADS, "swiglu", True)
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DecoderLM(cfg,
                                                                          rngs=nnx.Rngs(0)))))
    want = {jax.tree_util.keystr(k): v.shape for k, v in
            jax.tree_util.tree_leaves_with_path(abstract)}
    got = {jax.tree_util.keystr(k): v.shape for k, v in
           jax.tree_util.tree_leaves_with_path(params)}
    assert got == want
    # Linear weights are transposed to [in, out]; the down projection is not permuted.
    raw = gguf_files.tensors(np.random.default_rng(0))
    np.testing.assert_array_equal(params["blocks"]["mlp"]["down"]["kernel"][1],
                                  raw["blk.1.ffn_down.weight"].T)


def test_rotary_rows_are_unpermuted_per_head(good):
    """llama.cpp interleaves each head's rotary pairs; the loader restores rotate-half order:
    row (head h, pair i, half j) of the file is row (h, j, i) of ours."""
    cfg, params, _ = load_all(good)
    raw = gguf_files.tensors(np.random.default_rng(0))["blk.0.attn_k.weight"]  # [kv*hd, d]
    hd = cfg.head_dim
    ours = params["blocks"]["attn"]["k"]["kernel"][0].T  # [kv*hd, d]
    for h in range(cfg.kv_heads):
        for i in range(hd // 2):
            for j in range(2):
                np.testing.assert_array_equal(ours[h * hd + j * hd // 2 + i],
                                              raw[h * hd + 2 * i + j])


def test_tokenizer_and_chat_template(good):
    _, _, tok = load_all(good)
    text = chat_prompt([{"role": "user", "content": "the"}], default_system=None)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids  # control tokens matched whole
    assert tok.decode(ids) == text
    assert tok.encode(" the 12") == [gguf_files.TOKENS.index("Ġthe"),
                                     *tok.encode(" "), *tok.encode("1"), *tok.encode("2")]


def test_llama3_split_takes_a_piece_that_is_a_token_whole():
    """With Llama 3's pre-tokenizer a piece that is itself a token is that token, as llama.cpp
    (and tokenizer.json's ignore_merges) do, even where the merges cannot build it; with
    GPT-2's split the merges decide. llama.cpp also puts BOS first there by default."""
    tokens = [*gguf_files.TOKENS, "Ġthey"]  # no merge makes "Ġthey"
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    llama3 = BPETokenizer(tokens, gguf_files.MERGES, types, pre="llama-bpe", eos_id=2)
    gpt2 = BPETokenizer(tokens, gguf_files.MERGES, types, pre="gpt-2", eos_id=2)
    assert llama3.encode(" they") == [len(tokens) - 1]
    assert gpt2.encode(" they") == [tokens.index("Ġthe"), tokens.index("y")]
    assert llama3.encode(" the") == gpt2.encode(" the") == [tokens.index("Ġthe")]


def test_a_replys_stop_tokens_include_the_files_end_of_turn(tmp_path):
    """eos first, then the file's end-of-turn token (llama.cpp stops at each); an id outside
    the vocabulary is one line."""
    plain = tokenizer_from_gguf(GGUFFile(gguf_files.write(tmp_path / "a.gguf")))
    assert plain.stop_ids == (2,)
    eot = tokenizer_from_gguf(GGUFFile(gguf_files.write(
        tmp_path / "b.gguf", metadata_overrides={"tokenizer.ggml.eot_token_id": 1})))
    assert eot.stop_ids == (2, 1)
    with pytest.raises(GGUFError, match="end-of-turn token id"):
        tokenizer_from_gguf(GGUFFile(gguf_files.write(
            tmp_path / "c.gguf", metadata_overrides={"tokenizer.ggml.eot_token_id": 10**6})))


def test_user_defined_tokens_are_matched_whole():
    """A token of type user-defined (4) is one id wherever its text appears, as llama.cpp
    matches it; as a normal token (1) the same text is split by the merges."""
    tokens = [*gguf_files.TOKENS, "<tool>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    plain = BPETokenizer(tokens, gguf_files.MERGES, types, pre="smollm", eos_id=2)
    user = BPETokenizer(tokens, gguf_files.MERGES, types[:-1] + [4], pre="smollm", eos_id=2)
    assert user.encode("a<tool>b") == [*user.encode("a"), len(tokens) - 1, *user.encode("b")]
    assert len(tokens) - 1 not in plain.encode("a<tool>b")
    assert user.decode(user.encode("x <tool> y")) == "x <tool> y"


@pytest.mark.parametrize("case, kwargs, message", [
    ("missing", dict(drop="blk.1.ffn_up.weight"), "missing tensor for blocks/mlp/up/kernel"),
    ("extra", dict(extra="blk.0.attn_bias.weight"), "extra tensor 'blk.0.attn_bias.weight'"),
    ("shape", dict(reshape="blk.0.attn_v.weight"), "tensor 'blk.0.attn_v.weight' has shape"),
    ("arch", dict(arch="gpt2"), "architecture 'gpt2' is not supported"),
    ("layers", dict(block_count=7), "block_count=7"),
    ("heads", dict(metadata_overrides={"llama.attention.head_count_kv": 3}), "n_kv_heads=3"),
    ("type", dict(metadata_overrides={"llama.embedding_length": "32"}), "embedding_length"),
    ("rotary", dict(metadata_overrides={"llama.rope.dimension_count": 4}),
     "partial rotary (rope.dimension_count=4, head_dim=8) is supported for phi3 only"),
])
def test_a_bad_model_file_is_one_line(tmp_path, case, kwargs, message):
    path = gguf_files.write(tmp_path / f"{case}.gguf", **kwargs)
    with pytest.raises(GGUFError) as e:
        load_all(path)
    assert message in str(e.value) and "\n" not in str(e.value)


def _must_fail_cleanly(path, allow_success=False):
    start = time.perf_counter()
    try:
        load_all(path)
    except GGUFError as e:
        assert "\n" not in str(e) and str(e)
    else:
        assert allow_success, "a damaged file loaded"
    assert time.perf_counter() - start < 10  # no loop or allocation sized by a forged count


def test_fuzz_truncated_files(good, tmp_path):
    data = good.read_bytes()
    rng = np.random.default_rng(1234)
    offsets = [0, 3, 4, 8, 23, 24] + sorted(rng.integers(25, len(data) - 1, 24).tolist())
    for off in offsets:
        bad = tmp_path / f"cut{off}.gguf"
        bad.write_bytes(data[:off])
        _must_fail_cleanly(bad)


@pytest.mark.parametrize("offset, value", [
    (4, 99),  # version
    (8, 2**63 - 1), (8, 10**6),  # tensor count
    (16, 2**63 - 1), (16, 10**6),  # metadata count
])
def test_fuzz_forged_header_counts(good, tmp_path, offset, value):
    data = bytearray(good.read_bytes())
    fmt = "<I" if offset == 4 else "<Q"
    struct.pack_into(fmt, data, offset, value)
    bad = tmp_path / "forged.gguf"
    bad.write_bytes(bytes(data))
    _must_fail_cleanly(bad)


def test_fuzz_forged_string_lengths_and_tensor_dims(good, tmp_path):
    data = good.read_bytes()
    # The first key's length field follows the 24-byte header: claim 2**40 bytes.
    forged = bytearray(data)
    struct.pack_into("<Q", forged, 24, 2**40)
    (tmp_path / "strlen.gguf").write_bytes(bytes(forged))
    _must_fail_cleanly(tmp_path / "strlen.gguf")
    # Every tensor-info dimension field found by name: set one to a huge size.
    g = GGUFFile(good)
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4  # skip n_dims (uint32)
    forged = bytearray(data)
    struct.pack_into("<Q", forged, at, 2**40)
    (tmp_path / "dims.gguf").write_bytes(bytes(forged))
    _must_fail_cleanly(tmp_path / "dims.gguf")
    assert g.tensors  # the original still reads


def test_fuzz_random_header_bytes(good, tmp_path):
    """Random byte flips before the tensor data: a flip may still leave a valid file (a
    changed float, a token's letter), but nothing may raise anything but GGUFError."""
    data = good.read_bytes()
    end = GGUFFile(good).data_offset
    rng = np.random.default_rng(99)
    for i in range(40):
        forged = bytearray(data)
        for pos in rng.integers(0, end, 3):
            forged[pos] = int(rng.integers(0, 256))
        bad = tmp_path / f"flip{i}.gguf"
        bad.write_bytes(bytes(forged))
        _must_fail_cleanly(bad, allow_success=True)


def test_llama3_scaling_is_read_back_from_the_divisors_llama_cpp_writes():
    """Llama 3.2's RoPE scaling (base 500,000, head 64, factor 32, band 1..4 over 8,192
    positions) survives divisors -> parameters; what no such scaling gives is refused."""
    cfg = ModelConfig(rope_base=500_000.0, head_size=64, rope_scale_factor=32.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_len=8192)
    divisors = llama3_divisors(cfg)
    assert divisors[0] == 1 and divisors[-1] == 32 and ((divisors > 1) & (divisors < 32)).sum() == 3
    assert llama3_scaling(divisors, 500_000.0, 64, "f") == {
        "rope_scale_factor": 32.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_max_len": 8192}
    assert llama3_scaling(np.ones(32, np.float32), 500_000.0, 64, "f") == {}
    bent = divisors.copy()
    bent[16] *= 1.01
    with pytest.raises(GGUFError, match="is not Llama 3's RoPE scaling"):
        llama3_scaling(bent, 500_000.0, 64, "f")
    with pytest.raises(GGUFError, match="blends 0 frequencies"):
        llama3_scaling(np.where(divisors > 1, 32, 1).astype(np.float32), 500_000.0, 64, "f")
    with pytest.raises(GGUFError, match="no set of 32 frequency divisors"):
        llama3_scaling(divisors[:8], 500_000.0, 64, "f")
    with pytest.raises(ValueError, match="rope_high_freq_factor=4.0: only with"):
        ModelConfig(rope_high_freq_factor=4.0).validate()
    with pytest.raises(ValueError, match="rope_scale_factor=8.0: Llama 3's scaling needs"):
        ModelConfig(rope_scale_factor=8.0).validate()


def test_rows_of_a_tensor_read_alone_as_in_the_whole(tmp_path):
    """`GGUFFile.tensor(name, rows)` (how Phi-3's fused tensors are read, one part at a time)
    equals those rows of the whole tensor, stored float32 or quantised (a row is whole
    blocks); rows outside the tensor are one GGUFError line."""
    import gguf

    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "rows.gguf"), "llama")
    writer.add_tensor("f32", w)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("q8", gguf.quants.quantize(w, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    g = GGUFFile(tmp_path / "rows.gguf")
    for name in ("f32", "q8"):
        whole = g.tensor(name)
        assert whole.shape == (6, 64)
        np.testing.assert_array_equal(g.tensor(name, (2, 5)), whole[2:5])
    assert not np.array_equal(g.tensor("q8"), w)  # quantised: the rows are its blocks' values
    with pytest.raises(GGUFError, match=r"tensor 'q8' \[6, 64\] has no rows 4..7"):
        g.tensor("q8", (4, 7))
