"""`train_and_evaluate(config, workdir)`: the training loop every launcher calls.

Everything that can be wrong with the input is checked in `prepare()` before anything is
written, so bad input leaves no trace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from experiments.cli.config import ConfigError
from experiments.training import checkpoint as ckpt
from experiments.training import integrity, lineage, pretrained_init
from experiments.training.config import PRETRAINED_INITS, Config, dumps, load_config
from experiments.training.data import (
    SequenceSampler,
    bos_of,
    fit_advice,
    load_tokens,
    pack,
    validation_batches,
)
from experiments.training.guards import FiniteWatch, Preemption, WriteFailed
from experiments.training.loss_names import describe_loss, loss_measures, val_row
from experiments.training.optim import learning_rate, make_optimizer
from experiments.training.run_tokenizer import tokenizer_for
from experiments.training.saver import Saver, reason
from model import param_count, train_flops_per_token
from model.config import EXECUTION_FIELDS, differing_fields
from model.flops import param_bytes
from model.gguf import GGUFFile
from model.loss import nll_sum
from parallel.mesh import make_mesh
from parallel.rules import BATCH_AXES
from parallel.sharded_run import ShardedRun, build
from parallel.strategies import get_strategy
from parallel.train_step import StepConfig

# Fields a resumed run may change; everything else must match the checkpointed run. Not
# `steps`: it is also the length of the cosine schedule, so another value would change every
# learning rate still to come and the run would not continue as it was going.
RESUMABLE_CHANGES = {"strategy", "prefetch", "mesh", "devices", "eval_every",
                     "eval_batches", "log_every", "ckpt_every", "keep_ckpts", "on_nonfinite"}
# Model fields that say how the step is computed, not what: a run trained with the fused cuDNN
# attention on a GPU continues with XLA's on another machine, or with another remat policy.
MODEL_RESUMABLE_CHANGES = EXECUTION_FIELDS


@dataclasses.dataclass(frozen=True)
class Run:
    """A checked configuration with its sharded program and its data, ready to train."""
    cfg: Config
    sharded: ShardedRun
    sampler: SequenceSampler
    val: list
    pretrained: GGUFFile | None = None  # the weights `init` starts from, already checked
    load_report: dict = dataclasses.field(default_factory=dict)  # host memory of that load
    source_run: str | None = None  # the run folder `init` names: its newest intact checkpoint
    byte_tokens: bool = True  # the tokens are bytes (else a pretrained model's vocabulary)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.sharded.mesh

    @property
    def graphdef(self):
        return self.sharded.graphdef

    @property
    def abstract_state(self) -> dict:
        return self.sharded.abstract_state

    @property
    def shardings(self) -> dict:
        return self.sharded.shardings

    @property
    def batch_sharding(self) -> NamedSharding:
        return self.sharded.batch_sharding

    @property
    def step_fn(self):
        return self.sharded.step


def _check_disk(workdir: Path, abstract_state, keep: int) -> None:
    """Before training: the work dir can be written, and its disk holds the checkpoints we keep
    (plus one being written). Orbax writes each step to a temporary folder first, so a disk that
    fills up later fails that save with an error and leaves the previous checkpoint intact."""
    existing = workdir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"workdir={str(workdir)!r}: {existing} is not a writable folder")
    need, free = (keep + 1) * param_bytes(abstract_state), shutil.disk_usage(existing).free
    if free < need:
        raise ConfigError(f"workdir={str(workdir)!r}: {free / 1e9:.2f} GB free, checkpoints need "
                          f"about {need / 1e9:.2f} GB ({keep} kept + 1 being written)")


def _check_workdir(cfg: Config, workdir: Path, resume: bool) -> None:
    cfg_file = workdir / "config.json"
    holds_run = cfg_file.exists() or (workdir / "checkpoints").exists()
    if holds_run and not resume:
        raise ConfigError(f"workdir={str(workdir)!r}: already holds a run; pass --resume to "
                          f"continue it or choose an empty folder")
    if resume and cfg_file.exists():
        old = load_config(workdir)  # one line on a config.json that is not a run's
        diff = differing_fields(dataclasses.asdict(old.model), cfg.model)
        if diff:
            f, more = diff[0], f" (and {', '.join(diff[1:])})" if diff[1:] else ""
            raise ConfigError(f"resume: {f}={getattr(cfg.model, f)!r} differs from the run's "
                              f"{getattr(old.model, f)!r}{more}; a checkpoint only resumes with "
                              f"the model it was written with (allowed to change: "
                              f"{', '.join(sorted(MODEL_RESUMABLE_CHANGES))})")
        for f in dataclasses.fields(old.train):
            if f.name not in RESUMABLE_CHANGES and \
                    getattr(old.train, f.name) != getattr(cfg.train, f.name):
                why = (f" (the learning-rate schedule's length; a resumed run keeps it; to train "
                       f"on with a new schedule, start a new run from this one: --init "
                       f"{workdir})" if f.name == "steps" else "")
                raise ConfigError(f"resume: {f.name}={getattr(cfg.train, f.name)!r} differs from "
                                  f"the run's {getattr(old.train, f.name)!r}{why}; allowed to "
                                  f"change: {', '.join(sorted(RESUMABLE_CHANGES))}")


def prepare(cfg: Config, workdir: Path | None = None, resume: bool = False) -> Run:
    """Validate the whole configuration against data and devices; build (not run) the step."""
    try:
        cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t = cfg.train
    try:
        # `devices` counts this process's devices; the mesh spans every process's.
        mesh = make_mesh(t.devices * jax.process_count() if t.devices else None, t.mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n_dev, n_proc = mesh.size, jax.process_count()
    micro_batch = t.batch_size // t.micro_steps
    if micro_batch % n_dev:
        raise ConfigError(f"batch_size={t.batch_size}: each micro-batch ({micro_batch} sequences) "
                          f"must divide over the {n_dev} devices of the mesh")
    if micro_batch % n_proc:
        raise ConfigError(f"batch_size={t.batch_size}: must divide over {n_proc} processes")
    tx = make_optimizer(t)
    step_cfg = StepConfig(global_batch=micro_batch, seq_len=cfg.model.max_len,
                          micro_steps=t.micro_steps, clip_norm=t.clip_norm)
    try:
        sharded = build(cfg.model, get_strategy(t.strategy, t.prefetch), mesh, tx, step_cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pretrained, source_run, tokenizer = None, None, None
    if t.init is not None:  # the weights must be this model; its tokenizer reads the data
        try:
            if t.init in PRETRAINED_INITS:
                pretrained = pretrained_init.check_model(t.init, cfg.model)
            else:
                lineage.check_same_model(t.init, cfg)
                source_run = t.init
            tokenizer = tokenizer_for(t.init)
        except ValueError as e:  # GGUFError and ConfigError are ones
            raise ConfigError(str(e).splitlines()[0]) from None
    rows, val = _read_data(cfg, tokenizer, micro_batch, n_dev)
    if workdir is not None:
        _check_workdir(cfg, workdir, resume)
        _check_disk(workdir, sharded.abstract_state, t.keep_ckpts)
    if jax.process_count() > 1:  # nobody writes before every process has checked the workdir
        multihost_utils.sync_global_devices("shardq: input checked")
    return Run(cfg, sharded, SequenceSampler(rows, t.seed), val, pretrained,
               source_run=source_run, byte_tokens=tokenizer is None)


def _read_data(cfg: Config, tokenizer, micro_batch: int, n_dev: int) -> tuple:
    """(training rows, validation batches); a validation split too small for one batch is
    refused with what would fit, computed from the data."""
    t = cfg.train
    try:
        train_tokens, val_tokens = load_tokens(t.data, t.val_percent, t.corpus,
                                               None if tokenizer is None else tokenizer.encode)
        bos = bos_of(tokenizer)
        rows, val_rows = (pack(part, cfg.model.max_len, bos) for part in (train_tokens, val_tokens))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return rows, validation_batches(val_rows, micro_batch, t.eval_batches)
    except ValueError as e:
        n_bytes = len(train_tokens) + len(val_tokens)
        if tokenizer is not None:  # the tokens per byte of this text, to size a split
            n_bytes = len("".join(tokenizer.decode(x.tolist()) for x in
                                  (train_tokens, val_tokens)).encode())
        advice = fit_advice(t.data, len(val_rows), micro_batch, t.micro_steps, n_dev,
                            cfg.model.max_len, (len(train_tokens) + len(val_tokens)) / n_bytes)
        raise ConfigError(f"{e}; {advice}") from None


def init_sharded_state(run: Run) -> dict:
    """Jitted init straight into the strategy's shardings (no device holds what it shouldn't);
    with `init`, the pretrained weights placed one tensor at a time into their shards."""
    if run.source_run is not None:
        return run.sharded.init_from(_source_params(run))
    if run.pretrained is None:
        return run.sharded.init(run.cfg.train.seed)
    params, report = pretrained_init.load_sharded(run.pretrained, run.cfg.model,
                                                  run.shardings["params"])
    run.load_report.update(report)
    return run.sharded.init_from(params)


def _source_params(run: Run) -> dict:
    """The parameters of the source run's newest intact checkpoint, read straight into this
    run's shardings (cast to its param dtype)."""
    mngr = ckpt.manager(run.source_run, read_only=True)
    abstract = {"params": run.abstract_state["params"]}
    try:
        restored = ckpt.restore_latest_intact(Path(run.source_run), mngr, abstract,
                                              {"params": run.shardings["params"]},
                                              params_only=True)
    except ckpt.NoIntactCheckpoint as e:
        raise ConfigError(f"init={run.source_run!r}: {e}") from None
    finally:
        mngr.close()
    if restored is None:
        raise ConfigError(f"init={run.source_run!r}: holds no checkpoint to start from")
    state, _, step = restored
    run.load_report.update({"init_run": run.source_run, "init_step": step})
    return state["params"]


