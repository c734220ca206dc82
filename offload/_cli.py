"""The ``offload`` command line (also ``python -m offload``)."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload", description="Activation memory manager for PyTorch training."
    )
    sub = p.add_subparsers(dest="command", required=True)
    from offload import _cli_info, _cli_plan, _cli_profile

    _cli_profile.add_parser(sub)
    _cli_plan.add_parser(sub)
    _cli_info.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:
        # The reader went away (`offload plan ... | head`): stop quietly, as other command-line
        # tools do. Python flushes stdout once more at exit; send that to devnull, else it fails
        # again with a message.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
