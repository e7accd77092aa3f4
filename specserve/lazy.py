"""Lazy package attributes (PEP 562): a package names what it exports and the module each comes from,
and imports that module on first use — so `specserve --help`, the CLI's argument errors and
`specserve chat` do not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, table: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The package's ``__getattr__`` and ``__dir__`` for ``table`` (attribute name → module); a value,
    once imported, is kept in ``namespace`` (the package's globals)."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(list(namespace) + list(table))

    return __getattr__, __dir__
