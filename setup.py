"""Maps the folders server/, kernels/, operator/ to kvpilot.server, kvpilot.kernels, kvpilot.operator.

Every sub-package is found by walking the folders, so none is silently dropped from the wheel; there
is never a top-level `operator` package (that name is the stdlib module). `kvpilot` itself is a
namespace package: it has no folder of its own.
"""

from setuptools import find_packages, setup

FOLDERS = {"server": "kvpilot.server", "kernels": "kvpilot.kernels", "operator": "kvpilot.operator"}

packages, package_dir = [], {}
for folder, name in FOLDERS.items():
    packages.append(name)
    package_dir[name] = folder
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
