"""What a continual stream keeps: its registration (:class:`StreamSpec`), each partition's open
state between appends, and the small conversions of keys and times they share."""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa

from dpsql import _state
from dpsql._chunks import distinct, table_of
from dpsql.errors import InvalidData, InvalidParameter, InvalidTimeKey
from dpsql.methods import COUNT_METHODS
from dpsql.ordering import refuse_rows_without_keys
from dpsql.timegrid import TimeGrid

if TYPE_CHECKING:
    from dpsql.continual.stream import Stream
    from dpsql.noise import DrawsBatch

ROW_COLUMN = "dp_row"
#: Batches of at most so many values are tagged value by value: looking for repeats costs more.
_TAGGED_EACH = 1024
TAG = "dp_tag"
#: Whether a released row's value is final (True) or provisional, waiting for later rows (False).
FINAL = "dp_final"


def short_tags(tags: np.ndarray) -> np.ndarray:
    """Value tags as the ledger keeps them: their low 32 bits (``int32``). Two values of one row
    are told apart unless their tags collide (probability ``2**-32``), which is enough to refuse a
    conflicting row, and keeps a released row's tag at four bytes."""
    tags = np.asarray(tags)
    if tags.dtype == np.int32:
        return tags
    return (tags.astype(np.uint64, copy=False) & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)


