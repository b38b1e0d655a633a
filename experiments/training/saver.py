"""Asynchronous checkpoint saves for the training loop, each sealed (its manifest written) once
Orbax has finished it, and a failed write turned into the one line the run stops with."""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax

from experiments.cli.config import error_line
from experiments.training import checkpoint as ckpt
from experiments.training import integrity
from experiments.training.guards import WriteFailed


class Saver:
    """Asynchronous saves, each sealed as soon as Orbax has finished writing it (a checkpoint
    without its manifest is not resumed from), and a failed write turned into one line."""

    def __init__(self, mngr, workdir: Path):
        self.mngr, self.workdir = mngr, workdir
        self.pending: int | None = None  # the step being written, not yet sealed

    def save(self, step: int, state: dict, meta: dict) -> None:
        self._seal(step)  # the previous save is long done by now
        try:
            ckpt.save(self.mngr, step, state, meta)
        except Exception as e:  # noqa: BLE001 - whatever Orbax raises, the write did not happen
            raise WriteFailed(self.stopped(step, reason(e), writing=step)) from None
        self.pending = step

    def seal_if_written(self, step: int) -> None:
        """Seal the pending save if it has finished (never waits for it)."""
        if self.pending is not None and not self.mngr.is_saving_in_progress():
            self._seal(step)

    def finish(self, step: int) -> None:
        self._seal(step)

    def close(self) -> None:
        """On the way out, also after an error: seal a save that did finish, and close the
        manager. A failed write is reported once (by the save, the seal or finish that met it),
        so it is not raised again here, nor does it hide the error the run stops with."""
        try:
            self._seal(None)
        except WriteFailed:
            pass
        try:
            self.mngr.close()
        except Exception:  # noqa: BLE001 - Orbax raises the same failed write once more
            pass

    def _seal(self, step: int | None) -> None:
        writing, self.pending = self.pending, None
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background write failed
            raise WriteFailed(self.stopped(step, reason(e), writing=writing)) from None
        if jax.process_index() == 0:
            integrity.seal(self.workdir, self.mngr.all_steps())

    def stopped(self, step: int | None, reason: str, writing: int | None = None) -> str:
        """The one line a failed write stops the run with."""
        what = f"checkpoint {writing}" if writing is not None else "the run's files"
        intact = [s for s in sorted(self.mngr.all_steps(), reverse=True)
                  if integrity.problem(self.workdir, s) is None]
        resume = (f"checkpoint {intact[0]} is intact: make room, then --resume continues "
                  f"from it" if intact else "no checkpoint is intact: make room, then --resume "
                  "trains again from step 0")
        return f"{what} could not be written ({reason}); stopped at step {step}; {resume}"


def reason(e: Exception) -> str:
    """An OS error out of Orbax's (long, nested) message, else its first line, shortened."""
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return f"{os.strerror(int(code.group(1)))}, errno {code.group(1)}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}, errno {e.errno}" + (f", {e.filename}" if e.filename else "")
    return error_line(e, 160)
