"""The configuration schema: every key the service reads, once (type, default, range, doc line), and the keys it accepts unused.

To add a key: add one `Key` to SCHEMA below (dotted path, kind, default, bounds, one-line doc), put it with
its comment into conf/default.yaml (and coda_server/conf/default.yaml, the same file) and give it a row in
docs/configuration.md; tests/test_config_schema.py fails until the three agree. Read it with
`setting(config, "section.key")` (typed, the declared default when the configuration lacks it), never with
a default of your own. A strategy or a filter declares its options the same way, as `options` on its class
(see LatencyAwareStrategy); they are validated at start-up like the keys here. A key LoongSage defines that
the service does not read is declared `unused=True` (and listed in docs/coming-from-loongsage.md); anything
else under the service's sections stops start-up, naming the closest known key.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from .errors import ConfigError
from .journal import FSYNC_POLICIES

# The sections the service reads; unknown keys under them are refused. `data_sources` entries are checked
# against the `data_source` keys.
SECTIONS = ("fully_async", "data_source", "trainer", "rollout", "server")
_NOT_GIVEN = object()


@dataclass(frozen=True)
class Key:
    """One configuration key: where it is, what it holds, its default and what it means."""

    path: str  # dotted, e.g. "server.max_wait_seconds"; data_source.* keys apply to each data_sources entry
    kind: str  # int | number | bool | str | choice | list | mapping | any
    default: Any
    doc: str  # one line
    low: Optional[float] = None  # inclusive bound
    high: Optional[float] = None  # inclusive bound
    above: Optional[float] = None  # exclusive lower bound
    choices: tuple = ()
    nullable: bool = False  # null is allowed too
    allowed: str = ""  # what a refusal says is allowed; derived from kind and bounds when empty
    check: Optional[Callable[[Any], bool]] = None  # a further condition on a value of the right kind
    unused: bool = False  # a LoongSage key the service accepts and does not read
    free_form: bool = False  # a mapping whose own keys are not checked (e.g. LoongSage's sglang_args)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with `value` for this key (what is allowed), or None."""
        if self.unused or (value is None and self.nullable):
            return None
        ok = {
            "int": _is_int(value),
            "number": _is_number(value) and math.isfinite(value),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
            "choice": value in self.choices,
            "list": isinstance(value, Sequence) and not isinstance(value, str) or _is_list_config(value),
            "mapping": isinstance(value, Mapping) or hasattr(value, "items"),
            "any": True,
        }[self.kind]
        if ok and self.kind in ("int", "number"):
            ok = ((self.low is None or value >= self.low) and (self.high is None or value <= self.high)
                  and (self.above is None or value > self.above))
        if ok and self.check is not None:
            ok = bool(self.check(value))
        return None if ok else self.allowed or self._derived_allowed()

    def _derived_allowed(self) -> str:
        if self.kind == "bool":
            return "must be true or false"
        if self.kind == "choice":
            return f"allowed: {', '.join(map(str, self.choices))}"
        if self.kind in ("int", "number"):
            what = "an integer" if self.kind == "int" else "a finite number"
            if self.above is not None and self.high is not None:
                return f"must be {what} in ({self.above:g}, {self.high:g}]"
            if self.low is not None and self.high is not None:
                return f"must be {what} from {self.low:g} to {self.high:g}"
            if self.low is not None:
                return f"must be {what} >= {self.low:g}"
            if self.above is not None:
                return f"must be {what} > {self.above:g}"
            return f"must be {what}"
        return {"str": "must be a string", "list": "must be a list", "mapping": "must be a mapping"}.get(
            self.kind, "invalid")


def parse_file_mode(value: Any) -> Optional[int]:
    """A file mode from an octal string ("0660", "0o660", "660") or an int (YAML 1.1 reads 0660 as 432); None if invalid."""
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if not digits or any(c not in "01234567" for c in digits):
            return None
        mode = int(digits, 8)
    elif _is_int(value):
        mode = value
    else:
        return None
    return mode if 0 <= mode <= 0o777 else None


