"""An agent-style editing workload from real text that ships with Python: the standard
library's own sources.

Each task quotes a stretch of a stdlib module (about `lines` lines, whole functions)
and asks for one of two things agents do all day:

- "edit": rewrite the code with one identifier renamed, all of it, in one code block
  (a file rewrite with a small change: most of the answer copies the context);
- "tool": call an edit tool whose JSON arguments quote the file's path and a line of
  the context with a change (a tool call quoting a path and a snippet).

Tasks are deterministic for a seed. Speculative decoding's model-free methods (suffix,
ngram) draft the copied stretches from the prompt.
"""

from __future__ import annotations

import random
import re
import sysconfig
from pathlib import Path

# modules whose sources are plain, self-contained Python (present in every CPython)
MODULES = ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py",
           "heapq.py", "calendar.py", "string.py", "quopri.py", "netrc.py", "getopt.py",
           "base64.py", "difflib.py", "gettext.py", "sched.py", "dis.py", "cmd.py")

_DEF = re.compile(r"^def (\w+)\(", re.M)
_NAME = re.compile(r"\b([a-z_][a-z0-9_]{3,})\b")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _chunk(source: str, rng: random.Random, lines: int) -> str:
    """About `lines` lines starting at a top-level function definition."""
    starts = [m.start() for m in _DEF.finditer(source)]
    if not starts:
        return "\n".join(source.splitlines()[:lines])
    start = rng.choice(starts[: max(1, len(starts) - 1)])
    return "\n".join(source[start:].splitlines()[:lines]).rstrip() + "\n"


def editing_tasks(num: int, seed: int = 0, lines: int = 40) -> list[str]:
    """`num` user messages (edit and tool tasks, 3:1), from the stdlib's sources."""
    rng = random.Random(seed)
    root = stdlib_dir()
    sources = {name: (root / name).read_text() for name in MODULES if (root / name).is_file()}
    if not sources:
        raise FileNotFoundError(f"no stdlib sources found under {root}")
    tasks = []
    names = sorted(sources)
    for i in range(num):
        name = names[i % len(names)]
        code = _chunk(sources[name], rng, lines)
        if i % 4 == 3:
            line = rng.choice([ln for ln in code.splitlines() if len(ln.strip()) > 12] or [code])
            changed = line.replace("(", "( ", 1) if "(" in line else line + "  # changed"
            tasks.append(
                f"You can call the tool edit_file(path, old_str, new_str). In Lib/{name} "
                f"below, replace the line\n{line.strip()}\nwith\n{changed.strip()}\n"
                "Reply with only the JSON of the call, quoting the lines exactly.\n\n"
                f"```python\n{code}```"
            )
            continue
        idents = sorted({m for m in _NAME.findall(code) if m not in {"self", "return", "import"}})
        old = rng.choice(idents) if idents else "value"
        tasks.append(
            f"Here is part of Lib/{name}:\n\n```python\n{code}```\n\nRename `{old}` to "
            f"`{old}_v2` everywhere and output the complete updated code in one python code "
            "block, with no other text."
        )
    return tasks
