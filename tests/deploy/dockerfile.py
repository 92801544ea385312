"""The Dockerfile and .dockerignore read the way Docker reads them, for static checks without an engine."""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    arguments: str

    def exec_form(self) -> list[str] | None:
        """The JSON-array form of CMD, ENTRYPOINT or HEALTHCHECK CMD, else None."""
        text = self.arguments
        if self.keyword == "HEALTHCHECK":
            text = text.split(" CMD ", 1)[1] if " CMD " in f" {text}" else ""
        try:
            value = json.loads(text.strip())
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, list) else None


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                values[key] = value
        return values


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages with their instructions; continuation lines joined, comments dropped, ARG defaults applied to FROM."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = arguments.partition("=")
            args[name.strip()] = default.strip()
        elif keyword == "FROM":
            words = arguments.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
        else:
            stages[-1].instructions.append(Instruction(keyword, arguments.strip()))
    return stages


def build_context(root: Path, dockerignore: Path) -> list[Path]:
    """The files `docker build root` sends, by .dockerignore's rules (last matching pattern wins;
    a pattern that matches a directory matches everything under it; `!` re-includes)."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    reincluded: list[str] = []
    for raw in dockerignore.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        rules.append((include, _pattern_regex(pattern)))
        if include:
            reincluded.append(pattern)
    sent = []
    for directory, subdirectories, files in os.walk(root):
        base = Path(directory).relative_to(root).as_posix().removeprefix(".").lstrip("/")
        # Skip directories nothing can be sent from (.git, .venv), as Docker's walk would find nothing there.
        subdirectories[:] = [
            name
            for name in subdirectories
            if _sent(f"{base}/{name}".lstrip("/"), rules)
            or any(p.startswith(("*", f"{base}/{name}/".lstrip("/"))) for p in reincluded)
        ]
        for name in files:
            relative = f"{base}/{name}".lstrip("/")
            if _sent(relative, rules):
                sent.append(Path(relative))
    return sorted(sent)


def _sent(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for include, regex in rules:
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not include
    return not excluded


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)
