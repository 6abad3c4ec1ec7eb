"""pyproject lists its packages one by one (the folders are mapped into the rankwatch namespace): a new
subpackage left out of the list imports in the editable install and is missing from the image."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found.add(".".join([package, *relative.parts]))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
