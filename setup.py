"""What goes into the wheel; everything else about the package is in pyproject.toml.

The packages are found, not listed: a hand-kept list once left out rlnotes.agents, and only a
non-editable install noticed (tests/test_package.py now builds the wheel and compares it with the
tree). The YAML tree lives at the top-level conf/ and installs as the rlnotes.conf package, every
group folder's YAML with it: pyproject.toml's [tool.setuptools.packages.find] cannot map a folder to
another package name, which is why this file exists.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["rlnotes", "rlnotes.*"]), "rlnotes.conf"],
    package_dir={"rlnotes.conf": "conf"},
    package_data={"rlnotes.conf": ["**/*.yaml"]},
)
