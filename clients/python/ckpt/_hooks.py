"""Preemption: signal handlers that only raise a flag; the training loop acts on it.

A Python signal handler runs in the main thread between two bytecodes: possibly in the
middle of a save, a collective, or while the logging module holds its lock. So the
handler records the signal and does nothing else. `Checkpointer.maybe_save`, called every
step, is the safe point: it finishes the save in flight or takes one last blocking
checkpoint, then exits the way the signal would have (`exit_for`).

Many ranks must take that last checkpoint at the same step, although the signal reaches
them at different moments (or only some of them: one node of several is preempted).
`StopPlan` agrees through torch.distributed's key-value store, without a collective: the
first rank to see a signal, at its maybe_save of step s, publishes "stop at step s + 1"
(compare-and-set: the first proposal wins); every rank polls the key at each maybe_save
(one small store request). When the loop runs a collective every step (DDP, FSDP, an
all-reduce of the loss), no rank can finish step s + 1 before the publisher has trained
it, so every rank has seen the key by its maybe_save of step s + 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from ckpt._pending import PendingSave

log = logging.getLogger("ckpt")

DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)


class _Watcher:
    """The process-wide handlers, shared by every Checkpointer that asked for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._prev: dict[int, Any] = {}
        self._users: dict[int, int] = {}
        self.signum: int | None = None

    def _handler(self, signum: int, frame: object) -> None:
        # No I/O, no locks, no logging: this may interrupt any of them.
        if self.signum is None:
            self.signum = signum

    def install(self, signals: Iterable[int]) -> None:
        check_main_thread()
        with self._lock:
            for s in signals:
                if self._users.get(s, 0) == 0:
                    self._prev[s] = signal.signal(s, self._handler)
                self._users[s] = self._users.get(s, 0) + 1

    def uninstall(self, signals: Iterable[int]) -> bool:
        """Release `signals`; True when no Checkpointer holds handlers any more."""
        with self._lock:
            for s in signals:
                n = self._users.get(s, 0) - 1
                if n > 0:
                    self._users[s] = n
                    continue
                self._users.pop(s, None)
                prev = self._prev.pop(s, signal.SIG_DFL)
                self._restore(s, prev)
            if not self._users:
                self.signum = None
                return True
            return False

    def _restore(self, s: int, prev: Any) -> None:
        if signal.getsignal(s) != self._handler:
            return  # someone installed another handler since; leave theirs
        try:
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        except ValueError:  # not the main thread (a close() from a worker thread)
            log.warning("could not restore the handler of signal %d outside the main thread", s)

    def previous(self, s: int) -> Any:
        return self._prev.get(s, signal.SIG_DFL)


_watcher = _Watcher()


def check_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "save_on_preemption=True installs signal handlers, which Python allows only "
            "in the main thread: create the Checkpointer there"
        )


def install(signals: Iterable[int]) -> None:
    _watcher.install(signals)


def uninstall(signals: Iterable[int]) -> bool:
    return _watcher.uninstall(signals)


