"""A crafted torch checkpoint that writes a file when it is unpickled: the attack the pickle refusals stop.

`write_malicious_pickle(path, sentinel)` saves, with torch.save, a dict whose one value unpickles by calling
`exec` on code that creates `sentinel`. Loading it with `torch.load(..., weights_only=False)` (or plain
pickle) creates the file; `weights_only=True` refuses the `exec` global. Tests assert the sentinel is absent
after the code under test met the file, and `unpickling_runs_it` shows the file is a working attack (so an
absent sentinel means refused, not a dud).
"""

from __future__ import annotations

from pathlib import Path


class _WritesAFile:
    """Pickles as a call to exec() that creates `sentinel`: what an attacker's payload does, harmlessly."""

    def __init__(self, sentinel: Path):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (exec, (f"open({self.sentinel!r}, 'w').write('unpickled')",))


def write_malicious_pickle(path: Path, sentinel: Path) -> Path:
    """A torch.save file at `path` that creates `sentinel` when unpickled."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"weight": torch.zeros(2), "payload": _WritesAFile(sentinel)}, path)
    return path


def unpickling_runs_it(path: Path, sentinel: Path) -> bool:
    """Unpickle `path` the unsafe way and say whether it created `sentinel` (then removes it again)."""
    import torch

    torch.load(path, weights_only=False)  # the attack, on purpose: this is the positive control
    ran = sentinel.exists()
    sentinel.unlink(missing_ok=True)
    return ran