def parse_host_port(value: Any) -> Optional[tuple[str, int]]:
    """'host:port' (IPv6 as '[::1]:9464') -> (host, port), port in 0..65535; None when it is not one."""
    if not isinstance(value, str):
        return None
    host, sep, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        return None
    return host, int(port)


def _count(path: str, default: int, doc: str, low: int = 1, allowed: str = "") -> Key:
    return Key(path, "int", default, doc, low=low, allowed=allowed)


def _seconds(path: str, default: float, doc: str, allowed: str = "must be a finite number >= 0") -> Key:
    return Key(path, "number", default, doc, low=0, allowed=allowed)


def _listener(path: str, default: str, doc: str, example: str, empty: str) -> Key:
    """An optional listener's host:port ("" `empty`), its port checked here: gRPC and the HTTP server would take
    a port past 65535 modulo 65536."""
    return Key(path, "str", default, doc, nullable=True,
               check=lambda value: value == "" or parse_host_port(value) is not None,
               allowed=f"must be host:port with a port in 0..65535, e.g. {example}, or \"\" {empty}")


def _path(path: str, default: str, doc: str, allowed: str = "must be a string (\"\" for none)") -> Key:
    return Key(path, "str", default, doc, nullable=True, allowed=allowed)


# ------------------------------------------------------------------------------------------------ the schema