def global_batch(run: Run, rows_fn) -> jax.Array:
    """Assemble this process's rows into one global array sharded over the batch axes."""
    t = run.cfg.train
    local = rows_fn(t.batch_size, jax.process_index(), jax.process_count())
    local = local.reshape(t.micro_steps, -1, local.shape[-1])
    shape = (t.micro_steps, t.batch_size // t.micro_steps, local.shape[-1])
    return jax.make_array_from_process_local_data(run.batch_sharding, local, shape)


def make_eval_fn(graphdef, mesh: jax.sharding.Mesh, val: list):
    """Mean NLL (nats/token) of params over the fixed validation batches `val`."""
    sharding = NamedSharding(mesh, P(BATCH_AXES))

    @jax.jit
    def nll(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return nll_sum(logits, tokens[:, 1:])

    def evaluate(params) -> float:
        total, count = 0.0, 0
        for rows in val:
            n_proc, i = jax.process_count(), jax.process_index()
            per = len(rows) // n_proc
            tokens = jax.make_array_from_process_local_data(
                sharding, rows[i * per:(i + 1) * per], rows.shape)
            total += float(nll(params, tokens))
            count += rows.shape[0] * (rows.shape[1] - 1)
        return total / count

    return evaluate


def _append_jsonl(path: Path, row: dict) -> None:
    if jax.process_index() == 0:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    if jax.process_index() == 0:
        tmp = path.with_suffix(path.suffix + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind


def train_and_evaluate(cfg: Config, workdir: str | Path, resume: bool = False,
                       progress: bool = True) -> dict:
    """Train `cfg` in `workdir` (continuing its newest intact checkpoint with `resume`),
    checkpointing and logging as configured; returns the run's summary."""
    workdir = Path(workdir)
    run = prepare(cfg, workdir, resume)
    workdir.mkdir(parents=True, exist_ok=True)
    mngr = ckpt.manager(workdir, keep=cfg.train.keep_ckpts)
    state, start = _restore_or_init(run, workdir, mngr, resume)
    _write_atomic(workdir / "config.json", dumps(cfg))
    evaluate = make_eval_fn(run.graphdef, run.mesh, run.val)
    val_before = None
    if cfg.train.init is not None and start == 0:  # what fine-tuning starts from, same batches
        val_before = evaluate(state["params"])
        _append_jsonl(workdir / "metrics.jsonl", val_row(0, val_before, run.byte_tokens))
        if jax.process_index() == 0:
            print(f"step 0 (the initial weights): {describe_loss(val_before, run.byte_tokens)}",
                  flush=True)
    end = _train_steps(run, state, start, workdir, mngr, evaluate, progress)
    val_loss = end.val_loss
    if val_loss is None or end.preempted:  # report the state the run ends with
        val_loss = evaluate(end.state["params"])
    summary = {"step": end.step, "val_loss": val_loss,
               "train_seconds": end.seconds, "params": param_count(cfg.model),
               "devices": run.mesh.size, "strategy": cfg.train.strategy,
               "preempted": end.preempted, "skipped_steps": end.skipped, "resumed_from": start,
               "val_loss_before": val_before, "load": dict(run.load_report)}
    summary.update(loss_measures(val_loss, run.byte_tokens, prefix=""))
    # what a token is: bytes, or the vocabulary of the pretrained model the run started from
    summary["tokens"] = "bytes" if run.byte_tokens else lineage.origin(cfg.train.init).pretrained
    return summary


def _restore_or_init(run: Run, workdir: Path, mngr, resume: bool) -> tuple[dict, int]:
    """The state to train from and its step: with `resume` the newest intact checkpoint (the
    sampler continues where it stood, metrics logged after it are dropped), else a fresh one."""
    metrics_path = workdir / "metrics.jsonl"
    try:
        restored = (ckpt.restore_latest_intact(workdir, mngr, run.abstract_state, run.shardings,
                                               quarantine=jax.process_index() == 0)
                    if resume else None)
    except ckpt.NoIntactCheckpoint as e:
        # Every checkpoint there is damaged and now lies in checkpoints.damaged/ (nothing is
        # deleted); the run has nothing to continue from, so it starts again.
        if jax.process_index() == 0:
            integrity.warn(f"{e}; moved to {workdir / 'checkpoints.damaged'}, training again "
                           f"from step 0")
        restored = None
    if resume and jax.process_count() > 1:  # process 0 may have moved steps out of sight
        multihost_utils.sync_global_devices("shardq: checkpoints checked")
        mngr.reload()
    if restored is not None:
        state, meta, _ = restored
        run.sampler.position = int(meta["data_position"])
        start = int(meta["step"])
        _truncate_metrics(metrics_path, start)
        return state, start
    if metrics_path.exists():
        metrics_path.unlink()
    return init_sharded_state(run), 0


def _checkpoint_meta(run: Run, step: int) -> dict:
    """What a checkpoint stores besides the state: where the data and the RNG stand."""
    t = run.cfg.train
    key = jax.random.fold_in(jax.random.key(t.seed), step)  # the run's RNG at this step
    return {"step": step, "data_position": run.sampler.position, "seed": t.seed,
            "rng_key": np.asarray(jax.random.key_data(key)).tolist(),
            "model": dataclasses.asdict(run.cfg.model)}


@dataclasses.dataclass
class _End:
    """Where the loop stopped: the state, its step, the last validation loss (None if none was
    taken), whether SIGTERM stopped it, the steps skipped as non-finite, its seconds."""
    state: dict
    step: int
    val_loss: float | None
    preempted: bool
    skipped: int
    seconds: float


def _train_steps(run: Run, state: dict, start: int, workdir: Path, mngr, evaluate,
                 progress: bool) -> _End:
    """Steps start+1.. to the end (or SIGTERM): log, evaluate and checkpoint as configured."""
    t, metrics_path = run.cfg.train, workdir / "metrics.jsonl"
    schedule = learning_rate(t)
    tokens_per_step = t.batch_size * run.cfg.model.max_len
    flops_per_token = train_flops_per_token(run.cfg.model)
    bar = tqdm(total=t.steps, initial=start, disable=not progress or jax.process_index() != 0,
               dynamic_ncols=True, desc="train")
    last_t, last_step, val_loss = time.perf_counter(), start, None
    t0 = time.perf_counter()
    watch, step, preempted = FiniteWatch(t.on_nonfinite), start, False
    saver = Saver(mngr, workdir)
    with Preemption() as preemption, ckpt.save_errors_raised_not_logged():
        try:
            for step in range(start + 1, t.steps + 1):
                batch = global_batch(run, run.sampler.next_batch)
                state, metrics = run.step_fn(state, batch)
                watch.push(step, metrics)
                if step % t.log_every == 0 or step == t.steps:
                    loss = float(metrics["loss"])  # waits for the step
                    now = time.perf_counter()
                    tps = tokens_per_step * (step - last_step) / (now - last_t)
                    row = {"step": step, "loss": loss,
                           "grad_norm": float(metrics["grad_norm"]),
                           "lr": float(schedule(step - 1)), "tokens_per_s": tps,
                           "model_tflops_per_s": tps * flops_per_token / 1e12,
                           "elapsed_s": now - t0, "skipped_steps": watch.skipped}
                    _append_jsonl(metrics_path, row)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
                    last_t, last_step = now, step
                if step % t.eval_every == 0 or step == t.steps:
                    watch.flush()
                    val_loss = evaluate(state["params"])
                    _append_jsonl(metrics_path, val_row(step, val_loss, run.byte_tokens))
                    if jax.process_index() == 0:
                        bar.write(f"step {step}: {describe_loss(val_loss, run.byte_tokens)}")
                saver.seal_if_written(step)
                preempted = preemption.requested()
                if step % t.ckpt_every == 0 or step == t.steps or preempted:
                    watch.flush()
                    saver.save(step, state, _checkpoint_meta(run, step))
                bar.update(1)
                if preempted:
                    bar.write(f"SIGTERM: checkpointed step {step}; resume with --resume")
                    break
            watch.flush()
            saver.finish(step)  # a pending save completes and is sealed before we return
        except OSError as e:  # metrics.jsonl, config.json or a manifest: a full disk
            raise WriteFailed(saver.stopped(step, reason(e))) from None
        finally:
            bar.close()
            saver.close()  # seals a save that did finish; closes the manager
    return _End(state, step, val_loss, preempted, watch.skipped, time.perf_counter() - t0)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint we resume from: they will be logged again."""
    if not path.exists() or jax.process_index() != 0:
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when the run died or the disk filled
            continue
        if row["step"] <= step:
            rows.append(line)
    _write_atomic(path, "".join(r + "\n" for r in rows))
