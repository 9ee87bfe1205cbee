"""Clients of the gateway's gRPC services (tokenizer, engines, detok): each holds the
records it sends and reads and converts them to and from protobuf; nothing else in the
gateway imports *_pb2, and a failed call is an `errors.UpstreamError`."""
