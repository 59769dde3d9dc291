"""How subcommands describe themselves in ``--help``: a one-line summary (the list of commands), a description
(wrapped to the terminal) and examples (shown as written, under "examples:")."""
from __future__ import annotations

import argparse
import re
import textwrap


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions are wrapped paragraph by paragraph (blank line between them); lines indented by two spaces
    (examples, lists) are kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            if para.startswith("  ") or "\n  " in para:
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


def add_command(sub, name: str, *, summary: str, description: str, examples: list[str], **kwargs):
    """A subcommand (or a `cache` action) whose help has its description and examples."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
                          epilog=epilog, formatter_class=HelpFormatter, **kwargs)
