"""Continual release: a private stream registered once, charged once, appended to forever
(see :mod:`dpsql.continual.stream`)."""

from dpsql.continual.state import ROW_COLUMN, StreamSpec
from dpsql.continual.stream import Stream, open_stream

__all__ = ["ROW_COLUMN", "Stream", "StreamSpec", "open_stream"]
