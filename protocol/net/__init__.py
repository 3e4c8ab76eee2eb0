"""Network layer: libp2p control plane and the TCP data plane (trio at the edges)."""
