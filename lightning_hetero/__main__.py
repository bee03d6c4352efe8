"""``python -m lightning_hetero`` is the ``lightning-hetero`` command."""

from lightning_hetero.cli import main

if __name__ == "__main__":
    main()
