"""What a user touches: params schema and validation, the Job API and the `wse` command line."""
