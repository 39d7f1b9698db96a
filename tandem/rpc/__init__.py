"""Generated gRPC/protobuf code for proto/*.proto (see codegen.py; do not edit *_pb2*.py)."""
