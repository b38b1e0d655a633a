"""Experiments of speed: MiniLM encoding, SmolLM2 decoding, the training step against PyTorch
and per change, and the GPU benchmark."""

from __future__ import annotations

import statistics

from experiments.reporting.registry.claims import holds
from experiments.reporting.registry.experiment import Experiment, launcher

# The quick run times the training step on the tiny preset, briefly.
QUICK_STEPS = ("--preset", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "1")


def _rounds_agree(d: dict) -> bool:
    # Files written before the rounds have no "tokens_agree".
    return all(r.get("tokens_agree", True) for r in d["variants"])


def split_int8_agrees(d: dict) -> bool:
    """An int8 variant split over devices writes its one-device twin's tokens: its int8
    products sum exactly in int32 however they are split. A split step runs XLA's products, so
    its twin is the one-device variant with XLA's products (`-xla`) where the file has one."""
    by = {r["variant"]: r for r in d["variants"]}

    def twin(name: str) -> str:
        base = name.rsplit("-split", 1)[0]
        return base + "-xla" if base + "-xla" in by else base

    return all(r["tokens"] == by[twin(r["variant"])]["tokens"]
               for r in d["variants"] if r.get("devices", 1) > 1 and r["quant"] != "none"
               and twin(r["variant"]) in by)


def _peer_ratios_hold(d: dict) -> bool:
    """True without peer rows (a run without llama.cpp's tools says why in "skipped")."""
    peer = d.get("peer")
    if not peer or not peer.get("rows"):
        return peer is None or bool(peer.get("skipped"))
    theirs = {(r["format"], r["test"]): r["tokens_per_s"] for r in peer["rows"]}
    for test, ours, key in (("tg", d["variants"], "decode_ratios"),
                            ("pp", d["prefill"]["rows"], "prefill_ratios")):
        speeds = {r["variant"]: r["tokens_per_s"] for r in ours}
        wanted = {("float", "F32")} if "float" in speeds else set()
        wanted |= {(r["variant"], "Q8_0") for r in ours if r["quant"] != "none"}
        named = {(r["ours"], r["peer"]) for r in peer[key]}
        if not wanted <= named or not all(
                abs(r["value"] * theirs[r["peer"], test] / speeds[r["ours"]] - 1) < 1e-9
                for r in peer[key]):
            return False
    return all(_pairs_hold(r) for r in peer.get("paired", []))


def _pairs_hold(r: dict) -> bool:
    """Each back-to-back pair's ratio is its own two speeds', and the median and range are
    those ratios'."""
    ours, peer = r["ours_tokens_per_s"], r["peer_tokens_per_s"]
    if not len(ours) == len(peer) == len(r["ratios"]) == r["pairs"] > 0:
        return False
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    return (all(abs(a / b - 1) < 1e-9 for a, b in zip(ratios, r["ratios"], strict=True))
            and abs(statistics.median(ratios) / r["median_ratio"] - 1) < 1e-9
            and (min(ratios), max(ratios)) == (r["min_ratio"], r["max_ratio"]))


