"""MkDocs hook: the CLI reference page is generated from ``attnextract.cli.build_parser()``.

A page containing the line ``<!-- cli-reference -->`` gets, in its place, one section per
subcommand with a table of its options (the option, its default and what it does), read
from the argparse parser at build time, so options added to cli.py appear by themselves.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    if isinstance(action, argparse._VersionAction):
        return ""
    if action.default is None:
        return "none"
    return str(action.default)


def _option(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs != 0 and action.option_strings:
        metavar = action.metavar or action.dest.upper()
        if action.choices and not action.metavar:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        names += f" {_cell(metavar)}"
    return names


TRAILING_DEFAULT = re.compile(r"\s*\(default:? ((?:[^()]|\([^()]*\))*)\)\s*$")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str | None]:
    """The option's help as ``--help`` shows it, split into (meaning, default in words).

    The default in words is the trailing "(default: ...)" the parser's formatter adds or
    the help states; None when the help says nothing of it."""
    text = parser._get_formatter()._get_help_string(action) or ""
    params = dict(vars(action), prog=parser.prog)
    try:
        text = text % params
    except (KeyError, TypeError, ValueError):
        pass
    match = TRAILING_DEFAULT.search(text)
    if match:
        return text[:match.start()], match.group(1)
    return text, None


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options_table(parser: argparse.ArgumentParser) -> str:
    """One Markdown table per argument group of ``parser``: option, default, meaning."""
    out = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if isinstance(action, argparse._SubParsersAction):
                continue
            meaning, default = _help(parser, action)
            if action.choices and action.metavar:
                meaning += " (one of: " + ", ".join(map(str, action.choices)) + ")"
            default = _default(action) if default is None or action.required else default
            rows.append(f"| {_option(action)} | {_cell(default)} | {_cell(meaning)} |")
        if rows:
            out += [f"**{_cell(group.title)}**", "", "| option | default | meaning |",
                    "|---|---|---|", *rows, ""]
    return "\n".join(out)


def cli_reference_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference: the top-level usage, then one section per subcommand."""
    if parser is None:
        from attnextract.cli import build_parser
        parser = build_parser()
    out = ["```text", parser.format_usage().strip(), "```", "", _cell(parser.description or ""),
           "", options_table(parser)]
    for name, sub in subcommands(parser).items():
        out += [f"## attnextract {name}", "", _cell(sub.description or ""), "", "```text",
                sub.format_usage().strip(), "```", "", options_table(sub)]
        if sub.epilog:
            out += ["```text", sub.epilog.strip(), "```", ""]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    src = str(Path(config["config_file_path"]).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return markdown.replace(MARKER, cli_reference_markdown())