def value_tags(draws: DrawsBatch, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The short tags (:func:`short_tags`) of ``values[i]`` in partition ``rows[i]`` of ``draws``:
    for a batch of one partition, one AES block per distinct value when its values repeat
    (readings in steps, counts), else one per row."""
    bits = np.ascontiguousarray(values, dtype=np.float64).reshape(-1).view(np.int64)
    found = distinct(bits, mostly_seen=True) if len(draws) == 1 and len(bits) > _TAGGED_EACH else None
    if found is None:
        return short_tags(draws.tags(rows, values))
    indices, dictionary = found  # indices: pooled memory, used at once
    return short_tags(draws.tags(np.zeros(len(dictionary), np.intp), dictionary.view(np.float64)))[indices]


@dataclass(frozen=True)
class StreamSpec:
    """What a stream was registered with (public; stored with it).

    ``params`` are the method's parameters. Count streams add the public time grid
    (:class:`dpsql.timegrid.TimeGrid`): bucket ``b`` holds the events with ``start + b * every
    <= time < start + (b + 1) * every``, datetimes in UTC nanoseconds; ``utc`` says whether
    bucket starts come back as UTC timestamps (a time zone aware ``start``) or naive ones.
    ``max_delay``: how long a row may stay provisional, as :meth:`dpsql.continual.delay.MaxDelay.plain`
    keeps it (rows, or a duration as text), or None.
    """

    method: str
    params: dict
    order_by: str
    value: str | None
    partition_by: tuple[str, ...] = ()
    every: float | int | None = None
    start: float | int | None = None
    datetime: bool = False
    utc: bool = False
    max_delay: int | str | None = None

    @property
    def grid(self) -> TimeGrid:
        return TimeGrid(self.start, self.every, self.datetime)

    @property
    def counts(self) -> bool:
        return self.method in COUNT_METHODS

    def recorded_params(self) -> dict:
        """The parameters as the ledger records and :meth:`Stream.info` shows them: the method's,
        and the stream's ``max_delay``."""
        return plain({**self.params, **({} if self.max_delay is None else {"max_delay": self.max_delay})})

    def columns(self) -> list[str]:
        return [*self.partition_by, self.order_by] + ([] if self.counts else [self.value])

    def to_json(self) -> dict:
        return {**asdict(self), "partition_by": list(self.partition_by)}

    @classmethod
    def from_json(cls, data: dict) -> StreamSpec:
        return cls(**{**data, "partition_by": tuple(data["partition_by"])})


def storable(params: dict, name: str) -> dict:
    """``params`` as the ledger keeps them (JSON): numpy scalars and other real numbers (``Fraction``)
    as Python numbers; any other value refused, naming the parameter."""
    out = {}
    for key, given in params.items():
        value = given.item() if isinstance(given, np.generic) else given
        if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
            value = float(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise InvalidParameter(f"stream {name!r}: parameter {key}={given!r} is not a number, string, list or "
                                   "mapping the ledger can keep") from None
        out[key] = value
    return out


def plain(params: dict) -> dict:
    return json.loads(json.dumps(params, default=str))


@dataclass
class PartitionState:
    """A partition's open state between appends (packed into the ledger)."""

    machine: dict | None = None
    fed: int = 0  # rows (count streams: buckets) fed to the machine
    pending_keys: bytes | None = None  # keys of rows fed but not yet released (Arrow IPC)
    pending_tags: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    counts: dict = field(default_factory=dict)  # count streams: open buckets' event counts (secret)

    def pack(self) -> bytes:
        return _state.pack({"machine": self.machine, "fed": self.fed, "pending_keys": self.pending_keys,
                            "pending_tags": self.pending_tags,
                            "buckets": np.array(sorted(self.counts), dtype=np.int64),
                            "counts": np.array([self.counts[b] for b in sorted(self.counts)], dtype=np.float64)})

    @classmethod
    def unpack(cls, data: bytes) -> PartitionState:
        d = _state.unpack(data)
        return cls(d["machine"], int(d["fed"]), d["pending_keys"], np.asarray(d["pending_tags"], dtype=np.uint64),
                   dict(zip(np.asarray(d["buckets"]).tolist(), np.asarray(d["counts"]).tolist())))


def type_name(dtype) -> str:
    return pa.field("x", pl.Series([], dtype=dtype).to_arrow().type).type.__str__()


def arrow_type(name: str) -> pa.DataType:
    return pa.type_for_alias(name) if not name.startswith("timestamp") else timestamp_type(name)


def timestamp_type(name: str) -> pa.DataType:
    inside = name[len("timestamp["):-1].split(", tz=")
    return pa.timestamp(inside[0], tz=inside[1] if len(inside) > 1 else None)


def decoded(frame: pl.DataFrame, columns) -> pl.DataFrame:
    """``frame`` with its categorical (dictionary-encoded) key ``columns`` as plain strings: a
    partition key is stored and returned by value."""
    cast = [pl.col(c).cast(pl.String) for c in columns if isinstance(frame.schema[c], (pl.Categorical, pl.Enum))]
    return frame.with_columns(cast) if cast else frame


def refuse_null_keys(frame: pl.DataFrame, spec: StreamSpec, label: str) -> None:
    """Refuse rows without their keys (null or NaN) in the words every front end uses, after the
    stream's ``label``, and infinite order keys."""
    order = spec.order_by
    try:
        refuse_rows_without_keys([frame.get_column(c) for c in (order, *spec.partition_by)],
                                 [order, *spec.partition_by], events=spec.counts)
    except InvalidTimeKey as error:
        raise InvalidTimeKey(f"{label}: {error}") from None
    series = frame.get_column(order)
    if series.dtype.is_float() and series.is_infinite().any():
        # an infinite order key would become the watermark: every later row would be late
        raise InvalidTimeKey(f"{label}: order column {order!r} contains an infinite key; order keys must be finite")


def numeric(series: pl.Series, column: str, label: str) -> pl.Series:
    if not series.dtype.is_numeric():
        raise InvalidData(f"{label}: column {column!r} must be numeric, got {series.dtype}")
    return series


def same_type(keys: pa.Array, watermark, stream: Stream) -> pa.Array:
    if watermark is None or keys.type == watermark.type or pa.types.is_null(watermark.type):
        return keys
    try:
        return keys.cast(watermark.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise InvalidTimeKey(f"stream {stream.name!r}: order keys of type {keys.type} cannot join keys of type "
                             f"{watermark.type} appended before") from None


def bucket_starts(buckets: np.ndarray, spec: StreamSpec) -> pa.Array:
    """Bucket starts as output keys: microsecond timestamps (UTC for a zone aware start) or numbers."""
    starts = spec.grid.starts(buckets)
    if spec.datetime:
        return pa.array(starts).cast(pa.timestamp("us", tz="UTC" if spec.utc else None))
    return pa.array(starts, pa.float64())


def key_of(watermark: bytes):
    return table_of(watermark)["key"][0].as_py()


def stored_keys(data: bytes) -> pa.Array:
    """The ``key`` column of a stored table, as one array."""
    return table_of(data)["key"].combine_chunks()


def as_key(partition):
    return tuple(partition) if isinstance(partition, list) else partition


def scalar_like(value, kind: pa.DataType):
    return pa.scalar(value).cast(kind) if not isinstance(value, pa.Scalar) else value.cast(kind)


def sorted_output(outputs: list[pa.Table], stream: Stream, like: pa.Table) -> pa.Table:
    """An append's released rows by partition, then order key. A value stream's come that way
    (partitions in key order, each in time order); a count stream's closes every partition, in
    the order they first appeared, so it sorts."""
    outputs = [o for o in outputs if o.num_rows]
    if not outputs:
        return stream._empty_output(like)
    table = pa.concat_tables(outputs, promote_options="permissive") if len(outputs) > 1 else outputs[0]
    if not stream.spec.counts:
        return table
    return table.sort_by([(c, "ascending") for c in [*stream.spec.partition_by, stream.spec.order_by]])