SCHEMA: tuple[Key, ...] = (
    # fully_async: pacing between generation and training (LoongSage's section)
    Key("fully_async.enable", "bool", False, "LoongSage's fully-async switch; the service paces either way"),
    Key("fully_async.sliding_window", "any", "no-window", "Pacing strategy, by registered name (checked against the registry)"),
    Key("fully_async.stale_steps", "number", 0, "Steps of staleness the window allows; C = int(B x (1 + stale_steps))",
        low=0, allowed="must be a finite number >= 0"),
    _seconds("fully_async.gate_recheck_seconds", 1.0, "Seconds between re-examinations of groups the gate refused",
             allowed="must be a finite number >= 0 (0: re-examine refused groups on state changes only)"),
    # data_source: defaults every data_sources entry inherits
    Key("data_source.name", "any", "default", "Free-form label of the data source"),
    _count("data_source.num_prompts_per_step", 64, "B: prompt groups the trainer consumes per step",
           allowed="must be an integer >= 1"),
    _count("data_source.num_trajectories_per_prompt", 8, "N: trajectories per prompt (the group size)",
           allowed="group size must be an integer >= 1"),
    Key("data_source.dataset.buffer_replay_strategy", "any", None,
        "Order restored groups are re-offered in, by registered name (null: fifo)", nullable=True),
    Key("data_sources", "any", ["${data_source}"], "The data sources, by position (ds_index); each inherits data_source"),
    # trainer, rollout
    _count("trainer.mini_batch_size", 64, "M: trajectories per trainer fetch", allowed="must be an integer >= 1"),
    Key("rollout.partial", "bool", False, "Default Reset mode: true = ABORT (partial rollout), false = WAIT"),
    Key("rollout.continue_restored", "bool", True, "Keep restored groups and re-offer them first on Dispatch"),
    Key("rollout.filter", "any", {"status": None}, "Group filters, LoongSage's mapping form (validated by the filters)"),
    Key("rollout.train_on_failed", "bool", False, "Buffer (true) or quarantine (false) a group still holding a FAILED trajectory"),
    # server: the service itself
    Key("server.address", "any", "127.0.0.1:50051", "host:port of the gRPC listener (checked with server.uds_path)"),
    Key("server.custom_strategy_dirs", "list", [], "Directories whose modules register custom strategies",
        check=lambda dirs: all(isinstance(directory, str) and directory for directory in dirs),
        allowed="must be a list of directory paths, e.g. [/opt/coda/strategies] (a single path too goes in [ ])"),
    Key("server.reflection", "bool", False, "Serve gRPC server reflection"),
    # gRPC's channel arguments are C ints; below 64 KiB the small calls' messages may not fit.
    Key("server.max_message_bytes", "int", 67108864, "Largest request or response message, in bytes",
        low=65536, high=2**31 - 1, allowed="must be an integer from 65536 (64 KiB) to 2147483647 (gRPC's largest)"),
    Key("server.allocator_retain_bytes", "int", 8388608, "Freed memory the C allocator keeps for the next large message",
        low=0, high=2**31 - 1, allowed="must be an integer from 0 (the allocator's defaults) to 2147483647"),
    Key("server.event_loop", "choice", "auto", "The event loop of the coda-server process",
        choices=("auto", "asyncio", "uvloop"),
        allowed="must be auto (uvloop when installed, else asyncio), asyncio or uvloop"),
    _seconds("server.max_wait_seconds", 600.0, "Upper bound on any long-poll, in seconds"),
    _seconds("server.shutdown_grace_seconds", 10.0, "On SIGTERM: seconds in-flight RPCs get to finish"),
    _seconds("server.abort_wait_seconds", 30.0, "Seconds an ABORT-mode Reset without a wait waits for the partial "
             "trajectories"),
    _seconds("server.collect_stall_warning_seconds", 60.0, "Seconds a Collect may wait while dispatch admits nothing "
             "before a warning is logged (0: never)"),
    _count("server.request_id_cache_size", 65536, "Recent request_ids remembered per RPC"),
    _count("server.remembered_answer_bytes", 268435456, "Bytes of trajectories remembered Collect and Reset answers may hold",
           low=0, allowed="must be an integer >= 0 (0: no cap)"),
    _count("server.remembered_generations", 16, "Past reset generations whose prompt ids are remembered"),
    _count("server.max_collect_groups", 65536, "Largest num_groups of one Collect"),
    _count("server.max_dispatch_candidates", 65536, "Largest number of candidates of one Dispatch"),
    _count("server.max_submit_trajectories", 65536, "Largest number of trajectories of one Submit"),
    _count("server.max_id_length", 512, "Longest prompt_id / trajectory_id, in characters"),
    _path("server.state_dir", "./coda-state", "Directory of the durable state (\"\": memory only)",
          allowed="must be a directory path, or \"\" for memory only"),
    Key("server.fsync", "choice", "normal", "When the journal forces writes to disk", choices=tuple(FSYNC_POLICIES)),
    _seconds("server.inflight_lease_seconds", 300.0, "Seconds a dispatched group may go without a Submit",
             allowed="must be a finite number >= 0 (0: no lease)"),
    _seconds("server.worker_liveness_seconds", 20.0, "Seconds a watched worker may stay silent before its groups are released",
             allowed="must be a finite number >= 0 (0: off)"),
    Key("server.trainer_liveness_seconds", "number", None, "Seconds a trainer may stay silent before its leases that "
        "end with its silence go back to the buffer (null: server.worker_liveness_seconds)", low=0, nullable=True,
        allowed="must be a finite number >= 0 (0: off), or null for server.worker_liveness_seconds"),
    _count("server.max_buffered_groups", 0, "Cap on complete groups in the buffer (0: none)", low=0,
           allowed="must be an integer >= 0 (0: no cap)"),
    _count("server.max_held_bytes", 0, "Cap on bytes of trajectories held (0: none)", low=0,
           allowed="must be an integer >= 0 (0: no cap)"),
    _count("server.max_watch_streams", 16384, "WatchControl streams open at once"),
    _count("server.watch_queue_events", 1024, "Control events a watch stream may fall behind"),
    _count("server.max_concurrent_rpcs", 16384, "Submit and Dispatch-without-wait calls in progress at once"),
    _count("server.step_reports_kept", 32, "Step reports kept for GetState"),
    _count("server.incidents_kept", 32, "Incidents kept for GetState"),
    Key("server.log_level", "str", "INFO", "Log level",
        check=lambda value: value.upper() in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        allowed="must be DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    Key("server.log_format", "choice", "text", "Log line format", choices=("text", "json"),
        allowed="must be text or json"),
    Key("server.log_rpcs", "bool", True, "One log line per RPC"),
    _listener("server.metrics_address", "127.0.0.1:9464", "host:port of the /metrics listener (\"\": off)",
              "127.0.0.1:9464", "to disable metrics"),
    Key("server.metrics_require_token", "bool", False, "A scrape must send the bearer token"),
    Key("server.metrics_tls", "bool", False, "Serve /metrics over HTTPS"),
    _count("server.metrics_max_clients", 100, "Client ids counted under their own name in the metrics"),
    _count("server.max_waiting_calls", 16384, "Dispatch long-polls in progress at once"),
    _count("server.max_waiting_collects", 1024, "Collect long-polls in progress at once"),
    _seconds("server.client_rate_limits.dispatch_per_second", 0.0, "Dispatch calls per second per client (0: no limit)",
             allowed="must be a finite number >= 0 (a rate of 0: no limit)"),
    _seconds("server.client_rate_limits.submit_per_second", 0.0, "Submit calls per second per client (0: no limit)",
             allowed="must be a finite number >= 0 (a rate of 0: no limit)"),
    Key("server.client_rate_limits.burst", "number", 10.0, "Calls a client may make at once above its rate",
        low=1, allowed="must be a finite number >= 1 (the calls a client may make at once, the token bucket's size)"),
    _path("server.auth_token_file", "", "File holding the bearer token (\"\": $CODA_TOKEN or none)"),
    _path("server.tls.cert_file", "", "Server certificate chain (PEM)", allowed="must be a path string (\"\" for none)"),
    _path("server.tls.key_file", "", "Server private key (PEM)", allowed="must be a path string (\"\" for none)"),
    _path("server.tls.client_ca_file", "", "CA bundle client certificates must chain to (mutual TLS)",
          allowed="must be a path string (\"\" for none)"),
    _path("server.uds_path", "", "Unix domain socket to listen on as well (\"\": none)"),
    Key("server.uds_mode", "any", "0660", "File mode of the socket, an octal string",
        check=lambda value: parse_file_mode(value) is not None,
        allowed="must be an octal file mode between \"0000\" and \"0777\", written as a quoted string, e.g. \"0660\""),
    _listener("server.health_address", "", "host:port of a plaintext grpc.health.v1-only listener (\"\": none)",
              "0.0.0.0:8081", "for none"),
)


