"""specmesh gateway: client-facing gRPC front end (streaming, detokenization, stop handling)."""
