"""Install torch into an environment before the project, saying which build and why.

    python scripts/install_torch.py [--spec "torch==2.13.0"] [--index-url URL] [--plan]

Run with the environment's own python (``make install`` does). The rules:

- a torch already in the environment is kept unless ``--spec`` names one (``make install
  TORCH_SPEC=...``); the project's install then pins it, so pip fails rather than replace it;
- with ``--index-url`` (``TORCH_INDEX_URL=...``), the spec comes from that index, as asked;
- otherwise the CPU build: pip is asked (``--dry-run``, metadata only) what its configured sources
  would install; a build that pulls NVIDIA's CUDA wheels (PyPI's Linux torch: several GB) is
  replaced by the same spec from PyTorch's CPU index.

Standalone on purpose: it runs before the project (or anything but pip) is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_SPEC = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def say(line: str) -> None:
    print(f"install-torch: {line}", flush=True)


def installed() -> str | None:
    """``version (build)`` of the torch this python imports, or None."""
    if importlib.util.find_spec("torch") is None:
        return None
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                         capture_output=True, text=True, check=True).stdout.split()
    return f"{out[0]} ({'CPU build' if out[1] == 'None' else 'CUDA ' + out[1]})"


CUDA_PREFIXES = ("nvidia-", "cuda-")   # NVIDIA's wheels: nvidia-cudnn-cu13, cuda-toolkit, ...


def cuda_requirements(metadata: dict[str, Any], environment: dict[str, str] | None = None) -> list[str]:
    """The CUDA wheels (NVIDIA's) a torch distribution requires on this platform (``environment``:
    marker values, default this interpreter's), from its metadata as ``pip --report`` gives it."""
    from pip._vendor.packaging.requirements import Requirement   # pip's own, present wherever pip is

    needed = []
    for text in metadata.get("requires_dist") or []:
        req = Requirement(text)
        if not req.name.lower().startswith(CUDA_PREFIXES):
            continue
        # evaluate() completes the given values with this interpreter's
        if req.marker is None or req.marker.evaluate({"extra": "", **(environment or {})}):
            needed.append(req.name)
    return needed


def resolve(spec: str) -> dict[str, Any] | None:
    """What pip's configured sources would install for ``spec`` (torch itself, metadata only), or
    None when the installed torch already satisfies it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet",
                        "--report", str(report), spec], check=True)
        items = json.loads(report.read_text())["install"]
    return next((i["metadata"] for i in items if i["metadata"]["name"].lower() == "torch"), None)


def plan(spec: str | None, index_url: str | None) -> tuple[list[str], str]:
    """(pip arguments, or [] for nothing to install; the reason, said before installing)."""
    have = installed()
    if have and not spec:
        return [], (f"keeping torch {have} already in {sys.prefix} "
                    "(make install TORCH_SPEC=... [TORCH_INDEX_URL=...] installs another)")
    spec = spec or DEFAULT_SPEC
    if index_url:
        return [spec, "--index-url", index_url], f"installing {spec} from {index_url}, as asked"
    found = resolve(spec)
    if found is None:
        return [], f"torch {have} already satisfies {spec}; keeping it"
    cuda = cuda_requirements(found)
    if not cuda:
        return [spec], f"installing {spec}: pip's configured sources give {found['version']}, a CPU build"
    return [spec, "--index-url", CPU_INDEX], (
        f"pip's configured sources give torch {found['version']} with CUDA ({', '.join(cuda)}: "
        "several GB); installing the CPU build of {spec} from {CPU_INDEX} instead "
        "(TORCH_INDEX_URL=https://pypi.org/simple takes the CUDA build)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="", help=f"torch requirement (default: keep one, else {DEFAULT_SPEC})")
    parser.add_argument("--index-url", default="", help="install torch from this index only")
    parser.add_argument("--plan", action="store_true", help="say what would be installed, install nothing")
    args = parser.parse_args(argv)
    pip_args, reason = plan(args.spec.strip() or None, args.index_url.strip() or None)
    say(reason)
    if pip_args and not args.plan:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *pip_args], check=True)
        say(f"torch {installed()} in {sys.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
