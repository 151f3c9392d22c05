"""The sliding-window strategy plugin API: base class, registry decorator and thread-safe factory."""
from __future__ import annotations

import abc
import heapq
import inspect
import numbers
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .errors import ConfigError, not_built
from .incidents import WrongAnswer
from .plugins import failure, raised_at, signature_text, source_directory, source_file, where
from .registry import Registry
from .settings import setting
from .types import TrajectoryStatus

STRATEGIES: Registry = Registry("sliding_window strategy", "fully_async.sliding_window")
# LoongSage's names for the same registry and its look-ups, so strategy code written for it imports unchanged.
SLIDING_WINDOW_STRATEGY_REGISTRY = STRATEGIES
get_sliding_window_strategy = STRATEGIES.get
list_sliding_window_strategies = STRATEGIES.names


def register_sliding_window_strategy(name: str):
    """Class decorator: make a `SlidingWindowStrategy` selectable as `fully_async.sliding_window: name`.

    A class that leaves an abstract method (`compute_dispatch_count`) unimplemented is refused here, with
    a TypeError naming it, rather than at the first Dispatch.
    """
    register = STRATEGIES.register(name)

    def decorate(cls):
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
            raise TypeError(f"sliding_window strategy {name!r} ({cls.__module__}.{cls.__qualname__}) does not "
                            f"implement {missing}")
        return register(cls)

    return decorate


#: The most a Dispatch may admit at once, as the pacer reads compute_dispatch_count (clamped to 0 .. this): a larger
#: answer ("no limit") reads as this, so Dispatch's `remaining` and GetState's `capacity` fit the wire's uint64 and
#: a client that reads them as int64.
MAX_DISPATCH_COUNT = 2**63 - 1
#: What compute_dispatch_count may return, as a refusal says it.
DISPATCH_COUNT_ALLOWED = ("an int (a NumPy integer too; not a bool, float, str or None); below 0 reads as 0, above "
                          "2**63 - 1 as 2**63 - 1")


def checked_count(value: Any) -> int:
    """compute_dispatch_count's answer as an int: an int as it is, a NumPy (numbers.Integral) integer converted;
    anything else (a bool, a float even if whole, a str, None) is refused with WrongAnswer, saying what it was."""
    if value.__class__ is int:
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise WrongAnswer(f"returned {value!r:.80} ({type(value).__name__}), not an int: it must return "
                      f"{DISPATCH_COUNT_ALLOWED}")


#: What will_collect may return, as a refusal says it.
GATE_ANSWER_ALLOWED = "True or False (a NumPy bool too; not None, an int, a str or any other object)"


def checked_gate(value: Any) -> bool:
    """will_collect's answer as a bool: True or False as they are, a NumPy bool converted; anything else (None, from
    a forgotten `return`, above all) is refused with WrongAnswer, saying what it was, rather than read as a refusal
    that would hold the group until the next Reset without a word."""
    if value is True or value is False:
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):
        return bool(value)
    raise WrongAnswer(f"returned {value!r:.80} ({kind.__name__}), not a bool: it must return {GATE_ANSWER_ALLOWED}")