def redeliver(signum: int) -> None:
    """Raise `signum` again now that the handler from before ours is back.

    A signal we noted but never acted on (the loop ended or failed before its next
    maybe_save) must not be lost: with the default disposition the process ends here, as
    it would have when the signal first came.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    signal.raise_signal(signum)


def received() -> int | None:
    """The first preemption signal this process received, or None."""
    return _watcher.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_for(signum: int) -> NoReturn:
    """Leave the process the way `signum` would have, once the last checkpoint is safe.

    The handler that was there before ours is put back. A Python handler (a framework's)
    is re-raised to it, so it does what it always did; if it returns, or the disposition
    was the default one, the process exits with status 128 + signum (143 for SIGTERM, what
    a shell reports for a process the signal killed) through SystemExit, so that `finally`
    and `with` blocks, atexit handlers (process groups, loggers) run and output is flushed,
    which a real death by signal would skip.
    """
    prev = _watcher.previous(signum)
    with _watcher._lock:
        _watcher._restore(signum, prev)
    if callable(prev) and threading.current_thread() is threading.main_thread():
        signal.raise_signal(signum)  # runs the previous Python handler right here
    sys.stdout.flush()
    raise SystemExit(128 + signum)


@dataclasses.dataclass(frozen=True)
class Stop:
    """When and how the job stops: the same on every rank."""

    step: int  # the first maybe_save at or after this step takes the last checkpoint
    signum: int
    # A save was in flight when the signal was seen: once it commits it is the last
    # checkpoint (no second save). None: take one at `step`.
    inflight: int | None
    rank: int  # who saw the signal first

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Stop:
        d = json.loads(text)
        return cls(int(d["step"]), int(d["signum"]), d.get("inflight"), int(d.get("rank", 0)))


class StopPlan:
    """Agree on the step of the last checkpoint (see the module docstring).

    store: torch.distributed's store shared by every rank (None: one process, or ranks
    that cannot agree; then a rank stops at the step where it sees its own signal).
    """

    def __init__(self, store: Any, key: str, rank: int):
        self.store = store
        self.key = key
        self.rank = rank
        self.stop: Stop | None = None

    def poll(self, step: int, signum: int | None, inflight: int | None) -> Stop | None:
        """Called at every maybe_save; the Stop once this step is the one to stop at."""
        if self.stop is None:
            if signum is not None:
                self.stop = self._propose(Stop(step, signum, inflight, self.rank))
            elif self.store is not None:
                self.stop = self._learn()
        if self.stop is not None and step >= self.stop.step:
            return self.stop
        return None

    def _propose(self, mine: Stop) -> Stop:
        if self.store is None:
            return mine
        mine = dataclasses.replace(mine, step=mine.step + 1)
        try:
            won = self.store.compare_set(self.key, "", mine.to_json())
            return Stop.from_json(won)
        except Exception as e:  # noqa: BLE001 - the store is gone: stop alone, now
            log.warning(
                "rank %d: could not agree on the last checkpoint's step through the store (%s); "
                "stopping at step %d alone",
                self.rank,
                e,
                mine.step - 1,
            )
            return dataclasses.replace(mine, step=mine.step - 1)

    def _learn(self) -> Stop | None:
        try:
            if self.store.check([self.key]):
                return Stop.from_json(self.store.get(self.key))
        except Exception as e:  # noqa: BLE001 - keep training; this rank's own signal still works
            log.debug("rank %d: polling the preemption key failed: %s", self.rank, e)
        return None


def last_checkpoint(
    *,
    job: str,
    rank: int,
    stop: Stop,
    step: int,
    inflight: PendingSave | None,
    save: Callable[[], PendingSave],
    exit_after: bool,
) -> PendingSave:
    """A Checkpointer's safe point after a signal: finish the save in flight or take one
    last blocking checkpoint (`save`) at `step`; then exit as the signal asked, or return.

    Every rank decides the same way: `stop` is shared, the saves issued so far are the
    same on every rank (they follow the steps), and a save commits or aborts for all ranks
    at once.
    """
    name = signal_name(stop.signum)
    log.warning(
        "job %s rank %d: %s received (rank %d saw it first); taking the last checkpoint at step %d",
        job,
        rank,
        name,
        stop.rank,
        step,
    )
    final = inflight
    if final is not None:
        final.join()
        failure = final.take_unseen_error() or final.error
        if failure is not None:
            log.error(
                "job %s: the save of step %d failed (%s); taking a new one at step %d",
                job,
                final.step,
                failure,
                step,
            )
            final = None
        elif stop.inflight is None and final.step != step:
            final = None  # nothing was in flight when the signal came: save this step
    if final is None:
        final = save()
    result = final.wait()
    log.warning(
        "job %s rank %d: last checkpoint: step %d committed (%s); %s",
        job,
        rank,
        final.step,
        result.path if result is not None else "-",
        f"exiting as {name} asks" if exit_after else "stop the loop now",
    )
    if exit_after:
        exit_for(stop.signum)
    return final
