#!/usr/bin/env python3
"""README.md's options table against `spillway --help-options`: the same options in the same
order, the same defaults, and every accepted value of an enumerated option named in its row.
Usage: readme_check.py SPILLWAY_CLI README.md. Exits 1 naming each difference."""
import re
import subprocess
import sys


def help_options(cli):
    """[(name, default, choices)] from --help-options ("  NAME default DEFAULT HELP (a|b)")."""
    out = subprocess.run([cli, "--help-options"], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"^  (\S+)\s+default (\S*)\s+(.*)$", line)
        if not m:
            continue
        name, default, text = m.groups()
        c = re.search(r"\(([a-z_]+(?:\|[a-z_]+)+)\)\s*$", text)
        rows.append((name, default, c.group(1).split("|") if c else []))
    if not rows:
        sys.exit(f"readme_check: no options parsed from `{cli} --help-options`:\n{out}")
    return rows


def readme_options(path):
    """[(name, default, meaning)] from the table under '### Options' ("| `name` | `default` | ... |")."""
    text = open(path, encoding="utf-8").read()
    start = text.find("\n### Options\n")
    if start < 0:
        sys.exit(f"readme_check: {path} has no '### Options' section")
    rows = []
    for line in text[start + 1:].splitlines()[1:]:
        if line.startswith("#"):
            break
        m = re.match(r"^\|\s*`([^`]+)`\s*\|\s*(?:`([^`]*)`)?\s*\|(.*)\|\s*$", line)
        if m:
            rows.append((m.group(1), m.group(2) or "", m.group(3)))
    return rows


def main():
    cli, readme = sys.argv[1], sys.argv[2]
    want = help_options(cli)
    have = readme_options(readme)
    errors = []
    wn, hn = [r[0] for r in want], [r[0] for r in have]
    for n in wn:
        if n not in hn:
            errors.append(f"option {n!r} is missing from README.md's table")
    for n in hn:
        if n not in wn:
            errors.append(f"README.md's table has {n!r}, which --help-options does not list")
    if not errors and wn != hn:
        errors.append(f"order differs: --help-options {wn}, README.md {hn}")
    rd = {r[0]: r for r in have}
    for name, default, choices in want:
        if name not in rd:
            continue
        if rd[name][1] != default:
            errors.append(f"{name}: README.md says default {rd[name][1]!r}, --help-options {default!r}")
        for c in choices:
            if c != default and f"`{c}`" not in rd[name][2]:
                errors.append(f"{name}: README.md's row does not name the value `{c}`")
    for e in errors:
        print(f"readme_check: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    print(f"readme_check: {len(want)} options agree")


if __name__ == "__main__":
    main()
