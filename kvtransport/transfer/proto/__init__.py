"""Generated protobuf/gRPC code for the KV transfer service. Regenerate from the repo root with
``python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. kvtransport/transfer/proto/kvtransfer.proto``.
Only the gRPC transport (``grpc_codec``, ``grpc_server``, ``grpc_client``) imports these modules: domain code never sees protobuf."""
