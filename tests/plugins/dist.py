"""A real installed distribution, made in a test: a folder on PYTHONPATH that holds the
package and its `NAME-VERSION.dist-info` (METADATA, entry_points.txt), which is what pip
leaves in site-packages and all that importlib.metadata (and areal's plug-in registry) reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent


def make(
    root: Path,
    name: str,
    entry_points: dict[str, dict[str, str]],
    packages: tuple[str, ...] = (),
    version: str = "0.1",
) -> Path:
    """Distribution `name` under `root` (the folder to put on PYTHONPATH): the packages of
    tests/plugins named in `packages` copied there, its entry points {group: {name: value}}."""
    root.mkdir(parents=True, exist_ok=True)
    for pkg in packages:
        shutil.copytree(HERE / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) + "\n"
            for group, names in entry_points.items()
        )
    )
    return root
