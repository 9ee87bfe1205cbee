"""What several Conveyor services share: settings, logging, tracing, the gRPC
server bootstrap and client channels, model names, and test process helpers."""
