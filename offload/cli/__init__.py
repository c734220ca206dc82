"""The ``offload`` command line (also ``python -m offload``): ``offload profile``, ``offload plan``
and ``offload info``, one module each; :func:`main` is the console script's entry point."""

from offload.cli._main import main

__all__ = ["main"]
