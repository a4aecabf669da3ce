"""Files written whole or not at all.

A reader (another process, a later run) must never see half a file, and a failed write (a full
disk) must leave nothing behind: the text goes to a temporary file beside the target, which is
renamed over it, or removed when anything fails. Standard library only.
"""

from __future__ import annotations

import os


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (UTF-8); an error is raised with nothing left behind."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
