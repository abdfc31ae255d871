"""Every option of every ``hf-eagle3`` command (:mod:`hf_eagle3.cli`) explains itself and names its default."""

from __future__ import annotations

import argparse

from hf_eagle3.cli import build_parser


# ------------------------------------------------------------------------------------------------- help lines
def _subparsers(parser: argparse.ArgumentParser, path=()):
    """Every (sub)command parser under ``parser``, with its command path."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


# Options of `bench` (hf_eagle3/cli.py, owned elsewhere) whose help does not state a default yet; remove an entry
# once its help says it.
KNOWN_WITHOUT_DEFAULT = set()


def test_every_option_of_every_command_explains_itself_and_its_default():
    commands = dict(_subparsers(build_parser()))
    assert {("demo",), ("bench",), ("prepare",), ("train",), ("export",)} <= set(commands)
    problems = []
    for path, parser in commands.items():
        parser.format_help()  # renders
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            text = action.help or ""
            if not text.strip() or text == argparse.SUPPRESS:
                problems.append(f"{' '.join(path)} {name}: no help")
            takes_value = action.option_strings and action.nargs != 0 and not action.required
            if takes_value and "default" not in text.lower() and (path[0], name) not in KNOWN_WITHOUT_DEFAULT:
                problems.append(f"{' '.join(path)} {name}: help names no default ({text!r})")
    assert not problems, "\n".join(problems)
