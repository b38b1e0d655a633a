"""Orbax checkpoints of a training run: state (sharded arrays) + JSON metadata.

Layout under WORKDIR/checkpoints/<step>/:
  state/  the train state pytree {"params", "opt", "step"} (Orbax StandardSave, sharded arrays)
  meta/   JSON: step, data position, RNG key data, the model config it was written with

A checkpoint restores onto any mesh and strategy: the target shardings come from the reader.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from experiments.training import integrity


def manager(workdir: str | Path, keep: int = 2, read_only: bool = False,
            async_save: bool = True) -> ocp.CheckpointManager:
    if read_only:  # these settings are what Orbax forces (and warns about) for read-only use
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                               save_interval_steps=0)
    else:
        # A step whose write was cut short (a kill, a full disk) stays in a temporary folder;
        # it holds nothing that was saved, so a writer clears it away.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save,
                                               cleanup_tmp_directories=True)
    absl = logging.getLogger("absl")
    level = absl.level
    if read_only:  # Orbax warns that a read-only directory is read-only; that is the point here
        absl.setLevel(logging.ERROR)
    try:
        return ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=options,
                                     item_names=("state", "meta"))
    finally:
        absl.setLevel(level)


def save(mngr: ocp.CheckpointManager, step: int, state: dict, meta: dict) -> None:
    """Starts an asynchronous save (the arrays are copied before this returns)."""
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)))


def abstract_target(abstract_state, shardings):
    """ShapeDtypeStructs carrying the *reader's* shardings: Orbax reshards on restore."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state, shardings)


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state, shardings,
            params_only: bool = False) -> tuple[dict, dict]:
    """(state, meta). With params_only, reads just the parameters (evaluation, sampling)."""
    target = abstract_target(abstract_state, shardings)
    if params_only:
        target = {"params": target["params"]}
        item = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)
    else:
        item = ocp.args.StandardRestore(target)
    out = mngr.restore(step, args=ocp.args.Composite(state=item, meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]


def restore_latest_intact(workdir: Path, mngr: ocp.CheckpointManager, abstract_state, shardings,
                          params_only: bool = False, step: int | None = None,
                          quarantine: bool = False):
    """(state, meta, step) of the newest checkpoint that passes its integrity check and
    restores; each one skipped is named in a warning (and, with quarantine, moved to
    WORKDIR/checkpoints.damaged/ so the resumed run can write that step again). None if there
    is no checkpoint at all; NoIntactCheckpoint if there are some but none is intact (no
    warnings then: its message names every one and why)."""
    steps = sorted(mngr.all_steps(), reverse=True) if step is None else [step]
    if not steps:
        return None
    reasons = []
    for candidate in steps:
        reason = integrity.problem(Path(workdir), candidate)
        if reason is None:
            try:
                state, meta = restore(mngr, candidate, abstract_state, shardings, params_only)
            except Exception as e:  # noqa: BLE001 - any failure to read means "not intact"
                reason = f"it does not restore ({type(e).__name__}: {str(e)[:120]})"
            else:
                for skipped in reasons:
                    integrity.warn(f"skipping checkpoint {skipped}")
                return state, meta, candidate
        reasons.append(f"{candidate}: {reason}")
        if quarantine:
            integrity.quarantine(Path(workdir), candidate)
            mngr.reload()
    raise NoIntactCheckpoint(f"checkpoints: none is intact ({'; '.join(reasons)})")


class NoIntactCheckpoint(ValueError):
    """Checkpoints exist but every one failed its check: nothing safe to resume from."""


def _frames(tb) -> list:
    out = []
    while tb is not None:
        out.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return out


# How TensorStore words a failed write (an OCDBT chunk, an OS error code): such an exception
# can reach asyncio's "exception was never retrieved" report with no Python frames at all.
_WRITE_ERROR = re.compile(r"Error writing|os_error_code")


class _SaveTracebacks(logging.Filter):
    """Drops a logged traceback that runs through Orbax (its own error logs, and asyncio's
    "exception was never retrieved" for the save's other writes), and asyncio's report of a
    write error that carries no traceback (raised inside TensorStore)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[1] is None:
            return True
        if record.exc_info[2] is None:
            return not (record.name == "asyncio"
                        and _WRITE_ERROR.search(str(record.exc_info[1])) is not None)
        return not ("orbax" in record.pathname or any(
            "/orbax/" in code.co_filename for code in _frames(record.exc_info[2])))


_QUIET = _SaveTracebacks()
_LOGGERS = ("absl", "asyncio")  # Orbax logs through absl; asyncio reports orphaned failures


def _late_write_callback(unraisable) -> bool:
    """A TensorStore write of a failed save that completes after Orbax closed the event loop
    the save ran on: its callback finds the loop closed. Nothing is left to do with it."""
    return (isinstance(unraisable.exc_value, RuntimeError)
            and str(unraisable.exc_value) == "Event loop is closed"
            and any(code.co_name == "call_soon_threadsafe"
                    for code in _frames(unraisable.exc_traceback)))


@contextlib.contextmanager
def save_errors_raised_not_logged():
    """While a run saves: when a write fails (a full disk), Orbax's background threads log it
    with its traceback several times, and the save's other writes, finishing later, each log or
    print one more; the same error is then raised in the caller's wait, which reports it in one
    line. Those tracebacks are left out. When the run stops on an error, the filters stay (the
    other writes may finish while the process exits); installed again, they do not stack."""
    previous = sys.unraisablehook
    if not getattr(previous, "drops_late_write_callbacks", False):
        def hook(unraisable) -> None:
            if not _late_write_callback(unraisable):
                previous(unraisable)

        hook.drops_late_write_callbacks = True
        sys.unraisablehook = hook
    for name in _LOGGERS:
        logging.getLogger(name).addFilter(_QUIET)  # a no-op when it is already there
    yield  # an error raised here leaves the function: the filters stay
    for name in _LOGGERS:
        logging.getLogger(name).removeFilter(_QUIET)
    sys.unraisablehook = previous
