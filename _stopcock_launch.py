"""The ``stopcock`` command's entry point: Ctrl+C is caught from its first line to the process's end.

The console script imports this module, then calls :func:`main`. The import installs a SIGINT
handler that only counts presses; it is the first thing the command does, before anything else
is imported (this module lives outside the ``stopcock`` package, whose import alone takes tens of
milliseconds, and needs nothing but ``signal``). :func:`main` then runs the command line, whose
own handler takes the count over (:class:`stopcock.console.CtrlC`: a press before the run begins
ends the command with exit code 130, and the JSON with ``--json``). Once the command has
returned, a press ends the process at once with the command's exit code; and during the
interpreter's last clean-up, which would restore the default action (death by SIGINT), presses
are ignored. A press before this module runs is the interpreter's: it ends the process as it
would any Python program.
"""

import signal


class _Presses:
    """A SIGINT handler that counts presses (``presses``) and does nothing else."""

    def __init__(self) -> None:
        self.presses = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.presses += 1


if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
    signal.signal(signal.SIGINT, _Presses())

import atexit  # noqa: E402 - after the handler: nothing before it
import os  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    """Run ``stopcock`` with the arguments of the process; returns its exit code."""
    from stopcock.cli import main as command

    try:
        code = command()
    except SystemExit as exc:  # argparse: --help, --version, bad arguments
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        sys.stdout.flush()  # what the command wrote is out before a press can end the process
        sys.stderr.flush()
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)  # the last clean-up resets handlers
    return code
