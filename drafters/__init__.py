"""Drafters: the protocol, the registry and each drafter."""

from pathlib import Path

from specserve.numba_cache import package_dir, register_package

register_package(Path(__file__).parent, package_dir("specserve.verify"))  # Medusa's tree builder calls verify's

from specserve.drafters.base import (CommitInfo, DraftRequest, Drafter, TargetInfo, create_drafter,
                                     parse_drafter_spec, register, registered_drafters)
from specserve.drafters import ngram as _ngram  # noqa: F401  (registers "ngram")
from specserve.drafters import draft_model as _draft_model  # noqa: F401  (registers "draft")
from specserve.drafters import medusa as _medusa  # noqa: F401  (registers "medusa")
from specserve.drafters import eagle as _eagle  # noqa: F401  (registers "eagle")
from specserve.drafters import suffix as _suffix  # noqa: F401  (registers "suffix")
from specserve.drafters import lookahead as _lookahead  # noqa: F401  (registers "lookahead")
from specserve.drafters import hybrid as _hybrid  # noqa: F401  (registers "hybrid")

__all__ = ["CommitInfo", "DraftRequest", "Drafter", "TargetInfo", "create_drafter", "parse_drafter_spec",
           "register", "registered_drafters"]
