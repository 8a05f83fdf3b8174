"""What the three gRPC services share at their edge: the server wrapper with health, reflection and graceful stop
(`grpc_server`), the guard that turns every handler error into a clean gRPC status (`rpc_guard`), TLS, API keys and
tenants (`security`), session leases (`leases`), the input caps' checks (`limits`) and protobuf <-> Python
conversions (`proto_convert`). It may import the engine's errors, the decoding math, telemetry and config; nothing
below it imports it. A helper only one service uses lives in that service's package instead.
"""
