"""The paper algorithms as online state machines (:class:`dpsql.release.StreamMachine`).

Each module defines one family; :mod:`dpsql.methods` registers them by name.
"""
