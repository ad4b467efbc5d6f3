"""Whether the running script makes a worker process from code outside `if __name__ == "__main__":`.

A process started with "spawn" (`Workers(processes=1)`) runs the main script again; a script whose
training code sits at its top level would make the Loader again in the child, which fails while
starting (after seconds of imports and a long traceback). `unguarded_main_line()` finds, before any
process is started, the line of the main script (outside any main guard) that led to this call, so
the Loader can name the fix at once.
"""

from __future__ import annotations

import ast
import os
import sys


def unguarded_main_line() -> tuple[str, int] | None:
    """(main script, line) when the current call comes from top-level code of the `__main__` script
    that no `if __name__ == "__main__":` block holds; None when guarded, or when there is no script to
    run again (an interactive session, `python -c`, a notebook) or it cannot be read."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return None
    path = os.path.abspath(path)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals.get("__name__") == "__main__"
                                     and os.path.abspath(frame.f_code.co_filename) == path):
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test) and node.lineno <= line <= (node.end_lineno or 0):
            return None
    return path, line


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
