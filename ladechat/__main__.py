"""`python -m ladechat` and the `ladechat` command: the CLI, with Ctrl-C during its own imports
(typer, rich: a noticeable fraction of a second) ending as Ctrl-C anywhere else does."""

import sys


def run() -> None:
    try:
        from ladechat.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("ladechat: interrupted\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
