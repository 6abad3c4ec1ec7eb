"""The sidecar → collector protocol, defined once: the sidecar builds these messages, the operator's
collector parses them with the same code.

Two messages, each POSTed as gzip'd JSON with ``Authorization: Bearer <job token>``:

- ``WindowSummary`` to ``/v1/jobs/{namespace}/{name}/summaries`` every window (default 5 s), even an
  empty one (it doubles as the sidecar's heartbeat);
- ``StallReport`` to ``/v1/jobs/{namespace}/{name}/stalls`` at once when a local rank stalls.

A collector answers 2xx when it has taken the message; 400 / 404 / 409 (a window older than one
already taken: replayed) / 413 / 422 refuse it for good (the sidecar drops it); 401 / 403 / 408 / 429 /
5xx are retried with backoff. The operator's collector answers a job it does not follow with the same
401 as a wrong token (an outsider learns nothing of which jobs exist): the sidecar of a job not yet
seen, or already ended, keeps retrying until it is followed or its pod ends, so delivery is at least once:
(pod, start_ns, window) identifies a summary, (pod, detected_ns) a stall report. Every message carries
``schema``; a parser takes the versions in ``SCHEMAS_READ`` and refuses others rather than guess (a
field added by a later version has a default, so an older message still parses, without it). Times are CLOCK_REALTIME
nanoseconds (ints) or durations in seconds (floats); communicator ids are 16 hex digits (a JSON
number cannot carry 64 bits in every client). Sequence ranges are over collective calls only:
send/receive numbers count per peer and are not comparable across calls.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import types
import typing
import zlib
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass
from typing import Any, TypeVar

import msgspec

SCHEMA_VERSION = 2
"""2 added the host's scheduling figures (``RankWindow.scheduling``, ``WindowSummary.cpu_pressure``) and the
ranks' Python stacks in a stall report (``RankPosition.python_stack``)."""
SCHEMAS_READ = (1, 2)
SUMMARIES_PATH = "/v1/jobs/{namespace}/{name}/summaries"
STALLS_PATH = "/v1/jobs/{namespace}/{name}/stalls"
CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "gzip"
GZIP_MAGIC = b"\x1f\x8b"
MAX_BODY_BYTES = 1 << 20
"""Largest request body a collector accepts (compressed, as sent)."""
MAX_DECODED_BYTES = 16 << 20
"""Largest JSON document after decompression (a gzip bomb stops here)."""

# Sidecar endpoints (same bearer token except /healthz).
METRICS_PATH = "/metrics"
DUMP_PATH = "/dump"
EVIDENCE_PATH = "/evidence"
"""A tar of the trace directory's files other than rings: the stall watch's Megatrace logs
(``megatrace/rank_<R>.log``) and PyTorch flight-recorder dumps (``flight_recorder_rank_<R>``)."""
PROFILE_PATH = "/profile"
"""``?ranks=5,4&seconds=3``: a few seconds of those ranks' Python, sampled together (py-spy), as JSON
``{"seconds": s, "ranks": {"5": {"samples": n, "functions": {"name (file)": n}, "problem": null}}}``;
429 while one runs or within 30 s of the last (``rankwatch.sidecar.python_profile``)."""
HEALTH_PATH = "/healthz"
DUMP_DEFAULT_LIMIT = 10_000

OP_NAMES = {1: "AllReduce", 2: "Broadcast", 3: "Reduce", 4: "AllGather", 5: "ReduceScatter", 6: "AlltoAll",
            7: "Gather", 8: "Scatter", 9: "Send", 10: "Recv", 32: "CommInitRank", 33: "CommSplit",
            34: "CommShrink", 35: "CommDestroy", 36: "CommAbort"}  # fmt: skip
"""Ring op codes (nccl_patch/include/rankwatch_ring.h) as they appear in messages."""


class ProtocolError(ValueError):
    """A body that is not a valid message of this schema; the message names the field."""


