"""`python -m eagle_extract` and the `eagle-extract` command: the command line."""

import atexit
import os
import sys

from .faces.cli import main


def run() -> None:
    """The command line, ended without the interpreter's own teardown of every module loaded (2 to 3 s in C with
    torch and vLLM loaded, after the last line): the exit functions run and the streams are flushed first."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"), as Python itself shows it
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports __main__
    run()
