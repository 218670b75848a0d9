"""Generated gRPC code for the kvplane v1 API (from proto/kvplane/v1; run `make proto`). Never edit by hand."""
