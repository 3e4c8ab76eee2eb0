"""What both sides speak: identities, signed envelopes, message schemas, policy packing and
the network layer."""