class SlidingWindowStrategy(abc.ABC):
    """Decides how many prompt groups may be dispatched now and which complete groups may be collected.

    Subclasses implement `compute_dispatch_count` (abstract); overrides of `on_dispatched` /
    `on_collected` must call `super()` so `_running_count` stays right.
    """

    #: Optional promise that lets the Pacer re-examine gate-refused groups without scanning them all.
    #: Set True only if `will_collect` (a) never accepts a group holding an ABORTED trajectory and
    #: (b) whenever it refuses a complete, non-aborted group, also refuses every such group dispatched
    #: after it (the gate opens oldest-first). False (the default) re-asks every refused group each time.
    #: A subclass that overrides `will_collect` must declare it again: it is not inherited past an override.
    ordered_gate: bool = False

    #: Optional promise: `on_dispatched` reads only each group's `prompt_id` and `seq` (and how many there
    #: are), as the built-ins' does. The Pacer then hands it the in-flight groups themselves instead of a
    #: LoongSage-form copy of each (`trajectories` is then not the pending list). Not inherited past an
    #: override of `on_dispatched`, like `ordered_gate`.
    dispatched_ids_only: bool = True

    #: The strategy's options, declared like the service's own keys (`coda_server.core.settings.Key`, its
    #: path relative to the section): they live under `fully_async.<options_section>` (default: the
    #: registered name with - as _), are validated at start-up and read with `read_options`.
    options: tuple = ()
    options_section: str | None = None
    #: Optional promise: running plus buffered groups never exceed the window C = int(B * (1 + stale_steps)),
    #: so a Collect waiting for more than C groups could never be answered and is refused at once
    #: (INVALID_ARGUMENT). The built-in strategies make it; leave it False if yours may admit beyond C.
    bounded_by_window: bool = False

    def __init__(self, config: Any = None):
        self._running_count = 0

    @abc.abstractmethod
    def compute_dispatch_count(self, buf_qsize: int) -> int:
        """How many groups may be dispatched now, given `buf_qsize` groups in the pipeline buffer."""

    def on_dispatched(self, groups: Sequence[Any]) -> None:
        """Groups were admitted; each has `.prompt_id` (and `.seq`)."""
        self._running_count += len(groups)

    def on_collected(self, prompt_id: str) -> None:
        """A group left the trajectory queue (into the buffer or dropped by a filter)."""
        self._running_count -= 1

    def on_reset(self) -> None:
        """Step-boundary reset: the in-flight registry is cleared."""
        self._running_count = 0

    def will_collect(self, group: Mapping[str, Any]) -> bool:
        """May this complete group (trajectory_id -> trajectory) leave the trajectory queue now?

        Runs under the queue lock and the strategy lock: no I/O, no sleeping, no other locks,
        and the group must not be changed.
        """
        for t in group.values():  # a loop, not any() over a generator: this runs for every group
            if t.status is TrajectoryStatus.ABORTED:  # `is`: statuses are members here (RequestChecks)
                return False
        return True

    # Optional hooks and views for strategies that pace by time and progress (docs/custom-strategies.md).
    # The pacer calls a hook only if the strategy's class overrides it; all run under the strategy lock.

    def on_submitted(self, trajectory: Any) -> None:
        """A trajectory was accepted (before its group may complete); `trajectory.num_tokens` is its
        response length in tokens (0 when the worker sent no token ids)."""

    def on_consumed(self, groups: Sequence[Any]) -> None:
        """The trainer took these groups (`TrajectoryGroup`s) for good: a Collect, or the Ack of a leased one."""

    def on_resume(self, weight_version: int) -> None:
        """Generation resumed with new weights (after `on_reset`, at the start of the next step)."""

    # State that must survive a restart and go into trainer checkpoints (docs/custom-strategies.md,
    # "State across restarts").
    # The pacer saves `state()` in each snapshot of its journal (taken at a step boundary, when nothing is in
    # flight) and, when it recovers, calls `restore()` on a fresh instance before replaying the calls made
    # since, which the hooks hear again; a Restore of a checkpoint calls it too. Keep in it what the strategy
    # learned over past steps; what the replayed hooks rebuild (in-flight groups, _running_count) need not be.

    def state(self) -> Any:
        """The strategy's own state (what it learned), as plain data (dicts with string keys, lists, numbers,
        strings), for the journal's snapshot and a trainer checkpoint; None (the default): nothing to keep."""
        return None

    def restore(self, state: Any) -> None:
        """Take back what `state()` returned, on a fresh instance built from the same configuration (after a
        restart) or on this one (a Restore of a checkpoint, `on_reset()` follows). Default: nothing to take back."""

    # What `attach` sets; the class defaults serve a strategy used alone (monotonic time, an empty buffer).
    _attached_clock: Callable[[], float] = staticmethod(time.monotonic)
    _attached_buffer: "BufferView | None" = None

    def attach(self, clock: Callable[[], float], buffer: "BufferView") -> None:
        """Called once by the pacer that adopts the strategy: `now()` reads `clock` (the pacer's, pinned to
        each recorded change's time while the journal is replayed) and `buffer` views its pipeline buffer.
        An override must call `super().attach(clock, buffer)`."""
        try:
            self._attached_clock = clock
            self._attached_buffer = buffer
        except AttributeError:  # a strategy with __slots__ and no room for them keeps the defaults
            pass

    def now(self) -> float:
        """Seconds on the pacer's clock: monotonic time in the server, simulated time in coda-sim."""
        return self._attached_clock()

    @property
    def buffer(self) -> "BufferView":
        """A read-only view of the pipeline buffer: the complete groups waiting for the trainer."""
        return self._attached_buffer if self._attached_buffer is not None else BufferView(lambda: [])


class BufferView:
    """What the pipeline buffer holds, read-only and live: `len(view)`, and the groups in the order the
    trainer will take them (`iter(view)`, `view.groups()`). Its groups must not be changed."""

    __slots__ = ("_entries",)

    def __init__(self, entries: Callable[[], list]):
        self._entries = entries  # -> the buffer's (priority, group) heap

    def __len__(self) -> int:
        return len(self._entries())

    def groups(self) -> list[Any]:
        """The buffered groups, first to be taken first (sorting costs O(n log n): call it sparingly)."""
        return [group for _, group in heapq.nsmallest(len(self._entries()), self._entries())]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.groups())

    def trajectories(self) -> int:
        return sum(len(group.trajectories) for _, group in self._entries())

    def tokens(self) -> int:
        """Response tokens of every buffered trajectory (as far as the workers sent token ids)."""
        return sum(getattr(t, "num_tokens", 0) for _, group in self._entries() for t in group.trajectories)


