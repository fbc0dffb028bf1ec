"""Generated gRPC stubs of proto/ckptd/v1/ckptd.proto (`make proto`).

Internal: use ckptd.Client, which never exposes these types.
"""
