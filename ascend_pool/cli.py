"""The ascend-pool command line. Each subcommand lives in ascend_pool/commands/NAME.py and
registers itself with register(subparsers)."""

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from .commands import bench, check_config, ps, replay, serve, trace
from .errors import BackendUnavailableError, PoolError
from .version import __version__

COMMANDS = (replay, bench, serve, check_config, ps, trace)


def _version():
    """The installed distribution's version (the package's own where it is run from a source tree)."""
    try:
        return version("ascend_pool")
    except PackageNotFoundError:
        return __version__


def build_parser():
    parser = argparse.ArgumentParser(prog="ascend-pool", description="ascend_pool: caching NPU memory pool tools")
    parser.add_argument("--version", action="version", version=f"ascend-pool {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    _no_abbreviations(parser)
    parser.commands = sub.choices  # name -> its parser: a mistake after a command gets that command's usage
    return parser


def _no_abbreviations(parser):
    """No option is taken by a prefix of its name (argparse's allow_abbrev), in any command: a
    prefix read as another option, silently (`check-config FILE --device 1`, as serve's and
    replay's --device, was --device-bytes 1, and `--device 8` an 8-byte device that every quota
    overcommits, exit 0). An unknown option is a usage error naming it."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _no_abbreviations(child)


def _command_parser(parser, args):
    """The innermost parser args went through (`trace convert`'s, not `trace`'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def main(argv=None):
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would print the top-level usage; the command's is the one that helps
        _command_parser(parser.commands[args.command], args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except (PoolError, ValueError, OSError) as e:
        print(f"ascend-pool {args.command}: {type(e).__name__}: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's 128 + SIGINT, one line, not a traceback
        print(f"ascend-pool {args.command}: interrupted", file=sys.stderr)
        return 130


def _message(e):
    """e's message for the command's one line. A runtime that did not load lists the libraries it
    tried one per line (BackendUnavailableError, as the Python API raises it): here on the same
    line, "; " between them. Other messages as they are (check-config's are one line per mistake)."""
    text = str(e)
    if isinstance(e, BackendUnavailableError):
        text = " ".join(line.strip() + ("" if line.rstrip().endswith(":") else ";") for line in text.splitlines()
                        if line.strip()).rstrip(";")
    return text


if __name__ == "__main__":
    sys.exit(main())