def overridden_hook(strategy: Any, name: str) -> Callable[..., Any] | None:
    """`strategy.<name>` if its class defines that optional hook other than the no-op base, else None."""
    method = getattr(type(strategy), name, None)
    if method is None or method is getattr(SlidingWindowStrategy, name, None):
        return None
    return getattr(strategy, name)


def gate_is_ordered(strategy: Any) -> bool:
    """True when `strategy` promises `ordered_gate` for the `will_collect` it actually uses.

    The promise counts only if it was declared by the class that defines that `will_collect` or
    by a subclass of it, so overriding the gate of a built-in does not inherit the built-in's promise.
    """
    return _promised(strategy, "ordered_gate", "will_collect")


def dispatched_ids_only(strategy: Any) -> bool:
    """True when `strategy` promises `dispatched_ids_only` for the `on_dispatched` it actually uses (the
    same rule as `gate_is_ordered`)."""
    return _promised(strategy, "dispatched_ids_only", "on_dispatched")


def _promised(strategy: Any, promise: str, hook: str) -> bool:
    mro = type(strategy).__mro__
    promiser = next((k for k in mro if promise in vars(k)), None)
    definer = next((k for k in mro if hook in vars(k)), None)
    return (promiser is not None and definer is not None and vars(promiser)[promise] is True
            and issubclass(promiser, definer))


class ThreadSafeStrategy(SlidingWindowStrategy):
    """Proxy that runs every strategy call under one re-entrant lock, as `create_strategy` returns it.

    It is a `SlidingWindowStrategy` itself (as LoongSage's proxy is), so `isinstance` checks hold. The lock is
    its own until a pacer adopts the proxy (`run_under`): from then on it is the pacer's lock.
    """

    def __init__(self, strategy: SlidingWindowStrategy, name: str, lock: "threading.RLock | None" = None):
        # No super().__init__(): the state (_running_count included) lives in the wrapped strategy.
        self._strategy = strategy
        self.name = name
        self.lock = lock if lock is not None else threading.RLock()
        self._adopted = lock is not None

    def run_under(self, lock: Any) -> None:
        """Take `lock` (the adopting pacer's) for every call from now on, so that holding the pacer's lock is
        holding the strategy's, as every hook requires. A proxy serves one pacer: a second one is refused."""
        if self._adopted and lock is not self.lock:
            raise ValueError(f"strategy {self.name!r} already runs under another pacer's lock; give each pacer a "
                             f"strategy of its own (create_strategy)")
        self.lock, self._adopted = lock, True

    def attach(self, clock: Callable[[], float], buffer: "BufferView") -> None:
        with self.lock:
            self._strategy.attach(clock, buffer)

    @property
    def wrapped(self) -> SlidingWindowStrategy:
        return self._strategy

    @property
    def ordered_gate(self) -> bool:  # type: ignore[override]
        return gate_is_ordered(self._strategy)

    @property
    def running_count(self) -> int:
        with self.lock:
            return self._strategy._running_count

    def compute_dispatch_count(self, buf_qsize: int) -> int:
        with self.lock:
            return checked_count(self._strategy.compute_dispatch_count(buf_qsize))

    def on_dispatched(self, groups: Iterable[Any]) -> None:
        with self.lock:
            self._strategy.on_dispatched(groups)

    def on_collected(self, prompt_id: str) -> None:
        with self.lock:
            self._strategy.on_collected(prompt_id)

    def on_reset(self) -> None:
        with self.lock:
            self._strategy.on_reset()

    def will_collect(self, group: Mapping[str, Any]) -> bool:
        with self.lock:
            return checked_gate(self._strategy.will_collect(group))

    def on_submitted(self, trajectory: Any) -> None:
        with self.lock:
            self._strategy.on_submitted(trajectory)

    def on_consumed(self, groups: Sequence[Any]) -> None:
        with self.lock:
            self._strategy.on_consumed(groups)

    def on_resume(self, weight_version: int) -> None:
        with self.lock:
            self._strategy.on_resume(weight_version)

    def state(self) -> Any:
        with self.lock:
            return self._strategy.state()

    def restore(self, state: Any) -> None:
        with self.lock:
            self._strategy.restore(state)

    def now(self) -> float:
        return self._strategy.now()  # the wrapped strategy is the one a pacer binds its clock to

    @property
    def buffer(self) -> "BufferView":
        return self._strategy.buffer

    def __getattr__(self, item: str) -> Any:
        # Anything else (custom helpers, attributes) reads through to the strategy, under the lock.
        with self.lock:
            return getattr(self._strategy, item)


