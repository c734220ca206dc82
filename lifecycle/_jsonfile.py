"""The JSON files lifecycle's data classes are saved as: written atomically, read with clear errors,
tagged with a format name and a schema version. :func:`replacing` writes any file atomically."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[str]:
    """A temp file name beside ``path`` for the block to write; renamed over ``path`` when the
    block ends, removed when the block or the rename fails (a full disk leaves neither a
    half-written ``path`` nor the temp file), and the error re-raised.

    Example:
        >>> import tempfile
        >>> d = tempfile.TemporaryDirectory()
        >>> path = os.path.join(d.name, "x.txt")
        >>> with replacing(path) as tmp, open(tmp, "w") as f:
        ...     _ = f.write("hello")
        >>> open(path).read(), os.listdir(d.name)
        ('hello', ['x.txt'])
        >>> d.cleanup()
    """
    path = file_path(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        # The temp file is ours, not the user's: an error naming it ("No such file or
        # directory: 'p.json.tmp4242'", or "'p.json.tmp4242' -> 'p.json'" where p.json is a
        # directory) names the path the user gave instead.
        if isinstance(e, OSError) and e.filename == tmp and type(e).__module__ == "builtins":
            raise type(e)(e.errno, e.strerror, path) from None
        raise


def file_path(path: object) -> str:
    """``path`` as a str, or a ``TypeError`` naming the argument (``open(5)`` would read file
    descriptor 5, and ``os.fspath`` says "expected str, bytes or os.PathLike object")."""
    if isinstance(path, (str, os.PathLike)):
        fspath = os.fspath(path)
        if isinstance(fspath, str):
            return fspath
    raise TypeError(f"path must be a str or os.PathLike naming a file; got {type(path).__name__}")


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any], **dump: Any) -> None:
    """Write ``data`` to ``path`` atomically (a temp file, then a rename; see :func:`replacing`)."""
    # One string, then one write: ``json.dumps`` encodes in C, while ``json.dump`` streams through
    # the pure-Python encoder (3.3x as long on a 10k-record trace). Nothing is written if the
    # data cannot be encoded.
    text = json.dumps(data, **dump)
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``; ``ValueError`` naming the file when it is not JSON."""
    path = file_path(path)
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not valid JSON: {e}") from e
        except RecursionError as e:  # thousands of nested brackets: no file of ours
            raise ValueError(
                f"{path!r} is not a file offload reads: its JSON is nested too deeply"
            ) from e


def check_header(data: Any, *, fmt: str, version: int, what: str) -> None:
    """Raise ``ValueError`` unless ``data`` is an object of format ``fmt`` at schema ``version``."""
    if not isinstance(data, Mapping) or data.get("format") != fmt:
        raise ValueError(f"not an offload {what}: expected a JSON object with format '{fmt}'")
    found = data.get("schema_version")
    if found != version:
        raise ValueError(
            f"{what} schema_version {found!r} is not supported; this offload reads "
            f"schema_version {version}"
        )