@dataclass(frozen=True)
class Quantiles:
    """Distribution of a duration over the calls of one window, in seconds."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True)
class CommWindow:
    """One rank's calls on one communicator during one window."""

    comm_id: str
    comm_rank: int
    comm_size: int
    first_entered: int | None  # lowest / highest collective seq the rank entered in the window
    last_entered: int | None
    first_completed: int | None  # lowest / highest collective seq that returned in the window
    last_completed: int | None
    in_flight: int  # calls entered and not finished (host return, or GPU end when GPU-timed) at window end
    oldest_in_flight_s: float | None
    calls: dict[str, int]  # op name -> calls entered in the window
    failed: int  # calls that returned an NCCL error
    wait: Quantiles | None  # host time in the call (t_return - t_call)
    gap: Quantiles | None  # between consecutive calls of the rank on this communicator (t_call to t_call)
    gpu: Quantiles | None  # GPU time, when GPU timing is on


@dataclass(frozen=True)
class RankScheduling:
    """How the kernel scheduled a rank's process (its main thread, which launches the work) during one
    window, from ``/proc/<pid>/schedstat`` and ``/proc/<pid>/status``: a rank that waits for a CPU
    (a busy neighbour, too few cores for the dataloader workers) falls behind its peers for reasons
    no GPU or link figure shows."""

    cpu_s: float  # on a CPU
    run_delay_s: float  # runnable, waiting on a run queue for a CPU
    involuntary_switches: int  # taken off a CPU while it still wanted to run (preempted)


@dataclass(frozen=True)
class RankWindow:
    """One traced process (one ring) during one window; a restarted process is a new RankWindow."""

    global_rank: int
    local_rank: int
    pid: int
    ring: str  # file name of the ring in the trace directory
    alive: bool
    records: int  # records read in the window
    torn: int  # records skipped: torn, or still being written when the writer died
    overwritten: int  # records the ring wrapped over before the sidecar read them
    lost_updates: int  # the writer's count of completions that found their slot reused (cumulative)
    last_call_ns: int | None
    step_time_s: float | None  # longest typical period among repeated call signatures (one training step)
    comms: list[CommWindow]
    scheduling: RankScheduling | None = None  # None: not readable (other PID namespace), or its first window


@dataclass(frozen=True)
class WindowSummary:
    schema: int
    namespace: str
    job: str
    pod: str
    node: str
    replica_index: int
    expected_ranks: int  # processes the pod should run (nprocPerNode); 0 when unknown
    window: int  # the sidecar's window counter, from 1; restarts with the sidecar
    start_ns: int
    end_ns: int
    dropped_summaries: int  # summaries this sidecar dropped (queue full) since its last accepted one
    ranks: list[RankWindow]
    cpu_pressure: float | None = None
    """Share of the window in which some runnable task of the node waited for a CPU (``/proc/pressure/cpu``,
    "some"); None where the kernel has no pressure stall information, and in the first window."""


@dataclass(frozen=True)
class CommPosition:
    comm_id: str
    comm_rank: int
    comm_size: int
    last_entered: int | None  # highest collective seq the rank entered (since its ring began)
    last_completed: int | None
    in_flight: int
    oldest_in_flight_s: float | None
    oldest_in_flight_op: str | None
    oldest_in_flight_seq: int | None


@dataclass(frozen=True)
class RankPosition:
    global_rank: int
    local_rank: int
    pid: int
    ring: str
    alive: bool
    stall: str | None  # None, "in_flight" (a call older than the sensitivity) or "silent" (no call since)
    last_call_ns: int | None
    silent_s: float | None  # since the rank's last call or return
    comms: list[CommPosition]
    python_stack: list[str] | None = None  # main thread, innermost first ("file:line function"); None: not taken


@dataclass(frozen=True)
class StallReport:
    schema: int
    namespace: str
    job: str
    pod: str
    node: str
    replica_index: int
    detected_ns: int
    sensitivity_s: float
    stalled_ranks: list[int]  # global ranks stalled now
    summary: str  # one line for people
    megatrace_dir: str | None  # where the sidecar writes Megatrace-format logs of the recent records
    positions: list[RankPosition]  # every local rank, stalled or not


Message = WindowSummary | StallReport
T = TypeVar("T")


def summaries_path(namespace: str, name: str) -> str:
    return SUMMARIES_PATH.format(namespace=namespace, name=name)


