"""Seed a new venv, before pip runs, with distributions another project venv already installed.

    python scripts/seed_venv.py NEW_VENV REQUIREMENT [--from OTHER_VENV ...]

Each venv of this project installs a CUDA build of torch with its nvidia-* wheels (about 5 GiB
unpacked, the wheels downloaded beside them). scripts/link_venvs.py shares identical files
*after* an install, but the install itself still needs that disk at its peak: on a CI machine
with 3 GiB left the SGLang venv's install failed. This script starts from REQUIREMENT (say
"torch==2.14.1"): where NEW_VENV already has it (installed with --no-deps) or another venv has a
version it admits, that distribution and, following its metadata (markers and extras
evaluated for this interpreter), every dependency some venv holds at an admitted version are
hard-linked into NEW_VENV's site-packages, their files first and their .dist-info last. pip then
finds them installed (it keeps an installed version that satisfies a requirement) and neither
downloads nor unpacks them; a dependency no venv holds is left for pip to install.

Console scripts are copied with their "#!" line pointing at NEW_VENV's python. A run stopped half
way leaves no .dist-info without its files, so pip installs whatever was not finished. Every venv
must be on one file system (hard links); where one is not, that venv is not used. Needs
`packaging` (run it with .venv's python).
"""

from __future__ import annotations

import csv
import glob
import os
import shutil
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def site_packages(venv: str) -> str | None:
    """`venv`'s one site-packages folder (None: it has none, or several)."""
    found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    return found[0] if len(found) == 1 else None


def _dists(site: str) -> dict[str, tuple[Version, str]]:
    """canonical name -> (version, .dist-info path) of every distribution installed in `site`."""
    out = {}
    for info in glob.glob(os.path.join(site, "*.dist-info")):
        name, _, version = os.path.basename(info)[: -len(".dist-info")].rpartition("-")
        out[canonicalize_name(name)] = (Version(version), info)
    return out


def _requires(info: str, extras: frozenset[str]) -> list[Requirement]:
    """The requirements in `info`'s METADATA that apply here with `extras` requested."""
    reqs = []
    with open(os.path.join(info, "METADATA"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                    reqs.append(req)
            elif not line.strip():
                break  # the headers end at the first blank line
    return reqs


def _place(src: str, dst: str) -> None:
    """Hard-link src at dst, replacing what is there in one rename."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = dst + ".seed-tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.link(src, tmp)
    os.replace(tmp, dst)


def _copy_script(src: str, dst: str, old_venv: str, new_venv: str) -> None:
    """A console script, its "#!" line naming new_venv's python instead of old_venv's."""
    with open(src, "rb") as f:
        data = f.read()
    first, sep, rest = data.partition(b"\n")
    if first.startswith(b"#!"):
        first = first.replace(os.fsencode(old_venv), os.fsencode(new_venv))
    tmp = dst + ".seed-tmp"
    with open(tmp, "wb") as f:
        f.write(first + sep + rest)
    shutil.copymode(src, tmp)
    os.replace(tmp, dst)


def _link_dist(info: str, old_venv: str, new_venv: str) -> int:
    """Link one distribution's files (its RECORD) from old_venv into new_venv (absolute paths);
    returns their bytes."""
    old_site, new_site = site_packages(old_venv), site_packages(new_venv)
    with open(os.path.join(info, "RECORD"), newline="", encoding="utf-8") as f:
        paths = [row[0] for row in csv.reader(f) if row]
    info_rel = os.path.relpath(info, old_site)
    size = 0
    for rel in sorted(paths, key=lambda p: p.startswith(info_rel + "/")):  # .dist-info last
        src = os.path.normpath(os.path.join(old_site, rel))
        dst = os.path.normpath(os.path.join(new_site, rel))
        if not os.path.isfile(src) or os.path.islink(src):
            continue  # a .pyc never written there, or a link pip made: pip makes its own
        if os.path.commonpath([src, old_site]) == old_site:
            _place(src, dst)
        elif os.path.commonpath([src, old_venv]) == old_venv:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            _copy_script(src, dst, old_venv, new_venv)
        else:
            continue  # outside the venv: not pip's to find there
        size += os.path.getsize(src)
    return size


def seed(new_venv: str, requirement: str, others: list[str]) -> list[tuple[str, str, int]]:
    """Seed new_venv from others; returns (name, version, bytes) of each distribution linked."""
    new_venv, others = os.path.abspath(new_venv), [os.path.abspath(o) for o in others]
    new_site = site_packages(new_venv)
    if new_site is None:
        raise SystemExit(f"seed_venv: {new_venv!r} has no one site-packages folder (create the venv first)")
    dev = os.stat(new_site).st_dev
    sites = {o: site_packages(o) for o in others if os.path.isdir(o) and not os.path.samefile(o, new_venv)}
    sources = [(o, _dists(site)) for o, site in sites.items()  # a half-made venv is no source
               if site is not None and os.stat(site).st_dev == dev]
    mine = _dists(new_site)
    seeded, seen = [], set()
    queue = [Requirement(requirement)]
    while queue:
        req = queue.pop(0)
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name in mine:
            if not req.specifier.contains(mine[name][0], prereleases=True):
                continue  # pip replaces it; what it needs is pip's to find
            info = mine[name][1]
        else:
            held = [(o, d[name]) for o, d in sources
                    if name in d and req.specifier.contains(d[name][0], prereleases=True)]
            if not held:
                continue
            old_venv, (version, info) = held[0]
            seeded.append((name, str(version), _link_dist(info, old_venv, new_venv)))
            mine = _dists(new_site)
            info = mine[name][1]
        queue.extend(_requires(info, extras))
    return seeded


def main(argv: list[str]) -> int:
    if len(argv) < 2 or (len(argv) > 2 and argv[2] != "--from"):
        print(__doc__, file=sys.stderr)
        return 2
    new_venv, requirement = argv[0], argv[1]
    others = [o for o in argv[3:] if os.path.isdir(o) and not os.path.samefile(o, new_venv)]
    seeded = seed(new_venv, requirement, others)
    total = sum(size for *_, size in seeded)
    print(f"seed_venv: {new_venv}: {len(seeded)} distributions for {requirement} linked from "
          f"{', '.join(others) or 'no other venv'} ({total / 2**30:.1f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
