"""Wrap the lines ruff reports as too long (E501) where that needs no judgement.

Usage: ``.venv/bin/python scripts/wrap_long_lines.py PATH...`` (files or folders). Handles
full-line comments, trailing comments (moved above their line), lines inside docstrings and
other triple-quoted text, and string literals that stand alone on their line (split into two
implicitly concatenated literals). Code lines are left alone: run ``ruff format`` on them or
wrap them by hand. Re-run until it changes nothing.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

LIMIT = 100
PREFIX = re.compile(r"^(\s*)([rRbBuUfF]{0,2})(\"|')")


def long_lines(paths: list[str]) -> dict[Path, list[int]]:
    out = subprocess.run([".venv/bin/ruff", "check", "--select", "E501", "--output-format=concise",
                          *paths], check=False, capture_output=True, text=True).stdout
    found: dict[Path, list[int]] = {}
    for line in out.splitlines():
        m = re.match(r"^(\S+\.py):(\d+):\d+: E501", line)
        if m:
            found.setdefault(Path(m.group(1)), []).append(int(m.group(2)))
    return found


def split_at(text: str, limit: int) -> int:
    """Where to break ``text`` (a space before ``limit``, after the indentation); -1: nowhere."""
    indent = len(text) - len(text.lstrip())
    cut = text.rfind(" ", indent + 1, limit)
    return cut if cut > indent + 10 else -1


def classify(source: str) -> tuple[set[int], dict[int, int], set[int]]:
    """Lines inside multi-line strings, trailing-comment columns, lines that are one string."""
    inside: set[int] = set()
    comment_at: dict[int, int] = {}
    lone: set[int] = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    by_line: dict[int, list[tokenize.TokenInfo]] = {}
    previous = None
    for tok in tokens:
        # only docstrings (a string that is a statement of its own): an assigned triple-quoted
        # string may be code run elsewhere, whose lines must not move
        if tok.type == tokenize.STRING and tok.start[0] != tok.end[0] and (
                previous is None or previous.type in (tokenize.INDENT, tokenize.NEWLINE,
                                                      tokenize.DEDENT, tokenize.NL)):
            inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
            inside.add(tok.start[0])
        if tok.type not in (tokenize.COMMENT,):
            previous = tok
        if tok.type == tokenize.COMMENT:
            comment_at[tok.start[0]] = tok.start[1]
        by_line.setdefault(tok.start[0], []).append(tok)
    for n, toks in by_line.items():
        kinds = [t for t in toks if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                                   tokenize.DEDENT, tokenize.COMMENT)]
        string_types = (tokenize.STRING, getattr(tokenize, "FSTRING_START", -1))
        strings = [t for t in kinds if t.type in string_types]
        if len(strings) == 1 and kinds[0] is strings[0] and toks[0].start[0] == toks[-1].end[0]:
            rest = [t for t in kinds if t.type == tokenize.OP]
            if all(t.string in (",", ")", "(") for t in rest) and kinds[0].type == tokenize.STRING:
                lone.add(n)
    return inside, comment_at, lone


def fix_file(path: Path, numbers: list[int]) -> bool:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    try:
        inside, comment_at, lone = classify(source)
    except (tokenize.TokenError, SyntaxError):
        return False
    changed = False
    for n in sorted(numbers, reverse=True):
        i = n - 1
        text = lines[i].rstrip("\n")
        indent = text[: len(text) - len(text.lstrip())]
        stripped = text.lstrip()
        if n in comment_at and not stripped.startswith("#") and n not in inside:
            col = comment_at[n]
            code, comment = text[:col].rstrip(), text[col:]
            if re.match(r"#\s*(noqa|type:|pragma|fmt:)", comment):
                continue  # must stay on its line
            if len(code) <= LIMIT:
                lines[i] = f"{indent}{comment}\n{code}\n"
                changed = True
            continue
        if stripped.startswith("#"):
            cut = split_at(text, LIMIT)
            if cut > 0:
                lines[i] = f"{text[:cut]}\n{indent}# {text[cut + 1:].lstrip()}\n"
                changed = True
            continue
        if n in inside:
            cut = split_at(text, LIMIT)
            if cut > 0 and not text[cut + 1:].lstrip().startswith('"""'):
                lines[i] = f"{text[:cut]}\n{indent}{text[cut + 1:]}\n"
                changed = True
            continue
        if n in lone:
            m = PREFIX.match(text)
            if not m:
                continue
            prefix, quote = m.group(2), m.group(3)
            if quote * 3 in text:
                continue
            cut = split_at(text, LIMIT - 1)
            body_start = len(m.group(0))
            if cut <= body_start:
                continue
            head, tail = text[: cut + 1], text[cut + 1:]
            if "f" in prefix.lower():
                fields = head[body_start:].replace("{{", "").replace("}}", "")
                if fields.count("{") != fields.count("}"):
                    continue  # would split a replacement field
            if head.count("\\") % 2:
                continue
            tail_prefix = prefix if "f" not in prefix.lower() or "{" in tail else prefix.replace(
                "f", "").replace("F", "")
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if n + 1 in lone and nxt.lstrip().startswith(prefix + quote) and quote * 3 not in nxt \
                    and nxt.startswith(indent + prefix + quote):
                # flow the rest into the next literal of the same kind (re-split later if long)
                body = nxt[len(indent) + len(prefix) + 1:]
                lines[i] = f"{head}{quote}\n"
                rest = tail[:-1] if tail.endswith(quote) else tail
                lines[i + 1] = f"{indent}{prefix}{quote}{rest}{body}"
                if not tail.endswith(quote):
                    lines[i] = f"{head}{quote}\n{indent}{tail_prefix}{quote}{tail}\n"
            else:
                lines[i] = f"{head}{quote}\n{indent}{tail_prefix}{quote}{tail}\n"
            changed = True
    if changed:
        path.write_text("".join(lines), encoding="utf-8")
    return changed


def main() -> None:
    paths = sys.argv[1:] or ["src"]
    for _ in range(20):
        found = long_lines(paths)
        if not any(fix_file(p, ns) for p, ns in found.items()):
            break
    left = long_lines(paths)
    print(f"{sum(len(v) for v in left.values())} long lines left")
    for p, ns in left.items():
        print(f"  {p}: {', '.join(map(str, ns))}")


if __name__ == "__main__":
    main()
