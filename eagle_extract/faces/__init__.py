"""The faces: the command line, the Python API, and the HTTP server with its Mooncake transfer."""
