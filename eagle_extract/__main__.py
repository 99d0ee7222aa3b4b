"""`python -m eagle_extract`: the command line."""

from .faces.cli import main

if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports __main__
    main()
