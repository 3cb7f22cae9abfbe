"""`jdp.fit`'s resume guard: settings that change the numerics or the data order are refused (FitError) unless
`allow_config_change`, by run.json (`jdp.record`) and by each checkpoint's fingerprint (docs/checkpoints.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jdp import distributed as distributed_lib
from jdp import record as record_lib
from jdp.errors import FitError

VERSION = 2  # of the fingerprint; one of version 1 (its settings' hash held the sync flags) is compared but that hash
RESULTS_TIMEOUT_S = 120.0  # process 0 reads run.json and compares; the others wait for its answer
_FIT_PARTS = "model, loss, data, global batch, sync strategy or guarded options" + record_lib.BY_HASH
_SETTINGS = "the config's guarded keys" + record_lib.BY_HASH  # trainer.run's `settings` (the CLI's)


def fingerprint(fit_record: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint carries of the settings its run was saved under (JSON)."""
    guarded = record_lib.guarded(fit_record, with_settings=False)
    first, later = guarded.pop(record_lib.FIRST), guarded.pop(record_lib.LATER)  # compared to a tolerance, not hashed
    settings = fit_record.get("settings")
    return {"version": VERSION, "steps": fit_record["steps"], "fit": record_lib.hashed(guarded),
            "settings": record_lib.hashed(settings) if settings else None, "optimizer": first, "schedule": later}


def fingerprint_changes(saved: Any, new: dict[str, Any]) -> list[str] | None:
    """What differs from a checkpoint's fingerprint (hashes by name); None for none, or one of another version."""
    if not isinstance(saved, dict) or saved.get("version") not in (1, VERSION):
        return None

    def parts(fp: dict[str, Any], settings: bool) -> dict[str, Any]:
        return {**({_SETTINGS: fp["settings"]} if settings else {}), _FIT_PARTS: fp["fit"],
                record_lib.FIRST: fp["optimizer"], record_lib.LATER: fp["schedule"]}

    both = saved["version"] == VERSION and bool(saved.get("settings")) and bool(new["settings"])
    return record_lib.listed_changes(parts(saved, both), parts(new, both), saved.get("steps") != new["steps"])


def refusal(workdir: Path, listed: list[str]) -> FitError:
    return FitError(f"{workdir} holds a run with other settings that change the numerics or the data order "
                    f"({'; '.join(listed)}); use a new workdir, or pass allow_config_change=True "
                    "(--config.checkpoint.allow_config_change=True)")


class Guard:
    """One resume's check: `check_record` (run.json) before the restore, `check_checkpoint` on each checkpoint read,
    then `restored(step)`. Every process calls each; process 0 reads and compares and broadcasts its answer."""

    def __init__(self, fit_record: dict[str, Any], workdir: Path, allow_change: bool,
                 warn: Callable[[str], None]) -> None:
        self.fit_record, self.workdir, self.allow_change, self.warn = fit_record, workdir, allow_change, warn
        self.record_steps: int | None = None  # run.json's steps, where it holds a usable record
        self.unreadable: str | None = None  # why run.json cannot be read
        self.warned = False  # a change allowed has been said
        self._after: dict[int, dict[str, Any]] = {}  # step -> what `_compare` found of its checkpoint

    def check_record(self) -> None:
        """Refuses a resume whose settings differ from run.json's (each differing setting named)."""
        found: tuple[list[str], int | None, str | None, bool] = ([], None, None, False)
        if jax.process_index() == 0:
            try:
                old = record_lib.read(self.workdir)
            except FitError as e:  # decided by the checkpoint's fingerprint; without one, refused (below)
                old, found = None, ([], None, str(e), False)
            if old is not None:
                unrecorded = bool(self.fit_record.get("settings")) and not old.get("settings")
                found = (record_lib.changes(old, self.fit_record), old["steps"], None, unrecorded)
        changed, self.record_steps, self.unreadable, unrecorded = json.loads(
            distributed_lib.broadcast("record checked", json.dumps(found), RESULTS_TIMEOUT_S))
        if unrecorded:  # a workdir of a jdp from before run.json held the caller's settings
            self.warn(f"{self.workdir / record_lib.RECORD_FILE} holds no record of the config's keys (an older jdp "
                      "wrote it): this resume checks fit's own settings only, and records the keys for the next")
        if changed and not self.allow_change:
            raise refusal(self.workdir, changed)
        self._allowed(changed)

    def check_checkpoint(self, step: int, data: dict[str, Any]) -> None:
        """Refuses to resume checkpoint `step` (its data item `data`, intact) under other settings than its
        fingerprint's; without a fingerprint, under a run.json that cannot be read."""
        answer = self._compare(step, data.get("fingerprint")) if jax.process_index() == 0 else {}
        answer = json.loads(distributed_lib.broadcast("checkpoint settings checked", json.dumps(answer),
                                                      RESULTS_TIMEOUT_S))
        if answer.get("refuse"):
            raise FitError(answer["refuse"])
        self._after[step] = answer

    def _compare(self, step: int, saved: Any) -> dict[str, Any]:
        where = self.workdir / "checkpoints" / str(step)
        changed = fingerprint_changes(saved, fingerprint(self.fit_record))
        if changed is None:
            if self.unreadable:  # nothing left to check the resume against
                return {"refuse": self.unreadable}
            if self.record_steps is None:
                what = ("no fingerprint of its settings (a jdp from before them saved it)" if saved is None else
                        f"a fingerprint of its settings of another version ({saved.get('version')!r}) than this "
                        f"jdp's ({VERSION})" if isinstance(saved, dict) else "no fingerprint this jdp reads")
                return {"warn": f"checkpoint {where} carries {what} and {self.workdir / record_lib.RECORD_FILE} "
                                "holds no usable record: the resume is unchecked"}
            return {}
        differ = [f"the settings differ from those checkpoint {where} was saved under: {'; '.join(changed)}"]
        if changed and not self.allow_change:
            return {"refuse": str(refusal(self.workdir, differ))}
        return {"steps": saved.get("steps"), "allowed": differ if changed else None}

    def restored(self, step: int) -> int:
        """After the restore of checkpoint `step`: its warning, if any; the steps the workdir's run was given."""
        found = self._after.get(step, {})
        if found.get("warn"):
            self.warn(found["warn"])
        self._allowed(found.get("allowed"))
        return self.record_steps or found.get("steps") or self.fit_record["steps"]

    def _allowed(self, changed: list[str] | None) -> None:
        if changed and not self.warned:  # run.json and the checkpoint name one change: one line
            self.warn(f"resuming {self.workdir} with other settings (allow_config_change): {'; '.join(changed)}")
            self.warned = True
