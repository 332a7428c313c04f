"""Hard-link the files of one venv that are byte-identical to files of the project's other venvs.

    python scripts/link_venvs.py NEW_VENV [OTHER_VENV ...]

The four venvs (.venv, .venv-vllm, .venv-vllm-cpu, .venv-sglang) each install a CUDA build of
torch with its nvidia-* wheels: 27.5 GiB in all, 12 GiB of it the same bytes twice or more.
Each setup script calls this after its install, so a clean machine (CI) holds each of those
files once. Only regular files of 64 KiB or more are considered; a file is linked only where
its size, mode and content hash (BLAKE2b) equal another venv's file. A link replaces the file
atomically (a new name in the same folder, then rename), so an interrupted run leaves every
file whole. Nothing writes into an installed file in place (pip replaces or removes files), so
sharing an inode between venvs changes nothing a venv sees. Standard library only.
"""

from __future__ import annotations

import collections
import hashlib
import os
import sys

MIN_BYTES = 64 * 1024


def _files(venv: str):
    for root, _dirs, names in os.walk(venv):
        for name in names:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if os.path.isfile(path) and not os.path.islink(path) and st.st_size >= MIN_BYTES:
                yield path, st


def _digest(path: str) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.digest()


def link(new: str, others: list[str]) -> tuple[int, int]:
    """Link `new`'s files to identical ones in `others`; returns (files linked, bytes saved)."""
    if not os.path.isdir(new):
        raise SystemExit(f"link_venvs: {new!r} is not a directory")
    theirs: dict[tuple[int, int], list[tuple[str, os.stat_result]]] = collections.defaultdict(list)
    for other in others:
        if os.path.isdir(other) and not os.path.samefile(other, new):
            for path, st in _files(other):
                theirs[(st.st_size, st.st_mode)].append((path, st))
    digests: dict[str, bytes] = {}
    linked = saved = 0
    for path, st in _files(new):
        candidates = theirs.get((st.st_size, st.st_mode), [])
        if not candidates or any(c_st.st_ino == st.st_ino and c_st.st_dev == st.st_dev
                                 for _, c_st in candidates):
            continue
        mine = _digest(path)
        for c_path, c_st in candidates:
            if c_st.st_dev != st.st_dev:
                continue
            if c_path not in digests:
                digests[c_path] = _digest(c_path)
            if digests[c_path] == mine:
                tmp = path + ".link-tmp"
                os.link(c_path, tmp)
                os.replace(tmp, path)
                linked += 1
                saved += st.st_size
                break
    return linked, saved


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    others = [o for o in argv[1:] if os.path.isdir(o) and not os.path.samefile(o, argv[0])]
    linked, saved = link(argv[0], others)
    print(f"link_venvs: {argv[0]}: {linked} files shared with {', '.join(others) or 'no other venv'}"
          f" ({saved / 2**30:.1f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
