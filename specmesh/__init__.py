"""specmesh: speculative decoding over gRPC microservices."""

__version__ = "0.1.0"
