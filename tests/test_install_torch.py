"""``scripts/install_torch.py``, which ``make install`` runs before the project: a torch already in
the environment is kept, a bare environment gets a CPU build unless an index is named, and a CUDA
build (PyPI's Linux torch) is recognised from its metadata. Plans only (``--plan``): nothing is
installed. Runtime: about 40 s (one fresh venv, one pip dry run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_torch.py"
sys.path.insert(0, str(SCRIPT.parent))
import install_torch  # noqa: E402  (a script, not a module of the package)

PYPI_TORCH = json.loads((Path(__file__).parent / "data" / "pip_report_torch_pypi.json").read_text())["metadata"]
LINUX = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64"}
MACOS = {"platform_system": "Darwin", "sys_platform": "darwin", "platform_machine": "arm64"}


def plan(python: str | Path, *args: str) -> str:
    result = subprocess.run([str(python), str(SCRIPT), "--plan", *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


def test_a_torch_in_the_environment_is_kept():
    import torch

    out = plan(sys.executable)
    assert out.startswith(f"install-torch: keeping torch {torch.__version__} (")
    assert sys.prefix in out and "TORCH_SPEC" in out
    assert "already satisfies" in plan(sys.executable, "--spec", f"torch=={torch.__version__}")


def test_a_named_index_is_used_as_asked():
    out = plan(sys.executable, "--spec", "torch==2.13.0+cu128", "--index-url", "https://example.org/whl/cu128")
    assert out == "install-torch: installing torch==2.13.0+cu128 from https://example.org/whl/cu128, as asked"


def test_pypis_linux_torch_is_recognised_as_a_cuda_build():
    """Recorded from PyPI: torch 2.13.0 on Linux requires NVIDIA's wheels; on macOS it does not."""
    assert PYPI_TORCH["version"] == "2.13.0"
    on_linux = install_torch.cuda_requirements(PYPI_TORCH, LINUX)
    assert {"cuda-toolkit", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(on_linux)
    assert install_torch.cuda_requirements(PYPI_TORCH, MACOS) == []
    cpu = {"name": "torch", "version": "2.13.0+cpu", "requires_dist": ["filelock", "sympy>=1.13.3"]}
    assert install_torch.cuda_requirements(cpu, LINUX) == []


def test_a_bare_environment_gets_a_cpu_build(tmp_path):
    """What pip's configured sources give decides: a CPU build from them, else the CPU index."""
    venv.create(tmp_path / "env", with_pip=True)
    python = tmp_path / "env" / "bin" / "python"
    out = plan(python)
    configured_cpu = out.startswith("install-torch: installing torch==2.13.0: pip's configured sources give ")
    assert configured_cpu or f"installing the CPU build of torch==2.13.0 from {install_torch.CPU_INDEX}" in out, out
    if configured_cpu:
        assert out.endswith(", a CPU build"), out