def stalls_path(namespace: str, name: str) -> str:
    return STALLS_PATH.format(namespace=namespace, name=name)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def token_of(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def encode(message: Message) -> bytes:
    """The request body: gzip'd compact JSON."""
    return gzip.compress(json.dumps(asdict(message), separators=(",", ":")).encode(), compresslevel=5)


def decode_body(body: bytes, content_encoding: str | None = None) -> bytes:
    """The JSON bytes of a request body, refusing oversized ones (before and after decompression).

    Servers such as aiohttp decompress gzip request bodies themselves (their ``client_max_size`` then
    bounds the decompressed size: set it to MAX_DECODED_BYTES), so a body is recognised as gzip by
    its magic bytes, not by the header alone."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding not in ("identity", CONTENT_ENCODING):
        raise ProtocolError(f"Content-Encoding {content_encoding!r}: send gzip or identity")
    if body[:2] != GZIP_MAGIC:
        if len(body) > MAX_DECODED_BYTES:
            raise ProtocolError(f"body of {len(body)} bytes is over the limit of {MAX_DECODED_BYTES}")
        return body
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"compressed body of {len(body)} bytes is over the limit of {MAX_BODY_BYTES}")
    decompressor = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        data = decompressor.decompress(body, MAX_DECODED_BYTES + 1)
    except zlib.error as error:
        raise ProtocolError(f"body is not valid gzip: {error}") from error
    if len(data) > MAX_DECODED_BYTES or decompressor.unconsumed_tail:
        raise ProtocolError(f"body decompresses to more than {MAX_DECODED_BYTES} bytes")
    return data


def parse_summary(body: bytes) -> WindowSummary:
    """A WindowSummary from (decompressed) JSON; ProtocolError names the first bad field."""
    return _parse(body, WindowSummary)


def checked_summary(body: bytes) -> WindowSummary:
    """The checks of :func:`parse_summary` without building the dataclasses where they pass: the checked
    document as decoded (a frozen mirror of WindowSummary with the same fields, read by attribute), else
    the dataclasses of the path that names the first bad field. For a reader that only reads the fields
    (the collector's digest): building ~50 dataclasses cost ~4x the check itself."""
    return _parse(body, WindowSummary, build=False)


def parse_stall(body: bytes) -> StallReport:
    """A StallReport from (decompressed) JSON; ProtocolError names the first bad field."""
    return _parse(body, StallReport)


def _parse(body: bytes, cls: type[T], build: bool = True) -> T:
    # Fast path (a collector takes thousands of summaries a second): msgspec checks the whole document
    # in C against a strict mirror of the dataclasses (unknown fields, NaN and infinities refused, no
    # bool for an int), then builds the dataclasses (unless ``build`` is off: the mirror is returned).
    # Whatever it refuses, or a schema this side does not read, takes the path below, which names the
    # first bad field (and decides).
    try:
        checked = _strict_decoder(cls).decode(body)
    except msgspec.DecodeError:
        pass
    else:
        if checked.schema in SCHEMAS_READ:
            return msgspec.convert(checked, cls, from_attributes=True) if build else checked
    try:
        document = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except ProtocolError as error:
        raise ProtocolError(f"{cls.__name__}: {error}") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ProtocolError(f"{cls.__name__}: not JSON: {error}") from error
    except RecursionError:
        raise ProtocolError(f"{cls.__name__}: JSON nested too deeply") from None
    if not isinstance(document, dict):
        raise ProtocolError(f"{cls.__name__}: expected a JSON object, got {type(document).__name__}")
    schema = document.get("schema")
    if type(schema) is not int or schema not in SCHEMAS_READ:
        raise ProtocolError(
            f"{cls.__name__}: schema {schema!r}, this side reads {', '.join(map(str, SCHEMAS_READ))} (upgrade the "
            "older of sidecar and operator)"
        )
    try:
        return _compiled(cls)(document)
    except _Invalid:  # the slow path names the first bad field
        return _build(cls, document, cls.__name__)


def _refuse_constant(name: str) -> Any:
    """NaN and infinities are not JSON (Python's encoder writes them; no sidecar of ours does): a NaN wait
    or sequence would poison every median it enters."""
    raise ProtocolError(f"{name} is not a number this protocol accepts (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"{text[:40]} is out of range for a number (overflows to infinity)")
    return value


@functools.cache
def _strict_decoder(cls: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(_strict(cls))


@functools.cache
def _strict(hint: Any) -> Any:
    """``hint`` with every dataclass in it replaced by a frozen msgspec Struct of the same fields and
    defaults that refuses unknown fields (msgspec decodes dataclasses but ignores extra keys in them)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(lambda either, option: either | option, map(_strict, typing.get_args(hint)))
    if origin is list:
        return list[_strict(typing.get_args(hint)[0])]
    if origin is dict:
        key, value = typing.get_args(hint)
        return dict[_strict(key), _strict(value)]
    if is_dataclass(hint):
        hints, _, required = _fields_of(hint)
        members = [
            (f.name, _strict(hints[f.name])) if f.name in required else (f.name, _strict(hints[f.name]), f.default)
            for f in fields(hint)
        ]
        return msgspec.defstruct(f"Strict{hint.__name__}", members, forbid_unknown_fields=True, frozen=True)
    return hint


class _Invalid(Exception):
    """Raised by the compiled checkers; the message is then made by ``_build``."""


@functools.cache
def _compiled(hint: Any) -> Any:
    """A checker for ``hint`` made once: the same rules as ``_check`` without building the name of every
    field on the way (a 1,000-rank job sends ~100k values per window)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [option for option in typing.get_args(hint) if option is not type(None)]
        inner_check = _compiled(inner)
        return lambda value: None if value is None else inner_check(value)
    if origin is list:
        item_check = _compiled(typing.get_args(hint)[0])

        def check_list(value: Any) -> list:
            if type(value) is not list:
                raise _Invalid
            return [item_check(element) for element in value]

        return check_list
    if origin is dict:
        value_check = _compiled(typing.get_args(hint)[1])

        def check_dict(value: Any) -> dict:
            if type(value) is not dict:
                raise _Invalid
            return {str(key): value_check(element) for key, element in value.items()}

        return check_dict
    if is_dataclass(hint):
        hints, names, required = _fields_of(hint)
        checks = [(name, _compiled(hints[name])) for name in names]

        def check_object(value: Any) -> Any:
            if type(value) is not dict or not (required <= value.keys() <= names):
                raise _Invalid
            return hint(**{name: check(value[name]) for name, check in checks if name in value})

        return check_object
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
    if hint not in kinds:
        raise TypeError(f"no check for {hint!r}")
    allowed = kinds[hint]

    def check_scalar(value: Any) -> Any:
        if type(value) not in allowed:
            raise _Invalid
        return float(value) if hint is float else value

    return check_scalar


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], frozenset[str], frozenset[str]]:
    """A dataclass's resolved annotations, field names and the names without a default, once per class
    (``get_type_hints`` evaluates every annotation string anew: it was three quarters of the collector's
    parsing time). A field with a default is one a later schema added: older messages lack it."""
    every = fields(cls)
    required = frozenset(f.name for f in every if f.default is MISSING and f.default_factory is MISSING)
    return typing.get_type_hints(cls), frozenset(f.name for f in every), required


def _build(cls: type[T], value: Any, where: str) -> T:
    """A dataclass from a JSON object, checking every field against its annotation (no extra keys)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
    hints, names, required = _fields_of(cls)
    unknown = sorted(set(value) - names)
    if unknown:
        raise ProtocolError(f"{where}: unknown field {unknown[0]!r}")
    arguments = {}
    for name in names:
        if name not in value:
            if name in required:
                raise ProtocolError(f"{where}: missing field {name!r}")
            continue
        arguments[name] = _check(hints[name], value[name], f"{where}.{name}")
    return cls(**arguments)


def _check(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return _check(inner, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_check(item, element, f"{where}[{i}]") for i, element in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = typing.get_args(hint)
        return {str(key): _check(item, element, f"{where}.{key}") for key, element in value.items()}
    if is_dataclass(hint):
        return _build(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{where}: no check for {hint!r}")  # a field type this module does not handle: a bug here
