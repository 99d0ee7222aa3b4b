"""One job: planned and checked, its output claimed, rows tokenized, the engine run and watched, the output complete."""