def create_strategy(config: Any, name: str | None = None, lock: Any = None) -> ThreadSafeStrategy:
    """Build the strategy `config.fully_async.sliding_window` (or `name`) names, wrapped thread-safe (under
    `lock` when given: a pacer passes its own).

    `config` is any object with `config.data_sources[0].num_prompts_per_step`,
    `config.fully_async.stale_steps` and `.get()`, e.g. an OmegaConf DictConfig. Every refusal is a ConfigError (a
    ValueError) in one line naming the key, the strategy and its file, so start-up stops before the state directory is
    touched, not at the first Dispatch: an unknown name (listing the registered ones), a name two modules register
    and a plugin that is no SlidingWindowStrategy (`check_strategy`); an __init__ that raises or does not call
    super().__init__(); a compute_dispatch_count(0) that raises or returns no int (asked once here: it must be free of
    side effects).
    """
    if name is None:
        name = setting(config, "fully_async.sliding_window")
    cls = check_strategy(name)
    subject = f"fully_async.sliding_window = {name!r}"
    remedy = f"fix it or choose another (registered: {', '.join(STRATEGIES.names())})"
    try:
        strategy = cls(config)
    except ConfigError:  # already names the key and what is allowed (e.g. read_options)
        raise
    except Exception as exc:
        raise not_built(subject, "the strategy", exc, f"fix the strategy (at {_at(cls, exc)}) or choose another "
                                                      f"(registered: {', '.join(STRATEGIES.names())})") from None
    try:
        strategy._running_count
    except AttributeError:
        raise ConfigError(f"{subject}: the strategy {where(cls)} was built, but its __init__ does not call "
                          f"super().__init__(config), which sets _running_count: call it first in __init__") from None
    try:
        checked_count(strategy.compute_dispatch_count(0))
    except WrongAnswer as exc:
        raise ConfigError(f"{subject}: the strategy {where(cls)}: compute_dispatch_count(0) {exc}; {remedy}") from None
    except Exception as exc:
        raise ConfigError(f"{subject}: the strategy {where(cls)}: compute_dispatch_count(0) raised "
                          f"{failure(exc, source_directory(cls))} (asked once at start-up; it must not raise, nor "
                          f"change anything); {remedy}") from None
    return ThreadSafeStrategy(strategy, name, lock)


# What a sliding-window strategy must be, as a refusal says it.
STRATEGY_API = ("a class derived from coda_server.SlidingWindowStrategy, built with (config) (its __init__ calling "
                "super().__init__(config)), whose compute_dispatch_count(self, buf_qsize) returns an int")


def check_strategy(name: Any, key: str = "fully_async.sliding_window") -> type:
    """The class registered as `name`, checked before anything is built, as `check_replay_strategy` checks a buffer
    replay strategy: ConfigError in one line, naming `key`, for an unknown name, a name two modules register (both
    files named), and a plugin that is not a SlidingWindowStrategy class (its file named)."""
    plugin = STRATEGIES.chosen(name, key)
    if not (isinstance(plugin, type) and issubclass(plugin, SlidingWindowStrategy)):
        if inspect.isfunction(plugin) or inspect.ismethod(plugin) or inspect.isbuiltin(plugin):
            what = f"is a function taking {signature_text(plugin)}, not a class"
        elif isinstance(plugin, type):
            what = "is a class not derived from SlidingWindowStrategy"
        else:
            what = f"is a {type(plugin).__name__} object, not a class"
        raise ConfigError(f"{key} = {name!r}: the strategy {where(plugin)} {what}; a sliding_window strategy is "
                          f"{STRATEGY_API} (docs/custom-strategies.md)")
    return plugin


def _at(cls: type, exc: BaseException) -> str:
    """Where in the strategy's code `exc` was raised (its file and line), else its file."""
    return raised_at(exc, source_directory(cls)) or source_file(cls) or where(cls)


def options_section(cls: type, name: str) -> str:
    """The section under `fully_async` holding the options a strategy class declares (its `options`):
    `options_section` on the class, else its registered name with - as _ (latency-aware: latency_aware)."""
    return getattr(cls, "options_section", None) or name.replace("-", "_")


def window_size(config: Any) -> int:
    """C = int(B * (1 + stale_steps)): groups that may be running or buffered at once."""
    num_prompts = int(config.data_sources[0].num_prompts_per_step)
    stale_steps = float(config.fully_async.stale_steps)
    return int(num_prompts * (1 + stale_steps))