def _unused(section: str, names: str, free_form: str = "") -> tuple[Key, ...]:
    """LoongSage's keys under `section` that the service accepts and does not read (from LoongSage's
    conf/default.yaml and run configs); `free_form` ones are mappings whose own keys are LoongSage's business."""
    return (tuple(Key(f"{section}.{name}", "any", None, "LoongSage's; not read by the service", unused=True)
                  for name in names.split())
            + tuple(Key(f"{section}.{name}", "any", None, "LoongSage's; not read by the service", unused=True,
                        free_form=True) for name in free_form.split()))


# LoongSage's keys under the sections the service reads, accepted so its run configs load, and not read.
LOONGSAGE_UNUSED: tuple[Key, ...] = (
    *_unused("data_source", "teacher_name max_response_len_per_trajectory",
             free_form="sandbox agent reward completion_params"),
    *_unused("data_source.dataset", "prompt_data_path eval_prompt_data_path max_prompt_len input_key label_key "
                                    "metadata_key shuffle data_pre_processor"),
    *_unused("rollout", "mask_offpolicy_in_partial_rollout use_fault_tolerance retry_limit backend num_gpus_per_node",
             free_form="env_vars sglang_args sglang_replicas sampler eval"),
    *_unused("trainer", "backend num_nodes num_gpus_per_node use_rollout_log_probs use_rollout_routing_replay "
                        "use_fp32_lm_head temperature micro_batch_size max_tokens_per_gpu use_dynamic_batch_size "
                        "deterministic_mode nccl_timeout_minutes gloo_timeout_minutes save_freq async_save "
                        "save_checkpoint save_hf", free_form="env_vars"),
)

SCHEMA_BY_PATH: dict[str, Key] = {key.path: key for key in (*SCHEMA, *LOONGSAGE_UNUSED)}


# ------------------------------------------------------------------------------------------------ reading

def _child(node: Any, name: str) -> Any:
    if node is None:
        return _NOT_GIVEN
    if hasattr(node, "get") and not isinstance(node, (str, bytes)):
        value = node.get(name, _NOT_GIVEN)
    else:
        value = getattr(node, name, _NOT_GIVEN)
    return value


