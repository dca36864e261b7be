"""The coordinator core: save sessions, the commit state machine, the catalog (no gRPC)."""
