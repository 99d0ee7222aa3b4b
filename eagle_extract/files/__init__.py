"""The output files and their contract: row files, the manifest, shard records, the writer, what verify checks."""