def lookup(config: Any, path: str, default: Any = None) -> Any:
    """The value at dotted `path` of a mapping-like or attribute configuration, or `default` when absent."""
    node = config
    for part in path.split("."):
        node = _child(node, part)
        if node is _NOT_GIVEN:
            return default
    return node


def setting(config: Any, path: str) -> Any:
    """The key `path` of `config` (validated at start-up), or its declared default when the config lacks it."""
    key = SCHEMA_BY_PATH[path]
    value = lookup(config, path, _NOT_GIVEN)
    return key.default if value is _NOT_GIVEN or (value is None and not key.nullable) else value


def default_server_values() -> dict[str, Any]:
    """Every `server.*` key's declared default, by its path under `server` (e.g. "tls.cert_file")."""
    return {key.path.removeprefix("server."): key.default for key in SCHEMA if key.path.startswith("server.")}


def read_options(config: Any, section: str, options: Iterable[Key]) -> dict[str, Any]:
    """The declared `options` under `section` (e.g. "fully_async.latency_aware") of `config`, typed and
    defaulted; ConfigError (a ValueError) naming the first invalid one."""
    values = {}
    for key in options:
        value = lookup(config, f"{section}.{key.path}", None)
        if value is None and not key.nullable:
            value = key.default
        problem = key.problem(value)
        if problem:
            raise ConfigError(f"{section}.{key.path} = {value!r}: {problem}")
        values[key.path] = float(value) if key.kind == "number" else value
    return values


def option_problems(section: str, given: Any, options: Sequence[Key]) -> list[str]:
    """Every problem of the options mapping `given` under `section`: unknown names (with the closest
    declared one) and invalid values."""
    problems = []
    names = [key.path for key in options]
    for name, value in (given.items() if hasattr(given, "items") else ()):
        key = next((k for k in options if k.path == name), None)
        if key is None:
            problems.append(unknown_key(f"{section}.{name}", [f"{section}.{n}" for n in names]))
        elif key.problem(value) is not None:
            problems.append(f"{section}.{name} = {value!r}: {key.problem(value)}")
    return problems


# ------------------------------------------------------------------------------------------- unknown keys

def unknown_key(path: str, known: Sequence[str], elsewhere: Sequence[str] = ()) -> str:
    """A refusal of the unknown key `path`, naming the closest of `known`, else a key of that name in another section
    (`elsewhere`: every declared key, e.g. rollout.num_trajectories_per_prompt -> data_source's)."""
    section, _, leaf = path.rpartition(".")
    in_section = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
    if in_section:  # the section exists: the closest of its names, compared without the prefix they all share
        close = [in_section[c] for c in difflib.get_close_matches(leaf, list(in_section), n=1, cutoff=0.6)]
        shown = sorted(in_section.values())
    else:  # a typo in the section too: the closest whole name, else the closest by its last part
        close = difflib.get_close_matches(path, known, n=1, cutoff=0.6)
        shown = sorted(known)
    if not close:  # the right name in the wrong section: the closest key elsewhere by its last part
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in (*known, *elsewhere) if k != path}
        # Stricter when the section exists: a loosely similar name from another section would mislead.
        cutoff = 0.8 if in_section else 0.6
        close = [by_leaf[c] for c in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=cutoff)]
    hint = f"did you mean {close[0]}?" if close else f"known keys here: {', '.join(shown[:8])}"
    if section == "fully_async" and not close:  # likely an option of a custom strategy, set where it is not read
        hint += ("; a custom strategy declares its own options as `options` on its class, set as "
                 "fully_async.<its section>.<option>: see Strategy options in docs/custom-strategies.md")
    return f"{path}: unknown key ({hint})"


