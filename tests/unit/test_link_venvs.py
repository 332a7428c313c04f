"""scripts/link_venvs.py: byte-identical files across venvs become one inode; nothing else changes."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "link_venvs.py"


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_identical_files_share_an_inode_and_every_other_file_stays_its_own(tmp_path):
    big = os.urandom(100_000)
    old, new = tmp_path / "old", tmp_path / "new"
    kept = _write(old / "lib/torch/libtorch.so", big, 0o755)
    same = _write(new / "lib/torch/libtorch.so", big, 0o755)
    moved = _write(new / "lib/elsewhere/copy.so", big, 0o755)              # same bytes, another path
    one_byte = _write(new / "lib/torch/other.so", big[:-1] + bytes([big[-1] ^ 1]), 0o755)
    other_mode = _write(new / "lib/torch/mode.so", big, 0o644)             # same bytes, another mode
    small = _write(new / "small.py", b"x" * 100)
    _write(old / "small.py", b"x" * 100)

    out = subprocess.run([sys.executable, str(SCRIPT), str(new), str(old), str(tmp_path / "absent")],
                         capture_output=True, text=True, check=True).stdout
    assert "2 files shared" in out
    ino = kept.stat().st_ino
    assert same.stat().st_ino == ino and moved.stat().st_ino == ino
    assert same.read_bytes() == big and moved.read_bytes() == big
    for own in (one_byte, other_mode, small):
        assert own.stat().st_ino != ino and own.stat().st_nlink == 1
    assert not list(new.rglob("*.link-tmp"))
    # a second run finds nothing more to share
    again = subprocess.run([sys.executable, str(SCRIPT), str(new), str(old)],
                           capture_output=True, text=True, check=True).stdout
    assert "0 files shared" in again
