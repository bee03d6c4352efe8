"""``python -m lightning_hetero.models`` prints the preset table (model class and parameter count)."""

from lightning_hetero.models.presets import print_presets

if __name__ == "__main__":
    print_presets()