def unknown_key_problems(config: Any, option_sections: Mapping[str, Sequence[Key]]) -> list[str]:
    """Every key under the service's sections that neither the schema, nor LoongSage's accepted keys, nor a
    registered strategy's options (`option_sections`: dotted section -> its options) declare."""
    declared = {key.path: key for key in (*SCHEMA, *LOONGSAGE_UNUSED)}
    for section, options in option_sections.items():
        declared.update({f"{section}.{key.path}": key for key in options})
    free = {path for path, key in declared.items() if key.free_form}
    groups = {path.rsplit(".", 1)[0] for path in declared if "." in path}
    groups |= {prefix for path in groups for prefix in _prefixes(path)}
    skip = {"rollout.filter"}  # the filters validate their own names and parameters
    problems: list[str] = []

    def walk(node: Any, path: str, shown: str, reported: Any = None) -> None:
        for name in list(node.keys()):
            child_path, child_shown = f"{path}.{name}", f"{shown}.{name}"
            if child_path in skip or child_path in free:
                continue
            if reported is not None and name in reported:  # inherited from data_source: reported there
                continue
            if child_path in groups:
                child = node.get(name) if hasattr(node, "get") else None
                if child is not None and hasattr(child, "keys"):
                    walk(child, child_path, child_shown)
                continue
            if child_path not in declared:
                siblings = [p for p in declared if p.startswith(path + ".")]
                problem = unknown_key(child_path, siblings or list(declared), list(declared))
                if child_shown != child_path:  # a data_sources entry: said in its own terms
                    problem = problem.replace("data_source.", shown.split(".")[0] + ".")
                problems.append(problem)

    # Other top-level sections are accepted unread (a LoongSage run config has a dozen); one that is a near
    # miss of a section the service reads is a typo whose settings would be silently ignored.
    read = (*SECTIONS, "data_sources")
    for name in (list(config.keys()) if hasattr(config, "keys") else []):
        if isinstance(name, str) and name not in read:
            close = difflib.get_close_matches(name, read, n=1, cutoff=0.8)
            if close:
                problems.append(f"{name}: unknown section (did you mean {close[0]}?); its settings would not be read")
    for section in SECTIONS:
        node = _raw_child(config, section)
        if node is not None and hasattr(node, "keys"):
            walk(node, section, section)
    entries = _raw_child(config, "data_sources")
    defaults = _raw_child(config, "data_source")
    inherited = set(defaults.keys()) if defaults is not None and hasattr(defaults, "keys") else set()
    if entries is not None and not isinstance(entries, (str, bytes)) and hasattr(entries, "__iter__"):
        for i, entry in enumerate(entries):
            if hasattr(entry, "keys"):
                walk(entry, "data_source", f"data_sources[{i}]", inherited)
    return problems


def mapping_paths(option_sections: Mapping[str, Sequence[Key]] = {}) -> dict[str, tuple[str, ...]]:  # noqa: B006
    """Every dotted path that must hold a mapping (the sections, their sub-mappings such as server.tls, the
    strategies' option sections, `option_sections`: dotted section -> its options), with the names of the keys
    declared under it."""
    children: dict[str, set[str]] = {section: set() for section in SECTIONS}
    for key in (*SCHEMA, *LOONGSAGE_UNUSED):  # a refusal names the service's own keys, LoongSage's unread ones
        parts = key.path.split(".")           # only where there are none
        for i in range(1, len(parts)):
            names = children.setdefault(".".join(parts[:i]), set())
            if not key.unused or not names:
                names.add(parts[i])
    for section, options in option_sections.items():
        children.setdefault(section, set()).update(key.path for key in options)
        for prefix, leaf in zip(_prefixes(section), section.split(".")[1:]):
            children.setdefault(prefix, set()).add(leaf)
    return {path: tuple(sorted(names)) for path, names in children.items()}


def mapping_problem(path: str, value: Any, names: Sequence[str]) -> str:
    """The refusal of `value` at `path`, a key that must hold a mapping of `names`."""
    if path in SECTIONS or not names:
        what = "a mapping of options (see conf/default.yaml)"
    else:
        what = f"a mapping of {', '.join(names)} (see conf/default.yaml), e.g. {path}.{names[0]}=..."
    return f"{path} = {value!r}: must be {what}"


def _raw_child(config: Any, name: str) -> Any:
    value = _child(config, name)
    return None if value is _NOT_GIVEN else value


def _prefixes(path: str) -> Iterator[str]:
    parts = path.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_list_config(value: Any) -> bool:
    return type(value).__name__ == "ListConfig"
