"""Generated protobuf/gRPC code for the KV transfer service. Regenerate from the repo root with
``python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. kvtransport/proto/kvtransfer.proto``.
Only ``kvtransport/grpc_codec.py`` imports these modules: domain code never sees protobuf."""
