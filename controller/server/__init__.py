"""The I/O edge around the core: gRPC services, HTTP endpoints, conversion and wiring."""
