"""The packages only the applications use (scikit-learn, mnist1d, matplotlib): pipetrain installs them with
its ``examples`` extra, not as dependencies of the library."""
from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'pipetrain[examples]'"


def import_extra(module: str, package: str, needed_by: str) -> ModuleType:
    """Import ``module`` of the distribution ``package``; when it is missing, an ImportError that says what
    needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{needed_by} needs {package}, which the library itself does not install: "
                          f"{INSTALL} (or pip install {package})") from error
