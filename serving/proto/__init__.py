"""The gRPC API: inkling.proto and its generated stubs (regenerate with `make proto`)."""
