"""Keep a node's model libraries off the model hub (A8).

A node needs nothing from a model hub (a policy version carries its config and artifacts), and a
library that may download is a library a hostile hub can make download code (transformers'
kernels loader, remote code). So the node sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``
before transformers is imported; huggingface_hub reads the variable once at import, so a copy
already imported in this process is switched too.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def model_hub_offline(enabled: bool = True) -> None:
    """Force offline mode (``enabled``); ``False`` is the operator's explicit override and leaves the
    environment as it is."""
    if not enabled:
        log.warning("model hub downloads allowed by node config: transformers may fetch code named by a config")
        return
    for var in OFFLINE_VARS:
        os.environ[var] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]


def is_offline() -> bool:
    """Whether huggingface_hub (as imported now, or as it would be imported) refuses the network."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        return bool(getattr(constants, "HF_HUB_OFFLINE", False))
    return all(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in OFFLINE_VARS)
