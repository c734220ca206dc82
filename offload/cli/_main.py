"""``main``: parse the arguments, run the subcommand, report a standard output that fails."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload", description="Activation memory manager for PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)
    from offload.cli import _info, _plan, _profile

    _profile.add_parser(sub)
    _plan.add_parser(sub)
    _info.add_parser(sub)
    return p


class _StdoutError(OSError):
    """A write to standard output failed (``offload info > /dev/full``)."""


class _Stdout:
    """``sys.stdout`` while a command runs (``offload profile`` only outside its script): a write
    or flush that fails, other than with a closed pipe, raises :class:`_StdoutError`, so that
    :func:`main` tells it from the command's own file errors (those are reported where they
    happen)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    @property
    def stream(self) -> TextIO:
        """The stream wrapped."""
        return self._stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutError(e.errno, e.strerror) from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise _StdoutError(e.errno, e.strerror) from e

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    # `offload profile` hands the script the stream itself while it runs (see
    # offload.cli._profile.script_stdout): a failed write there is the script's own to handle.
    sys.stdout = _Stdout(stdout)  # type: ignore[assignment]  # writes and flushes suffice
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe or a full disk can still be caught
    except BrokenPipeError:
        # The reader went away (`offload plan ... | head`): stop quietly, as other command-line
        # tools do.
        _discard_output(stdout)
        return 1
    except _StdoutError as e:
        # `offload info > /dev/full`: an output that cannot be written, as for the commands'
        # files (exit status 2).
        print(f"offload: error: cannot write to standard output: {e.strerror}", file=sys.stderr)
        _discard_output(stdout)
        return 2
    finally:
        sys.stdout = stdout
    return code


def _discard_output(stdout: TextIO) -> None:
    # Python flushes stdout once more at exit; send what is left to devnull, else it fails
    # again with a message.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
