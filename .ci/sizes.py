"""Size limits of the service's code: no function over 60 lines, no class over 600,
in daemon/, shm/, journal/, fleet/, client/ and protocol/ (lines from ``def``/``class`` to the end of
the body, docstring and comments included).

Classes still over the limit are listed in ``OVER`` with the most lines they may
have: the list may only shrink, and a listed class that grows fails the check as
a new one does. Exit status 0 when every limit holds.

    python .ci/sizes.py        (or: make lint)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("daemon", "shm", "journal", "fleet", "client", "protocol")
FUNCTION_LINES = 60
CLASS_LINES = 600

# Classes over the limit, with the most lines they may have until they are split (none
# today: a class that outgrows the limit is split into rooms, as TimerWheel, ClientCore and
# Journal were).
OVER: dict[str, int] = {}


def sizes(root: Path = ROOT):
    """(path:name, kind, lines) of every function and class in FOLDERS."""
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    kind = "class" if isinstance(node, ast.ClassDef) else "def"
                    name = f"{path.relative_to(root)}:{node.name}"
                    yield name, kind, node.end_lineno - node.lineno + 1, node.lineno


def problems(root: Path = ROOT) -> list[str]:
    out = []
    for name, kind, lines, lineno in sizes(root):
        limit = FUNCTION_LINES if kind == "def" else OVER.get(name, CLASS_LINES)
        if lines > limit:
            where = name.split(":")[0]
            out.append(f"{where}:{lineno}: {kind} {name.split(':')[1]} is {lines} lines (the limit is {limit})")
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        print(f"sizes: every function <= {FUNCTION_LINES} lines, every class <= {CLASS_LINES}"
              + (f" (but {len(OVER)} listed in .ci/sizes.py)" if OVER else ""))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