EXPERIMENTS: tuple[Experiment, ...] = (
    # The table is a ratio to PyTorch (torch + transformers under SHARDQ_TORCH_PYTHON): without
    # that side a run would replace the committed file with ours alone, so it is skipped.
    Experiment(
        name="bench_encoder",
        argv=launcher("bench_encoder", "--json", "--out", "{results}/bench_encoder.json"),
        quick_argv=launcher("bench_encoder", "--json", "--sentences", "16", "--rounds", "1",
                            "--modes", "w8a8", "--out", "{results}/bench_encoder.json"),
        outputs=("bench_encoder.json",),
        expected_s=240, quick_expected_s=20,
        feeds="MiniLM speed vs PyTorch table",
        needs="torch",
    ),
    Experiment(
        name="encoder_ablations",
        argv=launcher("bench_encoder", "--ablations", "--json",
                      "--out", "{results}/encoder_ablations.json"),
        quick_argv=launcher("bench_encoder", "--ablations", "--json", "--sentences", "32",
                            "--rounds", "1", "--no-cli",
                            "--out", "{results}/encoder_ablations.json"),
        outputs=("encoder_ablations.json",),
        expected_s=300, quick_expected_s=30,
        feeds="MiniLM speed changes table",
    ),
    # The llama.cpp peer rows come with $SHARDQ_LLAMA_CPP (the runner passes its environment
    # on); without it the run says they are skipped and the rest is measured.
    Experiment(
        name="bench_decode",
        argv=launcher("bench_decode", "--json", "--out", "{results}/bench_decode.json"),
        quick_argv=launcher("bench_decode", "--json", "--layers", "2", "--new-tokens", "4",
                            "--repeats", "1", "--rounds", "1", "--prefill-tokens", "64",
                            "--long-prompt-tokens", "300",
                            "--variants", "float,w8a8,float-scan,w8a8-split2",
                            "--no-xla-flags",
                            "--out", "{results}/bench_decode.json"),
        outputs=("bench_decode.json",),
        expected_s=900, quick_expected_s=40,
        feeds="SmolLM2 decoding speed table, with llama.cpp beside it when its tools are given",
        claim=holds(
            "bench_decode.json", "each variant decoded the same tokens in every round, an int8 "
            "variant split over devices the same tokens as on one, and with llama.cpp rows "
            "every ratio is our median tokens/s over the peer's in the same file, float over "
            "F32 and each int8 variant over Q8_0, decoding and prefill alike",
            lambda d: _rounds_agree(d) and split_int8_agrees(d) and _peer_ratios_hold(d)),
    ),
    # Decoding a model larger than SmolLM2: Llama 3.2 1B's shapes with random weights (made on
    # the PyTorch side, with SmolLM2's tokenizer exported by us), against llama.cpp on our
    # GGUF export of the same folder.
    Experiment(
        name="shape_tokenizer",
        argv=launcher("export", "--model", "smollm2", "--layers", "1", "--format",
                      "safetensors", "--out", "{runs}/smollm2_tokenizer", "--force"),
        outputs=(),
        expected_s=20, quick_expected_s=20,
        feeds="the tokenizer of the shape models",
        needs="torch",
    ),
    Experiment(
        name="shape_models",
        argv=("experiments/reference/make_shape_models.py", "--tokenizer",
              "{runs}/smollm2_tokenizer", "--out", "{runs}/shapes", "--shapes", "llama3.2-1b"),
        outputs=(),
        expected_s=120, quick_expected_s=120,
        feeds="the Llama 3.2 1B-shaped model bench_decode_llama_1b times",
        needs="torch",
        after=("shape_tokenizer",),
    ),
    Experiment(
        name="bench_decode_llama_1b",
        argv=launcher("bench_decode", "--model", "{runs}/shapes/llama3.2-1b",
                      "--variants", "float,w8,w8a8,w8+kv8", "--repeats", "3", "--pairs", "4",
                      "--long-prompt-tokens", "0", "--no-xla-flags", "--json",
                      "--out", "{results}/bench_decode_llama_1b.json"),
        quick_argv=launcher("bench_decode", "--model", "{runs}/shapes/llama3.2-1b",
                            "--layers", "2", "--variants", "float,w8a8", "--new-tokens", "4",
                            "--repeats", "1", "--rounds", "1", "--pairs", "1",
                            "--prefill-tokens", "64", "--long-prompt-tokens", "0",
                            "--no-xla-flags", "--json",
                            "--out", "{results}/bench_decode_llama_1b.json"),
        outputs=("bench_decode_llama_1b.json",),
        expected_s=700, quick_expected_s=60,
        feeds="decoding speed of a Llama 3.2 1B-shaped model, with llama.cpp beside it",
        after=("shape_models",),
        claim=holds(
            "bench_decode_llama_1b.json", "each variant decoded the same tokens in every "
            "round, and with llama.cpp rows every ratio is our median tokens/s over the "
            "peer's in the same file",
            lambda d: _rounds_agree(d) and _peer_ratios_hold(d)),
    ),
    # The speed table is a ratio to PyTorch eager (SHARDQ_TORCH_PYTHON, as bench_encoder's);
    # each file keeps one entry per device count, and the tables show 1 and 8 devices.
    Experiment(
        name="bench_train",
        argv=launcher("bench_train", "--devices", "8", "--json",
                      "--out", "{results}/bench_train.json"),
        quick_argv=launcher("bench_train", "--devices", "8", "--json", *QUICK_STEPS,
                            "--profile-steps", "1", "--out", "{results}/bench_train.json"),
        outputs=("bench_train.json",),
        expected_s=90, quick_expected_s=30,
        feeds="training speed vs PyTorch table, 8 device(s)",
        needs="torch",
    ),
    Experiment(
        name="bench_train_1dev",
        argv=launcher("bench_train", "--devices", "1", "--json",
                      "--out", "{results}/bench_train.json"),
        quick_argv=launcher("bench_train", "--devices", "1", "--json", *QUICK_STEPS,
                            "--profile-steps", "1", "--out", "{results}/bench_train.json"),
        outputs=("bench_train.json",),
        expected_s=90, quick_expected_s=20,
        feeds="training speed vs PyTorch table, 1 device(s)",
        needs="torch",
    ),
    Experiment(
        name="train_changes",
        argv=launcher("bench_train", "--ablate", "--devices", "1",
                      "--changes-out", "{results}/bench_train_changes.json"),
        quick_argv=launcher("bench_train", "--ablate", "--devices", "1", *QUICK_STEPS,
                            "--changes-out", "{results}/bench_train_changes.json"),
        outputs=("bench_train_changes.json",),
        expected_s=240, quick_expected_s=30,
        feeds="training step changes table, 1 device(s)",
    ),
    Experiment(
        name="train_changes_8dev",
        argv=launcher("bench_train", "--ablate", "--devices", "8",
                      "--changes-out", "{results}/bench_train_changes.json"),
        quick_argv=launcher("bench_train", "--ablate", "--devices", "8", *QUICK_STEPS,
                            "--changes-out", "{results}/bench_train_changes.json"),
        outputs=("bench_train_changes.json",),
        expected_s=240, quick_expected_s=30,
        feeds="training step changes table, 8 device(s)",
    ),
    # The GPU benchmark: runs only where JAX's backend is an NVIDIA GPU (--tiny: its code paths
    # on tiny shapes, for the quick run).
    Experiment(
        name="bench_gpu",
        argv=launcher("bench_gpu", "--json", "--out", "{results}/bench_gpu.json"),
        quick_argv=launcher("bench_gpu", "--tiny", "--json", "--out", "{results}/bench_gpu.json"),
        outputs=("bench_gpu.json", "bench_gpu.png"),
        expected_s=300, quick_expected_s=60,
        feeds="GPU training MFU, attention and int8 GEMM tables",
        needs="gpu",
    ),
    Experiment(
        name="bench_gpu_no_triton",
        argv=launcher("bench_gpu", "--parts", "training,matmuls",
                      "--variants", "dp/full/xla,dp/save_dots/cudnn", "--json",
                      "--out", "{results}/bench_gpu_no_triton.json"),
        quick_argv=launcher("bench_gpu", "--tiny", "--parts", "training,matmuls", "--json",
                            "--out", "{results}/bench_gpu_no_triton.json"),
        outputs=("bench_gpu_no_triton.json", "bench_gpu_no_triton.png"),
        expected_s=200, quick_expected_s=60,
        feeds="GPU table without XLA's Triton GEMMs",
        needs="gpu",
        env=(("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false"),),
    ),
)
