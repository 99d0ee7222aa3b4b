"""The worker side, inside vLLM's workers: the decoder found, states captured, matched to requests and written."""
