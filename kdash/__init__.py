"""kdash: a terminal profiling dashboard for GPU inference processes.

The one-call way into a capture from pandas::

    import kdash
    tables = kdash.read_capture("run.kdash")   # dict: table name -> pandas.DataFrame
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kdash")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


def read_capture(path):  # noqa: ANN001,ANN201 - re-exported convenience
    """Load a `.kdash` capture into a dict of pandas DataFrames (one per table)."""
    from kdash.capture import load_capture

    return load_capture(path).tables


__all__ = ["__version__", "read_capture"]
