"""Drafters: the protocol, the registry and each drafter."""
from specserve.drafters.base import (CommitInfo, DraftRequest, Drafter, TargetInfo, create_drafter,
                                     parse_drafter_spec, register, registered_drafters)
from specserve.drafters import ngram as _ngram  # noqa: F401  (registers "ngram")

__all__ = ["CommitInfo", "DraftRequest", "Drafter", "TargetInfo", "create_drafter", "parse_drafter_spec",
           "register", "registered_drafters"]
