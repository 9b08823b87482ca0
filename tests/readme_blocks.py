"""The README's marked blocks: the fenced block right after `<!-- readme-test: NAME -->` is run by the tests as
written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- readme-test: (?P<name>[\w-]+) -->\n```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)


def readme_block(name: str) -> str:
    """The body of the README block marked `name` (a KeyError names the marks that exist)."""
    blocks = {m["name"]: m["body"] for m in _BLOCK.finditer((ROOT / "README.md").read_text(encoding="utf-8"))}
    if name not in blocks:
        raise KeyError(f"README.md has no block marked {name!r}; marked: {sorted(blocks)}")
    return blocks[name]


def shell_commands(body: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, `# comments` dropped, each split like a shell."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if shlex.split(line, comments=True)]
