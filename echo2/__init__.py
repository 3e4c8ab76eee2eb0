"""echo2: a peer-to-peer rollout fleet for RL post-training (ECHO-2 design)."""

__version__ = "0.1.0"
PROTOCOL_VERSION = "1.0.0"

__all__ = ["__version__", "PROTOCOL_VERSION"]
