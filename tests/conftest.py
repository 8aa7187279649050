"""Session-wide test hooks."""

import gc


def pytest_sessionfinish(session, exitstatus):
    """Close DuckDB connections left open by tests: a connection holding Python UDFs that
    is still alive at interpreter exit makes DuckDB's bindings print reference-leak
    warnings after pytest's summary."""
    import duckdb

    for obj in gc.get_objects():
        if isinstance(obj, duckdb.DuckDBPyConnection):
            obj.close()
    gc.collect()
