"""scripts/seed_venv.py: a requirement's installed closure hard-linked from another venv, before pip."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "seed_venv.py"


def _load():
    spec = importlib.util.spec_from_file_location("seed_venv", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dist(venv: Path, name: str, version: str, requires=(), files=None, scripts=()) -> None:
    """An installed distribution as pip leaves it: its files, METADATA and RECORD."""
    site = venv / "lib/python3.12/site-packages"
    files = files if files is not None else {f"{name}/__init__.py": f"# {name} {version}\n"}
    info = f"{name}-{version}.dist-info"
    record = []
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
        record.append(rel)
    for script in scripts:
        path = venv / "bin" / script
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#!{venv.resolve()}/bin/python3\nimport {name}\n")
        path.chmod(0o755)
        record.append(f"../../../bin/{script}")
    (site / info).mkdir(parents=True)
    (site / info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires) + "\nlong description\nRequires-Dist: nope\n")
    record += [f"{info}/METADATA", f"{info}/RECORD"]
    (site / info / "RECORD").write_text("".join(f"{r},,\n" for r in record))


def _venv(root: Path) -> Path:
    (root / "lib/python3.12/site-packages").mkdir(parents=True)
    return root


def _old(tmp_path: Path) -> Path:
    old = _venv(tmp_path / "old")
    _dist(old, "torch", "2.1", scripts=["torchrun"], requires=[
        "cuda-toolkit[cublas]==13.0", "triton~=3.8.0; python_version >= '3'", "sympy>=2",
        "absent>=1", "optree; extra == 'optree'"])
    _dist(old, "cuda_toolkit", "13.0", requires=[
        "nvidia-cublas==13.1.*; extra == 'cublas'", "nvidia-npp==13.0; extra == 'all'"])
    _dist(old, "nvidia_cublas", "13.1.1", files={"nvidia/cublas/lib/libcublas.so": "x" * 1000})
    _dist(old, "nvidia_npp", "13.0")
    _dist(old, "triton", "3.8.1")
    _dist(old, "sympy", "1.0")   # torch asks for >=2: pip's to install, not ours
    _dist(old, "optree", "0.1")  # only for an extra nobody asked for
    return old


def test_the_closure_is_linked_and_nothing_else(tmp_path):
    old, new = _old(tmp_path), _venv(tmp_path / "new")
    (tmp_path / "half-made").mkdir()  # a venv whose setup stopped before it had a site-packages
    out = subprocess.run([sys.executable, str(SCRIPT), str(new), "torch==2.1", "--from", str(old),
                          str(tmp_path / "absent"), str(tmp_path / "half-made")],
                         capture_output=True, text=True, check=True).stdout
    assert "4 distributions for torch==2.1" in out
    site_old, site_new = old / "lib/python3.12/site-packages", new / "lib/python3.12/site-packages"
    infos = sorted(p.name for p in site_new.glob("*.dist-info"))
    assert infos == ["cuda_toolkit-13.0.dist-info", "nvidia_cublas-13.1.1.dist-info",
                     "torch-2.1.dist-info", "triton-3.8.1.dist-info"]
    lib = "nvidia/cublas/lib/libcublas.so"
    assert (site_new / lib).stat().st_ino == (site_old / lib).stat().st_ino
    script = new / "bin/torchrun"
    assert script.read_text().splitlines()[0] == f"#!{new.resolve()}/bin/python3"
    assert os.access(script, os.X_OK)
    assert (old / "bin/torchrun").read_text().startswith(f"#!{old.resolve()}/")  # the source untouched
    assert not list(site_new.rglob("*.seed-tmp"))


def test_a_distribution_already_installed_is_followed_not_replaced(tmp_path):
    """vLLM's venvs install torch with --no-deps first: its dependencies are seeded, it stays."""
    old, new = _old(tmp_path), _venv(tmp_path / "new")
    _dist(new, "torch", "2.1", files={"torch/__init__.py": "# the new venv's own\n"},
          requires=["nvidia-cublas==13.1.1", "sympy>=1"])
    seeded = _load().seed(str(new), "torch==2.1", [str(old)])
    assert [name for name, *_ in seeded] == ["nvidia-cublas", "sympy"]
    assert (new / "lib/python3.12/site-packages/torch/__init__.py").read_text() == "# the new venv's own\n"


def test_a_seed_stopped_half_way_leaves_no_metadata_without_its_files(tmp_path, monkeypatch):
    module = _load()
    old, new = _old(tmp_path), _venv(tmp_path / "new")
    placed = []

    def place(src, dst):
        if len(placed) == 1:
            raise KeyboardInterrupt
        placed.append(dst)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.link(src, dst)

    monkeypatch.setattr(module, "_place", place)
    with pytest.raises(KeyboardInterrupt):
        module.seed(str(new), "torch==2.1", [str(old)])
    assert placed and not list((new / "lib/python3.12/site-packages").glob("*.dist-info"))
