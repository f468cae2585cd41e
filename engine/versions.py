"""What a node must agree on with every other: the library versions and the engine's code."""

import hashlib
from importlib import metadata

from .config import PACKAGE

__version__ = "0.2.0"  # the package's version (pyproject.toml reads it here)
PACKAGES = ("mlx", "mlx-lm", "numpy", "titan-engine")


def version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        if pkg == "titan-engine":  # a source tree that was not pip-installed
            return __version__
        return None


def versions() -> dict:
    out = {p: version(p) for p in PACKAGES}
    if version("mlx-cuda-13"):
        out["mlx-cuda-13"] = version("mlx-cuda-13")
    return out


def code_digest() -> str:
    """A digest of the engine's source files: two nodes with the same version number but
    different code differ here."""
    h = hashlib.sha256()
    for f in sorted(PACKAGE.rglob("*.py")):
        h.update(str(f.relative_to(PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]
